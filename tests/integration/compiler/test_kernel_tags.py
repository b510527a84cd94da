"""``jax.named_scope("kernel:NAME")`` marks a hand-fused kernel: the tracer records it per equation
(forward, rematerialised forward and gradient told apart), lowering keeps it, the file format
round-trips it, and it never changes what a program computes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from partir_emu.compiler.api import partition_and_lower
from partir_emu.compiler.tactics import ManualPartition
from partir_emu.compiler.tracing.trace import trace
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram


def _att(q, k):
    with jax.named_scope("kernel:toy"):
        return jnp.sum(jnp.exp(q @ k.T))


def _kernels(program) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for e in program.eqns:
        out.setdefault(e.kernel, set()).add(e.prim)
    return out


def test_forward_and_gradient_tagged_apart():
    q = jnp.ones((4, 8), jnp.float32)
    p = trace(jax.grad(lambda q, k: _att(q, k) + jnp.sum(q)), q, q)
    tags = _kernels(p)
    assert {"dot_general", "exp"} <= tags["toy"]
    assert "dot_general" in tags["toy/bwd"]
    # the untagged sum outside the scope stays untagged
    assert "" in tags


def test_remat_recompute_is_forward():
    q = jnp.ones((4, 8), jnp.float32)
    p = trace(jax.grad(lambda q, k: jax.checkpoint(_att)(q, k)), q, q)
    fwd = [e for e in p.eqns if e.kernel == "toy" and e.prim == "exp"]
    assert len(fwd) >= 1 and any(e.kernel == "toy/bwd" for e in p.eqns)


def test_no_scope_no_tag():
    q = jnp.ones((4, 8), jnp.float32)
    p = trace(jax.grad(lambda q: jnp.sum(jnp.exp(q @ q.T))), q)
    assert all(e.kernel == "" for e in p.eqns)


def test_lowering_and_file_format_keep_tags(tmp_path):
    q = np.ones((4, 8), np.float32)
    p = trace(lambda q, k: _att(q, k), q, q, arg_names=["q", "k"])
    spmd = partition_and_lower(p, Mesh(batch=2), [ManualPartition({"q": 0}, axis="batch")]).spmd
    assert any(e.kernel == "toy" for e in spmd.program.eqns)
    path = tmp_path / "p.json"
    spmd.save(path)
    back = SpmdProgram.load(path)
    assert [e.kernel for e in back.program.eqns] == [e.kernel for e in spmd.program.eqns]
