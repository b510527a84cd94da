"""``simulate`` of every scenario's full-size presets on TPU v4 and H100: the README's preset table.

    python benchmarks/presets.py [--hardware tpu-v4,h100] [--markdown]

Each full-size (simulation-only) preset of each registered scenario is lowered with the strategy
and mesh in :data:`RUNS` (a scenario or preset missing there is an error: every preset gets a
row) and priced by the analytical model with overlap, as ``partir-emu simulate`` does. These are
model predictions, not measurements: ``partir-emu fidelity`` says how far such predictions are
from published runs. The time to lower and to price each program is printed too (ours only; the
anchor of that speed is ``benchmarks/simulate_speed.py``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from partir_emu.app.cli.simulate import model_flops_per_device  # noqa: E402
from partir_emu.app.experiment import Experiment  # noqa: E402
from partir_emu.core.mesh import Mesh  # noqa: E402
from partir_emu.hwmodels.analytical import simulate  # noqa: E402
from scenarios.common import get_scenario, list_scenarios  # noqa: E402

# scenario -> preset -> (strategy, mesh): the parallelism such a model is trained/served with
RUNS: dict[str, dict[str, tuple[str, str]]] = {
    "mlp": {"full": ("bp+mp+z3", "batch=64,model=8")},
    "transformer": {"t32": ("bp+mp+z3", "batch=64,model=8"), "t48": ("bp+mp+z3", "batch=64,model=8")},
    "inference": {"palm540b-decode": ("mq+ws", "batch=4,model=16"), "palm540b-prefill": ("bp+mq", "batch=4,model=16"),
                  "palm62b-decode": ("bp+mq", "batch=4,model=16")},
    "gns": {"full": ("bp+edge", "batch=2,model=4"), "xl": ("bp+edge", "batch=2,model=32")},
    "unet": {"ddpm32": ("bp", "batch=8"), "ddpm256": ("bp+spatial+z3", "batch=16,spatial=4")},
}


def row(scenario: str, preset: str, strategy: str, mesh: str, hardware: str) -> dict:
    t = time.perf_counter()
    exp = Experiment(scenario, strategy, Mesh.parse(mesh), preset)
    spmd = exp.lower().spmd
    t_lower = time.perf_counter() - t
    t = time.perf_counter()
    rep = simulate(spmd, hardware, overlap=True, model_flops=model_flops_per_device(exp))
    return {"scenario": scenario, "preset": preset, "strategy": strategy, "mesh": mesh, "hardware": hardware,
            "step_ms": rep.step_s * 1e3, "mfu": rep.mfu, "peak_gib": rep.peak_bytes_per_device / 2 ** 30, "fits": rep.fits,
            "lower_s": t_lower, "price_s": time.perf_counter() - t}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="tpu-v4,h100")
    ap.add_argument("--scenarios", default="", help="comma-separated subset (default: all)")
    args = ap.parse_args(argv)
    names = args.scenarios.split(",") if args.scenarios else list_scenarios()
    missing = [(n, p) for n in names for p in sorted(get_scenario(n).simulation_only) if p not in RUNS.get(n, {})]
    if missing:
        raise SystemExit(f"presets without a run in RUNS: {missing}; add their strategy and mesh")
    print("| scenario | preset | strategy | mesh | hardware | step | MFU | peak / device | fits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in names:
        for preset, (strategy, mesh) in RUNS[n].items():
            for hw in args.hardware.split(","):
                r = row(n, preset, strategy, mesh, hw)
                mfu = "-" if r["mfu"] is None else f"{r['mfu'] * 100:.1f} %"
                print(f"| {n} | {preset} | {strategy} | {mesh} | {hw} | {r['step_ms']:.1f} ms | {mfu} | "
                      f"{r['peak_gib']:.1f} GiB | {'yes' if r['fits'] else 'no'} |", flush=True)
                print(f"  lowered in {r['lower_s']:.1f} s, priced in {r['price_s']:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
