"""``partir-emu compare-xla``: our SPMD program and XLA's, compiled from the same shardings.

The scenario step is lowered here, its in/out shardings exported with
:func:`partir_emu.interop.to_jax`, and ``jax.jit(step, in_shardings, out_shardings)`` compiled
by XLA for ``N`` fake CPU devices in a child process (:mod:`partir_emu.app.xla.child`: jax fixes
its device count when its backend starts, so the parent's jax is never touched). Both
programs' collectives are then printed side by side, per kind and per set of mesh axes, with
whether XLA's executable kept every exported in/out sharding; ``--run`` also runs both programs
on the same inputs and compares the numbers (:mod:`partir_emu.app.xla.child` states the
criterion). ``--strategy all`` does this for every strategy the scenario offers in one child
process, one table each; the strategies the mesh cannot carry (Megatron without a ``model``
axis) are listed as skipped. The exit status is 1 if XLA changed a sharding or, with ``--run``,
gave other numbers.

XLA combines collectives, so raw instruction counts do not compare. The normalised view counts
*tensors*, not instructions, in four families:

- ``reduction``: all-reduce + reduce-scatter. XLA's CPU backend merges all-reduces into one
  tuple instruction, and may write a reduce-scatter as an all-reduce followed by a
  dynamic-slice (REFERENCE.md, "This machine"). Both sides count a reduce-scatter by its full
  input buffer, which is what such an all-reduce moves, so the family's bytes compare.
- ``all-gather``, ``collective-permute``: a combined tuple instruction counts one per tensor.
- ``all-to-all``: a tuple all-to-all (one operand per peer) is one exchange.

Bytes are per device, local shapes, the full buffer (an all-gather's output, the others'
input): :func:`partir_emu.core.spmd.collective_bytes`. XLA's partitioner is free to choose
another algorithm for the same in/out layouts (e.g. move activations instead of weights); the
table shows what it chose, it does not judge it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence

from partir_emu.app import checks
from partir_emu.app.cli.phases import Phases
from partir_emu.app.common import add_experiment_args, experiment_from_args, write_report
from partir_emu.app.experiment import Experiment
from partir_emu.errors import PartirError, ScenarioError, UsageError

FAMILY = {"all-reduce": "reduction", "reduce-scatter": "reduction", "all-gather": "all-gather",
          "all-to-all": "all-to-all", "collective-permute": "collective-permute"}
FAMILIES = ("reduction", "all-gather", "all-to-all", "collective-permute")
# LLVM's code generation at -O0: about half the CPU compile time. It runs after every HLO pass (SPMD
# partitioning, collective combining), so the collectives are the same; the numbers may round differently.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
ALL = "all"                 # --strategy all: every strategy the scenario offers, in one child process
MAX_DEVICES = 1024          # REFERENCE.md: XLA on 1024 fake CPU devices compiles a small step in ~8 s


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare-xla", help="compile the exported shardings with XLA on fake CPU devices and print "
                                           "both programs' collectives side by side (--strategy all: every "
                                           "strategy of the scenario, one table each, in one child process)")
    add_experiment_args(p)
    p.add_argument("--run", action="store_true", help="also run both programs on the same inputs and compare their "
                   "outputs: elementwise (rtol 1e-5, atol 1e-6), else both runs within the verdict's reach of correct runs "
                   "against float64; exit 1 if they differ, or if XLA changed a sharding")
    p.add_argument("--hlo", default=None, metavar="PATH", help="write XLA's compiled HLO module here")
    p.add_argument("--timeout", type=checks.seconds, default=600.0, help="seconds before the XLA child is stopped")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.set_defaults(fn=cmd_compare_xla)


def run_child(cases: Sequence[dict], devices: int, timeout: float, xla_flags: str = "") -> list[dict]:
    """Compile (and with ``run``, execute) ``cases`` in one child process with ``devices`` fake CPU
    devices; the child's answers in order (a case that was bad input has ``error``). ``xla_flags``
    are appended to the child's ``XLA_FLAGS`` (the tests pass ``FAST_COMPILE``)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    req = json.dumps({"devices": devices, "cases": list(cases)})
    try:
        done = subprocess.run([sys.executable, "-m", "partir_emu.app.xla.child"], input=req, capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise UsageError(f"compare-xla: XLA did not finish within --timeout {timeout:g} s; "
                         "raise it or use a smaller --size") from None
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"the XLA child process failed (exit {done.returncode}): {tail}")
    return json.loads(done.stdout)["cases"]


def normalise(records: Sequence[dict]) -> dict[str, dict[str, dict[str, int]]]:
    """``family -> axes -> {"count": tensors, "bytes": ...}`` (see the module docstring)."""
    out: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: {"count": 0, "bytes": 0}))
    for r in records:
        cell = out[FAMILY[r["kind"]]][r["axes"]]
        cell["count"] += r["tensors"]
        cell["bytes"] += r["bytes"]
    return {f: dict(v) for f, v in out.items()}


