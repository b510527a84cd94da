"""A user-written training step on MPI: ``mpiexec -n 4 python examples/train_mpi.py``.

Rank 0 traces and lowers the step (the only rank that imports jax) and calls it like a jitted
function; the other ranks serve their devices. Every rank ends with the same global outputs.
"""
import sys

import numpy as np

import partir_emu.mpi as pmpi

STEPS = 3

if pmpi.is_root():
    import jax
    import jax.numpy as jnp

    import partir_emu as pe

    def step(params, x, y):
        def loss_fn(p):
            h = jnp.tanh(x @ p["w1"])
            return jnp.mean((h @ p["w2"] - y) ** 2)
        loss, g = jax.value_and_grad(loss_fn)(params)
        return loss, jax.tree.map(lambda w, gw: w - 0.1 * gw, params, g)

    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((16, 32), np.float32), "w2": rng.standard_normal((32, 4), np.float32)}
    x, y = rng.standard_normal((64, 16), np.float32), rng.standard_normal((64, 4), np.float32)
    mesh = pe.Mesh(batch=4, model=2)
    schedule = [pe.ManualPartition({"x": 0, "y": 0}, axis="batch"),
                pe.ManualPartition({"params/w1": 1, "params/w2": 0}, axis="model")]
    f = pe.jit(step, mesh=mesh, schedule=schedule, backend="mpi", devices_per_rank=2)
    ref = jax.jit(step)
    p_ours, p_ref = params, params
    for i in range(STEPS):
        loss, p_ours = f(p_ours, x, y)
        loss_ref, p_ref = ref(p_ref, x, y)
        ok = np.allclose(loss, loss_ref, rtol=1e-5) and all(
            np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_ref)))
        print(f"rank 0 step {i}: loss {float(loss):.6f} (jax.jit {float(loss_ref):.6f}) verified: {'YES' if ok else 'NO'}")
    pmpi.finish()
    final = [np.asarray(loss), *map(np.asarray, jax.tree.leaves(p_ours))]
else:
    results = pmpi.serve()
    final = results[-1] if results else []
digest = sum(float(np.sum(np.abs(a.astype(np.float64)))) for a in final)
print(f"rank {pmpi.rank()}: {len(final)} outputs, digest {digest:.6f}, jax imported: {'jax' in sys.modules}")
