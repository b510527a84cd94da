"""``partir-emu study``: a hardware-modelling sweep in one command (the grid: :mod:`partir_emu.app.study.space`;
its pricing: :mod:`~partir_emu.app.study.evaluate`; its outputs: :mod:`~partir_emu.app.study.output`).

    partir-emu study transformer --size t48 --hardware tpu-v4,tpu-v5p,h100 --chips 256,512 \\
        --strategy all --mesh auto --set microbatches=1,4 --what-if 'ici_bw*2' --what-if 'hbm_gb=64'
"""
from __future__ import annotations

import argparse
import os
import time

from partir_emu.app import checks
from partir_emu.app.cli.phases import Phases
from partir_emu.app.cli.simulate import add_placement_arg, add_stack_arg
from partir_emu.app.common import write_report
from partir_emu.app.study.evaluate import Study, des_check, ranked, sensitivity
from partir_emu.app.study.output import plot, sensitivity_table, table, write_csv
from partir_emu.app.study.pool import groups, run_pool
from partir_emu.app.study.space import grid, parse_chips, sample, split_list
from partir_emu.app.study.whatif import WhatIf
from partir_emu.errors import PartirError

PROGRESS_EVERY_S = 2.0


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("study", help="price a grid of configurations (hardware x chips x strategy x mesh x --set x "
                                     "what-if): ranked table, CSV/JSON, Pareto plot, sensitivity")
    p.add_argument("scenario", help="scenario name (see `partir-emu list`)")
    p.add_argument("--size", default=None, help="size preset (e.g. t48)")
    p.add_argument("--set", dest="overrides", default=None, metavar="K=V[,V...],...",
                   help="overrides; a key with several values is a grid axis: microbatches=1,4,seq=2048")
    p.add_argument("--strategy", default="all", help="all (the scenario's strategies but auto) or a list: bp+z3,bp+mp+z3")
    p.add_argument("--mesh", default="auto", help="auto (every factorisation of each --chips over the strategy's "
                   "axes) or meshes joined by ';': 'batch=64,model=4;batch=128,model=2'")
    p.add_argument("--chips", default=None, help="chip counts for --mesh auto, e.g. 256,512,1024")
    p.add_argument("--hardware", default="tpu-v4", help="spec names or .toml paths joined by ',' (default %(default)s)")
    p.add_argument("--what-if", dest="what_ifs", action="append", default=[], metavar="EDITS",
                   help="a spec variant priced beside each spec as it is: ici_bw*2, hbm_gb=64, "
                        "chip.flops_bf16_per_s*1.5, several joined by ','; repeatable")
    add_stack_arg(p)
    add_placement_arg(p)
    p.add_argument("--jobs", type=checks.positive_int, default=None,
                   help="worker processes, each pricing whole programs (default: the cores, at most one per "
                        "program; 1 prices in this process)")
    p.add_argument("--budget", type=checks.positive_int, default=None,
                   help="price this many configurations drawn at random from the grid (--seed)")
    p.add_argument("--seed", type=checks.nonnegative_int, default=0, help="seed of --budget's sample")
    p.add_argument("--rank", choices=("step", "cost"), default="step",
                   help="best first by step time, or by cost (chips x step)")
    p.add_argument("--top", type=checks.positive_int, default=20, help="rows of the table (default %(default)s)")
    p.add_argument("--sensitivity-top", type=checks.nonnegative_int, default=5,
                   help="the best K configurations get a sensitivity row (each spec field x2; default %(default)s)")
    p.add_argument("--des-top", type=checks.nonnegative_int, default=0,
                   help="re-check the best K in the discrete-event model (programs without loops)")
    p.add_argument("--csv", default=None, metavar="FILE.csv", help="every configuration, one row each")
    p.add_argument("--report", default=None, metavar="FILE.json", help="every configuration and the study's inputs")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="step time vs --plot-x, Pareto front joined")
    p.add_argument("--plot-x", choices=("memory", "cost"), default="memory")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(fn=cmd_study)


