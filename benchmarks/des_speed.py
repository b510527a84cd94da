"""Speed of the DES: one transformer training step on 256, 1024 and 4096 TPU v4 chips.

For each chip count it lowers the 32-layer transformer (``t32``: d_model 2560, 32 heads,
2.78 B parameters) with ``bp+mp`` on ``Mesh(batch=N/16, model=16)`` (abstract tracing, no
arrays; timed apart), prices it with the analytical model, then runs ``simulate_des`` and
reports wall time, simpy events and events/s, flows, the device classes the SPMD-symmetry
shortcut kept, and the DES step time next to the analytical one. A DES event here is a
batch-level event (e.g. one step of one collective over all its groups, thousands of
messages as numpy arrays), so flows/s — messages simulated per second, each routed and
rate-shared — is the figure to set against a one-event-per-message design. Beside it, simpy's raw
event rate on this machine, measured in the same run: one process yielding 500k
``env.timeout``\\ s (nothing else), best of 3.

Then the network model choice, on a 64-chip step (2 layers): the flow model against
store-and-forward chunks of several sizes — step time vs the analytical closed form and
wall time — which is why flows are the default.

    python benchmarks/des_speed.py                 # 256, 1024, 4096 chips (~1-2 minutes here)
    python benchmarks/des_speed.py --chips 256 --layers 4 --no-chunks
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def simpy_raw_rate(n: int = 500_000, reps: int = 3) -> float:
    """Bare ``env.timeout`` events per second (one process, nothing else), best of ``reps``."""
    import simpy

    def proc(env):
        for _ in range(n):
            yield env.timeout(1)

    best = 0.0
    for _ in range(reps):
        env = simpy.Environment()
        env.process(proc(env))
        t0 = time.perf_counter()
        env.run()
        best = max(best, n / (time.perf_counter() - t0))
    return best


def lower(chips: int, layers: int, model: int = 16):
    from partir_emu.app.experiment import Experiment
    from partir_emu.core.mesh import Mesh
    exp = Experiment("transformer", "bp+mp", Mesh(batch=chips // model, model=model), "t32", f"layers={layers}")
    return exp.lower().spmd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chips", default="256,1024,4096", help="comma-separated chip counts")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--no-chunks", action="store_true", help="skip the flow vs chunk comparison")
    args = ap.parse_args(argv)

    from partir_emu.hwmodels import load_spec, place, simulate
    from partir_emu.hwmodels.des import simulate_des

    spec = load_spec("tpu-v4")
    raw = simpy_raw_rate()
    print(f"simpy raw event rate (timeouts only, this machine, this run): {raw:,.0f} events/s\n")
    print(f"transformer t32 ({args.layers} layers), bp+mp, Mesh(batch=N/16, model=16), tpu-v4, one training step")
    head = (f"{'chips':>6}{'slice':>10}{'eqns':>7}{'colls':>7}{'lower s':>9}{'DES wall s':>12}{'events':>10}"
            f"{'events/s':>11}{'of raw':>7}{'flows':>12}{'flows/s':>12}{'classes':>8}{'analytical ms':>15}{'DES ms':>11}{'err':>9}")
    print(head)
    results = []
    for chips in (int(c) for c in args.chips.split(",")):
        t0 = time.perf_counter()
        spmd = lower(chips, args.layers)
        lower_s = time.perf_counter() - t0
        pl = place(spmd.mesh, spec)
        ana = simulate(spmd, spec, pl)
        des = simulate_des(spmd, spec, pl)
        rate = des.events / des.wall_s
        err = (ana.step_s - des.step_s) / des.step_s
        dims = "x".join(map(str, pl.topology.dims))
        print(f"{chips:>6}{dims:>10}{len(spmd.program.eqns):>7}{len(des.collectives):>7}{lower_s:>9.1f}"
              f"{des.wall_s:>12.2f}{des.events:>10}{rate:>11,.0f}{100 * rate / raw:>6.1f}%{des.flows:>12,}"
              f"{des.flows / des.wall_s:>12,.0f}"
              f"{des.classes:>8}{ana.step_s * 1e3:>15.3f}{des.step_s * 1e3:>11.3f}{100 * err:>+8.4f}%", flush=True)
        results.append((chips, des.wall_s))
    big = [w for c, w in results if c == 4096]
    if big:
        print(f"\n4096-chip step: {big[0]:.1f} s of DES wall time (goal <= 60 s): {'met' if big[0] <= 60 else 'NOT met'}")

    if not args.no_chunks:
        from partir_emu.app.experiment import Experiment
        from partir_emu.core.mesh import Mesh
        print("\nnetwork model: flow (max-min) vs store-and-forward chunks, on a step with multi-hop routes and "
              "contention:\nmlp full (2 layers), bp+mp, Mesh(batch=8, model=8) on a 4x4x4 tpu-v4 slice "
              "(batch strided over y: its groups share links)")
        spmd = Experiment("mlp", "bp+mp", Mesh(batch=8, model=8), "full", "layers=2").lower().spmd
        pl = place(spmd.mesh, spec)
        ana = simulate(spmd, spec, pl)
        flow = None
        print(f"{'network':<16}{'step ms':>11}{'vs analytical':>15}{'vs flow':>10}{'wall s':>9}{'events':>10}")
        for kw, name in ((dict(network="flow"), "flow"),
                         *[(dict(network="chunk", chunk_bytes=c), f"chunk {c >> 10} KiB")
                           for c in (4 << 20, 1 << 20, 256 << 10, 64 << 10)]):
            d = simulate_des(spmd, spec, pl, **kw)
            flow = flow or d
            print(f"{name:<16}{d.step_s * 1e3:>11.4f}{100 * (d.step_s - ana.step_s) / ana.step_s:>+14.3f}%"
                  f"{100 * (d.step_s - flow.step_s) / flow.step_s:>+9.3f}%{d.wall_s:>9.2f}{d.events:>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
