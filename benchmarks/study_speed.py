"""Configurations per minute of ``partir-emu study`` on the full-size 48-layer transformer, against
what a user does without it: a shell loop of ``partir-emu simulate``, one process per configuration.

    python benchmarks/study_speed.py [--quick] [--repeats 3] [--anchor-samples 3]

The grid: ``transformer --size t48`` (5.75 B parameters), strategies bp+mp+z3 and bp+z3, every mesh
of 256 and 512 chips (``--mesh auto``; ``--quick``: 256 only), on tpu-v4 and h100, each as it is,
with ``ici_bw*2`` and with ``hbm_gb=64``. Rows:

- ``study, 1 process``: the whole grid in one process, each program lowered once, then priced on every
  spec, what-if and placement (placement search included) with one Analyzer. The pricing pass is
  repeated ``--repeats`` times over the same lowered programs, each from a cold Analyzer
  (``Study.cold_copy``): its median wall and CPU seconds. ``of which analysis``: the work the
  configurations of a program share (its analysis, overlap plan, memory profile, the fusion plan per
  chip; ``Study.analyse``), part of the pricing seconds. ``/min priced`` is configurations / pricing
  seconds, the figure of the issue's goal (>= 1,000/min once lowered); ``once analysed`` leaves the
  shared analysis out.
- ``study, 2 workers``: the same grid over ``--jobs 2`` (wall time, lowering included, both cores);
  its ``/min priced`` is configurations / (pricing seconds summed over the two workers / 2): the rate
  of both cores pricing, each measured while the other worked.
- ``again, cached``: the grid priced a second time in the first process: the placement searches are
  kept (``Analyzer.searches``), so only the chosen placements are priced again.
- ``simulate loop``: ``partir-emu simulate`` as a subprocess for ``--anchor-samples`` configurations
  drawn from the grid (median seconds each): the anchor.

The machine may be shared: the load average is printed at the start and the end, and the ratios to
the anchor (measured in the same run) are what carries over. Each figure is measured in this run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from partir_emu.app.study.evaluate import Study  # noqa: E402
from partir_emu.app.study.pool import groups, run_pool  # noqa: E402
from partir_emu.app.study.space import grid, sample  # noqa: E402
from partir_emu.app.study.whatif import WhatIf  # noqa: E402

STRATEGIES, HARDWARE, WHAT_IFS = "bp+mp+z3,bp+z3", ["tpu-v4", "h100"], ["ici_bw*2", "hbm_gb=64"]
GOAL = 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256 chips only")
    ap.add_argument("--repeats", type=int, default=3, help="pricing passes over the lowered programs (median)")
    ap.add_argument("--anchor-samples", type=int, default=3)
    args = ap.parse_args(argv)
    chips = [256] if args.quick else [256, 512]
    load0 = os.getloadavg()[0]
    configs = grid("transformer", "t48", None, STRATEGIES, "auto", chips, HARDWARE, [WhatIf.parse(w) for w in WHAT_IFS])
    print(f"study speed: transformer t48, {STRATEGIES}, chips {chips}, {', '.join(HARDWARE)} x (as is, "
          f"{', '.join(WHAT_IFS)}): {len(configs)} configurations, {len(groups(configs))} programs")

    study = Study()
    t0 = time.perf_counter()
    for c in configs:
        study.lowered(c)
    lower_wall = time.perf_counter() - t0
    passes, rows = [], None
    for r in range(max(1, args.repeats)):
        s = study if r == 0 else study.cold_copy()
        w0, c0 = time.perf_counter(), time.process_time()
        got = s.run(configs)
        passes.append((time.perf_counter() - w0, time.process_time() - c0, s.analyse_s))
        assert rows is None or [x.to_json() for x in got] == [x.to_json() for x in rows], "a pricing pass differed"
        rows = got
    assert rows is not None
    priced = sum(r.priced for r in rows)
    price_wall = statistics.median(p[0] for p in passes)
    price_cpu = statistics.median(p[1] for p in passes)
    analyse = statistics.median(p[2] for p in passes)

    t0 = time.perf_counter()
    again = study.run(configs)
    wall_again = time.perf_counter() - t0
    assert [r.to_json() for r in again] == [r.to_json() for r in rows]

    t0 = time.perf_counter()
    pooled, _, pool_price = run_pool(configs, 2, {"stack": "xla", "placement": None, "overlap": True})
    wall2 = time.perf_counter() - t0
    same = [r.to_json() for r in pooled] == [r.to_json() for r in rows]

    anchor = []
    # the loop's user would write a TOML per what-if; the anchor prices specs as they are
    as_is = [c for c, r in zip(configs, rows) if r.priced and not c.what_if.edits]
    for c in sample(as_is, args.anchor_samples, seed=1):
        cmd = [str(Path(sys.executable).parent / "partir-emu"), "simulate", c.scenario, "--size", c.size, "--strategy",
               c.strategy, "--mesh", c.to_json()["mesh"], "--hardware", c.hardware]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=dict(os.environ), timeout=600)
        anchor.append(time.perf_counter() - t0)
    per_anchor = statistics.median(anchor) if anchor else float("nan")

    def rate(n: int, s: float) -> str:
        return f"{60 * n / s:>9.0f}"

    once1 = 60 * priced / price_wall
    once2 = 60 * priced / (pool_price / 2)
    print(f"{priced} of {len(configs)} configurations priced (the rest do not lower: heads not divisible)")
    print(f"{'mode':<20}{'wall s':>9}{'lower s':>9}{'price s':>9}{'/min wall':>10}{'/min priced':>12}")
    print(f"{'study, 1 process':<20}{lower_wall + price_wall:>9.1f}{lower_wall:>9.1f}{price_wall:>9.1f}"
          f"{rate(priced, lower_wall + price_wall)}{rate(priced, price_wall):>12}"
          f"   pricing: median of {len(passes)} passes ({', '.join(f'{p[0]:.1f}' for p in passes)} s), "
          f"CPU {price_cpu:.1f} s")
    print(f"{'  of which analysis':<20}{'':>9}{'':>9}{analyse:>9.1f}{'':>10}{rate(priced, price_wall - analyse):>12}"
          f"   once analysed ({len({c.lowering_key for c, r in zip(configs, rows) if r.priced})} programs "
          f"analysed, {len(HARDWARE)} chips' fusion plans each)")
    print(f"{'study, 2 workers':<20}{wall2:>9.1f}{'':>9}{pool_price:>9.1f}{rate(priced, wall2)}{once2:>12.0f}"
          f"   rows equal 1 process: {same}; price s summed over the workers")
    print(f"{'again, cached':<20}{wall_again:>9.1f}{'':>9}{wall_again:>9.1f}{rate(priced, wall_again)}"
          f"{rate(priced, wall_again):>12}")
    print(f"{'simulate loop':<20}{per_anchor:>9.1f}{'':>9}{'':>9}{rate(1, per_anchor)}{'':>12}"
          f"   median of {len(anchor)} subprocess(es), s per configuration")
    print(f"study vs simulate loop: 2 workers {per_anchor / (wall2 / priced):.1f}x the configurations per minute "
          f"of wall time; once lowered {per_anchor * once1 / 60:.0f}x (1 process), {per_anchor * once2 / 60:.0f}x "
          f"(2 workers)")
    for label, once in (("1 process", once1), ("2 workers", once2)):
        print(f"goal >= {GOAL} configurations/min once lowered: {once:.0f}/min, {label} -> "
              f"{'meets' if once >= GOAL else 'does NOT meet'} the goal")
    print(f"(load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end, {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
