"""``tag(x, name)``: an identity that names a value of the model for the partitioner.

Under ``jax.jit`` (and ``grad``, ``vmap``, ``checkpoint``) a tag is the identity; its gradient is the
cotangent tagged with the same name, so a boundary the forward pass marks is marked in the backward
pass too. The tracer keeps it as the ``tag`` primitive (:mod:`partir_emu.primitives.collectives`),
which means two things to the compiler:

- a tactic may stop there (``ManualPartition(stop_at=("moe/*",))``): its axis is not propagated
  across the tags whose name matches, so each side gets its tiling from its own side;
- the lowering turns a tag into a reshard from the tiling its operand has to the tiling its result
  was given (no equation when they agree): where the two sides differ, this is where the
  collective goes, as an XLA sharding constraint is where GSPMD reshards.

A mixture-of-experts layer tags the dispatched tokens and the experts' outputs: with the expert
tactic stopping at those tags, the tokens keep the batch's tiling on their side and the experts'
weights' tiling on theirs, and the lowering emits GShard's two all_to_alls per pass
(``scenarios.transformer.moe``).
"""
from __future__ import annotations

from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from partir_emu.errors import ArgumentError

tag_p = Primitive("tag")
tag_p.def_impl(lambda x, *, name: x)
tag_p.def_abstract_eval(lambda x, *, name: x)
mlir.register_lowering(tag_p, lambda ctx, x, *, name: [x])
# linear: its jvp tags the tangent and its transpose tags the cotangent with the same name
ad.deflinear2(tag_p, lambda ct, x, *, name: [tag_p.bind(ct, name=name)])
batching.primitive_batchers[tag_p] = lambda args, dims, *, name: (tag_p.bind(args[0], name=name), dims[0])


def tag(x: Any, name: str) -> Any:
    """``x`` unchanged, marked ``name`` for the partitioner (see the module docstring)."""
    if not isinstance(name, str) or not name:
        raise ArgumentError(f"tag name must be a non-empty string, got {name!r}; e.g. tag(x, 'moe/dispatch')")
    return tag_p.bind(x, name=name)


__all__ = ["tag", "tag_p"]