def raw(records: Sequence[dict]) -> dict[str, dict[str, int]]:
    """``kind -> {"instructions", "tensors", "bytes"}``, as each program wrote them."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"instructions": 0, "tensors": 0, "bytes": 0})
    for r in records:
        out[r["kind"]]["instructions"] += 1
        out[r["kind"]]["tensors"] += r["tensors"]
        out[r["kind"]]["bytes"] += r["bytes"]
    return dict(out)


def table(ours: dict, xla: dict) -> list[dict]:
    """One row per (family, axes) either side has: both sides' count and bytes, and whether they agree."""
    rows = []
    for fam in FAMILIES:
        for axes in sorted(set(ours.get(fam, {})) | set(xla.get(fam, {}))):
            a = ours.get(fam, {}).get(axes, {"count": 0, "bytes": 0})
            b = xla.get(fam, {}).get(axes, {"count": 0, "bytes": 0})
            rows.append({"family": fam, "axes": axes or "-", "ours": a, "xla": b, "same": a == b})
    return rows


def render(rep: dict) -> str:
    mesh = ",".join(f"{k}={v}" for k, v in rep["mesh"].items())
    head = (f"{rep['scenario']} / {rep['strategy']} on {rep['devices']} devices ({mesh}): partir-emu vs "
            f"XLA (jax {rep['jax_version']}, {rep['devices']} CPU devices, compiled in {rep['compile_s']:.2f} s)")
    lines = [head, "normalised (count = tensors; reduction = all-reduce + reduce-scatter):",
             f"  {'family':<19}{'axes':<14}{'partir-emu':>10}{'bytes':>12}{'XLA':>8}{'bytes':>12}"]
    for r in rep["normalised"]:
        mark = "" if r["same"] else "   differs"
        lines.append(f"  {r['family']:<19}{r['axes']:<14}{r['ours']['count']:>10}{r['ours']['bytes']:>12}"
                     f"{r['xla']['count']:>8}{r['xla']['bytes']:>12}{mark}")
    if not rep["normalised"]:
        lines.append("  (no collectives on either side)")
    lines.append("as written (instructions / tensors / bytes):")
    for side in ("ours", "xla"):
        kinds = ", ".join(f"{k} {v['instructions']}/{v['tensors']}/{v['bytes']}" for k, v in sorted(rep["raw"][side].items()))
        lines.append(f"  {'partir-emu' if side == 'ours' else 'XLA':<11}{kinds or 'none'}")
    same = sum(r["same"] for r in rep["normalised"])
    lines.append(f"  {same} of {len(rep['normalised'])} rows agree")
    if "outputs" in rep:
        lines.append(_render_outputs(rep["outputs"]))
    else:
        lines.append("XLA kept the exported shardings: " + _layout(rep))
    return "\n".join(lines)


def _render_outputs(o: dict) -> str:
    head = (f"outputs: {o['count']} compared, largest |XLA - partir-emu| {o['max_abs']:.3g} (at {o['worst_output']!r}, "
            f"{o['worst_ratio']:.2f} of atol 1e-6 + rtol 1e-5); ")
    if o["criterion"] == "elementwise":
        same = "equal to rounding elementwise: yes"
    elif o["criterion"] == "shape":
        same = f"equal to rounding: NO, other shapes ({o['shapes']})"
    else:
        n = o["normwise"]
        same = (f"not elementwise; XLA's error {n['err']:.2e} at {n['worst_output']!r} (jax.jit's own "
                f"{n['baseline_err']:.2e}; beyond the reach of correct runs {n['excess']:.2e}, allowed {n['bound']:.2e}); "
                f"XLA verified vs float64: {'yes' if o['xla_verified'] else 'NO'}, "
                f"partir-emu: {'yes' if o['ours_verified'] else 'NO'}; equal to rounding: "
                f"{'yes' if o['verified'] else 'NO'}")
    return head + same + f"; XLA kept the exported shardings: {_layout(o)}"


def _layout(o: dict) -> str:
    return "yes" if o["layout_ok"] else "NO (" + "; ".join(o["layout_mismatches"][:3]) + ")"


def failed(rep: dict) -> bool:
    """XLA changed an exported sharding, or (with ``--run``) its numbers are not ours."""
    return not rep["layout_ok"] or ("outputs" in rep and not rep["outputs"]["verified"])


