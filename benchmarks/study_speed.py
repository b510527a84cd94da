"""Configurations per minute of ``partir-emu study`` on the full-size 48-layer transformer, against
what a user does without it: a shell loop of ``partir-emu simulate``, one process per configuration.

    python benchmarks/study_speed.py [--quick] [--anchor-samples 3]

The grid: ``transformer --size t48`` (5.75 B parameters), strategies bp+mp+z3 and bp+z3, every mesh
of 256 and 512 chips (``--mesh auto``; ``--quick``: 256 only), on tpu-v4 and h100, each as it is,
with ``ici_bw*2`` and with ``hbm_gb=64``. Rows:

- ``study, 1 process``: the whole grid in one process: each program lowered once, priced on every
  spec, what-if and placement (placement search included) with one Analyzer.
  ``once lowered`` is configurations / pricing seconds: the issue's goal (>= 1,000/min) is about it.
- ``study, 2 workers``: the same grid over ``--jobs 2`` (wall time; both cores).
- ``again, cached``: the grid priced a second time in the same process: every collective and
  equation price is a cache hit, only the placement search and the step's assembly are redone.
  The ceiling of what caching alone gives.
- ``simulate loop``: ``partir-emu simulate`` as a subprocess for ``--anchor-samples`` configurations
  drawn from the grid (median seconds each): the anchor.

Medians where there are repeats; the load average is printed. Each figure is measured in this run.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="256 chips only")
    ap.add_argument("--anchor-samples", type=int, default=3)
    args = ap.parse_args(argv)
    chips = [256] if args.quick else [256, 512]
    load0 = os.getloadavg()[0]
    configs = grid("transformer", "t48", None, STRATEGIES, "auto", chips, HARDWARE, [WhatIf.parse(w) for w in WHAT_IFS])
    print(f"study speed: transformer t48, {STRATEGIES}, chips {chips}, {', '.join(HARDWARE)} x (as is, "
          f"{', '.join(WHAT_IFS)}): {len(configs)} configurations, {len(groups(configs))} programs")

    study = Study()
    t0 = time.perf_counter()
    rows = study.run(configs)
    wall1 = time.perf_counter() - t0
    priced, price1 = sum(r.priced for r in rows), study.price_s
    t0 = time.perf_counter()
    again = study.run(configs)
    wall_again, price_again = time.perf_counter() - t0, study.price_s - price1
    assert [r.figures.get("step_s") for r in again] == [r.figures.get("step_s") for r in rows]

    t0 = time.perf_counter()
    pooled, _, _ = run_pool(configs, 2, {"stack": "xla", "placement": None, "overlap": True})
    wall2 = time.perf_counter() - t0
    same = [r.figures.get("step_s") for r in pooled] == [r.figures.get("step_s") for r in rows]

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

    print(f"{priced} of {len(configs)} configurations priced (the rest do not lower: heads not divisible)")
    print(f"{'mode':<20}{'wall s':>9}{'lower s':>9}{'price s':>9}{'/min wall':>10}{'/min priced':>12}")
    print(f"{'study, 1 process':<20}{wall1:>9.1f}{study.lower_s:>9.1f}{price1:>9.1f}"
          f"{rate(priced, wall1)}{rate(priced, price1):>12}")
    print(f"{'study, 2 workers':<20}{wall2:>9.1f}{'':>9}{'':>9}{rate(priced, wall2)}{'':>12}"
          f"   rows equal 1 process: {same}")
    print(f"{'again, cached':<20}{wall_again:>9.1f}{'':>9}{price_again:>9.1f}{rate(priced, wall_again)}"
          f"{rate(priced, price_again):>12}")
    print(f"{'simulate loop':<20}{per_anchor:>9.1f}{'':>9}{'':>9}{rate(1, per_anchor)}{'':>12}"
          f"   median of {len(anchor)} subprocess(es), s per configuration")
    print(f"study (2 workers) vs simulate loop: {per_anchor / (wall2 / priced):.1f}x the configurations per minute")
    once = 60 * priced / price1
    print(f"goal >= 1000 configurations/min once lowered: {once:.0f}/min in 1 process -> "
          f"{'meets' if once >= 1000 else 'does NOT meet'} the goal")
    print(f"(load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end, {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