def cmd_study(args: argparse.Namespace) -> int:
    for path, flag in ((args.csv, "--csv"), (args.report, "--report")):
        checks.check_output_path(path, flag)
    checks.check_plot_path(args.plot, "--plot")
    what_ifs = [WhatIf.parse(t) for t in args.what_ifs]
    hardware = split_list(args.hardware, "--hardware")
    chips = parse_chips(args.chips) if args.chips else None
    configs = sample(grid(args.scenario, args.size, args.overrides, args.strategy, args.mesh, chips, hardware,
                          what_ifs), args.budget, args.seed)
    study = Study(args.stack, None if args.placement == "auto" else args.placement)
    for hw in hardware:                               # a wrong spec or what-if fails before any lowering
        for w in (WhatIf(), *what_ifs):
            study.spec(hw, w)
    t0 = time.perf_counter()
    with Phases("study", quiet=args.quiet) as phases:
        last = [0.0]

        def progress(i: int, row: object) -> None:
            now = time.perf_counter() - t0
            if now - last[0] >= PROGRESS_EVERY_S or i + 1 == len(configs):
                last[0] = now
                eta = now / (i + 1) * (len(configs) - i - 1)
                phases.phase(f"{i + 1} of {len(configs)} configurations, ETA {eta:.0f} s")

        jobs = args.jobs or min(os.cpu_count() or 1, len(groups(configs)))
        if jobs > 1:
            rows, study.lower_s, study.price_s = run_pool(
                configs, jobs, {"stack": args.stack, "placement": study.placement, "overlap": study.overlap}, progress)
        else:
            rows = study.run(configs, progress)
        grid_wall, lower_s, price_s = time.perf_counter() - t0, study.lower_s, study.price_s   # the grid's alone
        best = ranked(rows, "chip_s" if args.rank == "cost" else "step_s")
        for r in [r for r in best if r.status == "ok"][:args.sensitivity_top]:
            phases.phase(f"sensitivity of {r.config.hardware} {r.config.strategy} {r.config.to_json()['mesh']}")
            r.sensitivity = sensitivity(study, r)
        for r in [r for r in best if r.status == "ok"][:args.des_top]:
            phases.phase(f"DES of {r.config.hardware} {r.config.strategy} {r.config.to_json()['mesh']}")
            try:
                r.des_step_s = des_check(study, r)
            except PartirError as exc:              # a program the DES does not take (loops): said, not fatal
                r.reason = f"no DES check: {exc}"
    wall = time.perf_counter() - t0
    priced = sum(r.priced for r in rows)
    print(table(best, args.top))
    sens = sensitivity_table(best)
    if sens:
        print("\n" + sens)
    print(f"\n{len(rows)} configurations ({priced} priced, {sum(r.status == 'ok' for r in rows)} fit) in {grid_wall:.1f} s: "
          f"lowering {lower_s:.1f} s ({len({c.lowering_key for c in configs})} programs), pricing "
          f"{price_s:.1f} s ({60 * priced / max(price_s, 1e-9):.0f} configurations/min once lowered"
          + (f" on one core, {60 * priced * jobs / max(price_s, 1e-9):.0f} on {jobs} workers' cores; "
             f"{60 * priced / max(grid_wall, 1e-9):.0f}/min of wall time" if jobs > 1 else "") + ")"
          + (f"; sensitivity and DES checks {wall - grid_wall:.1f} s" if wall - grid_wall >= 0.05 else ""))
    if args.csv:
        write_csv(args.csv, best)
    write_report({"scenario": args.scenario, "size": args.size, "set": args.overrides, "hardware": hardware,
                  "what_if": [w.label for w in what_ifs], "stack": args.stack, "rank": args.rank, "wall_s": wall,
                  "lower_s": lower_s, "price_s": price_s, "rows": [r.to_json() for r in best]},
                 args.report)
    if args.plot:
        plot(args.plot, best, "chip_s" if args.plot_x == "cost" else "peak_gib")
    for path in (args.csv, args.report, args.plot):
        if path:
            print(f"wrote {path}")
    return 0


__all__ = ["add_subcommands", "cmd_study"]