def report(exp: Experiment, answer: dict) -> dict:
    """The JSON report of one comparison, from the child's answer."""
    ours_n, xla_n = normalise(answer["ours"]), normalise(answer["xla"])
    rep = {"scenario": exp.scenario_name, "strategy": exp.strategy, "mesh": dict(exp.mesh.axes),
           "devices": exp.mesh.size, "size": exp.cfg, "jax_version": answer["jax_version"],
           "compile_s": answer["compile_s"], "normalised": table(ours_n, xla_n),
           "raw": {"ours": raw(answer["ours"]), "xla": raw(answer["xla"])},
           "collectives": {"ours": answer["ours"], "xla": answer["xla"]},
           "in_specs": answer["in_specs"], "out_specs": answer["out_specs"],
           "layout_ok": answer["layout_ok"], "layout_mismatches": answer["layout_mismatches"]}
    if "diffs" in answer:
        worst = max(answer["diffs"].items(), key=lambda kv: kv[1]["worst_ratio"], default=("", {"worst_ratio": 0.0}))
        rep["outputs"] = {"count": answer["outputs"], "layout_ok": answer["layout_ok"], "verified": answer["verified"],
                          "layout_mismatches": answer["layout_mismatches"], "criterion": answer["criterion"],
                          "worst_output": worst[0], "worst_ratio": worst[1]["worst_ratio"],
                          "max_abs": max((d["max_abs"] for d in answer["diffs"].values()), default=0.0),
                          "per_output": answer["diffs"]}
        rep["outputs"].update({k: answer[k] for k in ("shapes", "normwise", "xla_verified", "ours_verified", "xla_verdict",
                                                      "ours_verdict") if k in answer})
    return rep


def _experiments(args: argparse.Namespace) -> tuple[list[Experiment], dict[str, str]]:
    """The experiments to compare (one, or with ``--strategy all`` one per strategy the scenario
    offers) and, for ``all``, the strategies the mesh cannot carry with the reason. Every schedule is
    built here, so bad input fails before the child starts."""
    exp = experiment_from_args(args)
    if args.strategy != ALL:
        _ = exp.schedule    # a bad strategy or mesh fails here
        return [exp], {}
    exps, skipped = [], {}
    for name in exp.scenario.strategies:
        one = dataclasses.replace(exp, strategy=name)
        try:
            _ = one.schedule
        except ScenarioError as err:          # e.g. mp on a mesh without a model axis
            skipped[name] = str(err)
            continue
        exps.append(one)
    if not exps:
        raise UsageError(f"--strategy all: no strategy of {exp.scenario_name!r} fits --mesh {args.mesh}; "
                         f"for example: {next(iter(skipped.values()))}")
    return exps, skipped


def cmd_compare_xla(args: argparse.Namespace) -> int:
    checks.check_output_path(args.report, "--report")
    checks.check_output_path(args.hlo, "--hlo")
    exps, skipped = _experiments(args)
    exp = exps[0]
    checks.check_mesh_size(exp.mesh, MAX_DEVICES, "compare-xla")
    if args.run and exp.preset in exp.scenario.simulation_only:
        raise UsageError(f"--run: size {exp.preset!r} of {exp.scenario_name!r} is for simulation only; drop --run "
                         "(compiling needs no arrays) or choose another --size")
    if args.hlo and len(exps) > 1:
        raise UsageError("--hlo writes one module: give one --strategy, not all")
    cases = [{"scenario": e.scenario_name, "strategy": e.strategy, "mesh": args.mesh, "size": e.preset,
              "overrides": args.overrides, "seed": args.seed, "run": args.run,
              "hlo_path": os.path.abspath(args.hlo) if args.hlo else None} for e in exps]
    with Phases("compare-xla", quiet=args.quiet) as phases:
        phases.phase(f"lowering, and compiling {len(cases)} step{'s' if len(cases) > 1 else ''} with XLA in a "
                     "child process")
        answers = run_child(cases, exp.mesh.size, args.timeout)
    errors = [a["error"] for a in answers if "error" in a]
    if errors:
        raise PartirError(errors[0])
    reps = [report(e, a) for e, a in zip(exps, answers)]
    bad = [r["strategy"] for r in reps if failed(r)]
    if args.strategy == ALL:
        write_report({"scenario": exp.scenario_name, "mesh": dict(exp.mesh.axes), "strategies": reps,
                      "skipped": skipped}, args.report)
        print("\n\n".join(render(r) for r in reps))
        for name, why in skipped.items():
            print(f"skipped {name}: {why}")
        what = "gives our numbers and keeps" if args.run else "keeps"
        print(f"{len(reps) - len(bad)} of {len(reps)} strategies: XLA {what} the exported shardings"
              + (f"; not: {', '.join(bad)}" if bad else ""))
    else:
        write_report(reps[0], args.report)
        print(render(reps[0]))
    if args.hlo:
        print(f"wrote {args.hlo}")
    return 1 if bad else 0
