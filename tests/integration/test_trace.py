"""Tracing: pytree-path names, inlined calls, plain-data parameters."""
import json

import jax
import jax.numpy as jnp
import numpy as np

from partir_emu.compiler.tracing.trace import trace
from partir_emu.core.ir import verify
from partir_emu.runtime.interpreter import eval_program


@jax.custom_vjp
def clipped(x):
    return jnp.tanh(x)


def _fwd(x):
    return jnp.tanh(x), x


def _bwd(x, g):
    return (g * 0.5,)


clipped.defvjp(_fwd, _bwd)


@jax.custom_jvp
def softplus(x):
    return jnp.log1p(jnp.exp(x))


softplus.defjvp(lambda primals, tangents: (softplus(primals[0]), tangents[0] * jax.nn.sigmoid(primals[0])))


def model(params, batch):
    @jax.checkpoint
    def block(h, w):
        return softplus(h @ w)

    h = batch["x"]
    for i, layer in enumerate(params["layers"]):
        h = block(h, layer["w"]) if i % 2 == 0 else jax.jit(lambda a, b: clipped(a @ b))(h, layer["w"])
    return jnp.mean(h ** 2)


def test_names_inlining_and_params():
    params = {"layers": [{"w": np.ones((4, 4), np.float32) * 0.1} for _ in range(3)]}
    batch = {"x": np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)}
    fn = jax.value_and_grad(model)
    prog = trace(fn, params, batch)
    verify(prog)
    assert prog.input_names == ("params/layers/0/w", "params/layers/1/w", "params/layers/2/w", "batch/x")
    assert prog.output_names == ("0", "1/layers/0/w", "1/layers/1/w", "1/layers/2/w")
    prims = {e.prim for e in prog.eqns}
    assert not prims & {"jit", "pjit", "checkpoint", "remat", "custom_jvp_call", "custom_vjp_call", "closed_call"}
    # parameters are plain data: the whole program's params survive a JSON round trip
    json.dumps([dict(e.params) for e in prog.eqns])
    out = eval_program(prog, [params["layers"][i]["w"] for i in range(3)] + [batch["x"]])
    ref = jax.tree_util.tree_leaves(jax.jit(fn)(params, batch))
    assert all(np.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(out, ref))


def test_source_locations_point_at_user_code():
    prog = trace(lambda x: jnp.sin(x) * 2, np.ones(3, np.float32))
    assert all("test_trace.py" in e.source for e in prog.eqns)
