"""The partir IR: an SSA list of equations over typed values.

Built from a jaxpr by ``trace.py`` (the only compiler module that imports jax),
with nested calls inlined and primitive parameters normalized to plain Python
data (ints, tuples, strings, dicts), so that the IR can be interpreted by numpy,
priced by the hardware models and serialized without pickle.

The same classes carry the lowered per-device program (``spmd/program.py``): there the
shapes are local and collective primitives appear as ordinary equations.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# dtype names are numpy's, plus bfloat16 (kept as a name; numpy runs it as float32
# only if ml_dtypes is present, which the runtime does not require).
_ITEMSIZE = {
    "bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "int64": 8, "uint64": 8, "float64": 8,
    # the FP8 formats (one byte each; scenarios.fp8 quantises to E4M3 and E5M2)
    **dict.fromkeys(("float8_e3m4", "float8_e4m3", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz",
                     "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"), 1),
}


def itemsize(dtype: str) -> int:
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def nbytes(shape: Sequence[int], dtype: str) -> int:
    return math.prod(shape) * itemsize(dtype)


@dataclass(frozen=True, slots=True)
class Var:
    """An SSA value. Identity is its ``id`` (unique inside one Program)."""

    id: int
    shape: tuple[int, ...]
    dtype: str

    def __hash__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Var) and other.id == self.id

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)

    def __str__(self) -> str:
        return f"%{self.id}"

    def type_str(self) -> str:
        return f"{_short(self.dtype)}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class Literal:
    """A scalar constant operand (as in jaxpr literals)."""

    value: int | float | bool
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return ()

    @property
    def ndim(self) -> int:
        return 0

    def __str__(self) -> str:
        return f"{self.value!r}:{_short(self.dtype)}"


Atom = Var | Literal


@dataclass(frozen=True, slots=True)
class Eqn:
    """``outputs = prim[params](*inputs)``; ``source`` says where it was traced from.

    ``kernel`` names the hand-fused kernel the equation belongs to, if any: the user marks a
    region with ``jax.named_scope("kernel:NAME")`` (as code that calls a flash-attention or fused
    softmax kernel would); the tracer records ``NAME``, or ``NAME/bwd`` for the equations its
    gradient produced. It never changes what the equation computes: only the cost models read it
    (a marked region is priced as one fused kernel, see ``hwmodels.fusion``)."""

    prim: str
    inputs: tuple[Atom, ...]
    outputs: tuple[Var, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""
    kernel: str = ""

    def __str__(self) -> str:
        outs = ", ".join(f"{o}:{o.type_str()}" for o in self.outputs)
        ps = ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(self.params.items()))
        ins = " ".join(str(i) for i in self.inputs)
        return f"{outs} = {self.prim}" + (f"[{ps}]" if ps else "") + (f" {ins}" if ins else "")


@dataclass(frozen=True)
class Program:
    """A whole function: named inputs, constants, equations, named outputs."""

    inputs: tuple[Var, ...]
    input_names: tuple[str, ...]
    eqns: tuple[Eqn, ...]
    outputs: tuple[Atom, ...]
    output_names: tuple[str, ...]
    consts: tuple[tuple[Var, np.ndarray], ...] = ()

    def __post_init__(self) -> None:
        assert len(self.inputs) == len(self.input_names)
        assert len(self.outputs) == len(self.output_names)

    def vars(self) -> Iterator[Var]:
        yield from self.inputs
        for v, _ in self.consts:
            yield v
        for e in self.eqns:
            yield from e.outputs

    @functools.cached_property
    def _users(self) -> dict[Var, list[int]]:
        out: dict[Var, list[int]] = {}
        for i, e in enumerate(self.eqns):
            for a in e.inputs:
                if isinstance(a, Var):
                    out.setdefault(a, []).append(i)
        return out

    def users(self) -> dict[Var, list[int]]:
        """Equation indices that read each value (computed once; do not mutate)."""
        return self._users

    @functools.cached_property
    def _producers(self) -> dict[Var, int]:
        return {o: i for i, e in enumerate(self.eqns) for o in e.outputs}

    def producers(self) -> dict[Var, int]:
        return self._producers

    def next_id(self) -> int:
        return 1 + max((v.id for v in self.vars()), default=-1)

    def pretty(self) -> str:
        lines = ["program("]
        for v, n in zip(self.inputs, self.input_names):
            lines.append(f"  {v}:{v.type_str()}  # {n}")
        lines.append(") {")
        for v, _ in self.consts:
            lines.append(f"  {v}:{v.type_str()} = const")
        for e in self.eqns:
            lines.append("  " + str(e))
            body = e.params.get("body")
            if isinstance(body, Program):   # a loop: its body, indented
                lines.extend("    " + ln for ln in body.pretty().splitlines())
        outs = ", ".join(f"{o} ({n})" for o, n in zip(self.outputs, self.output_names))
        lines.append(f"  return {outs}")
        lines.append("}")
        return "\n".join(lines)

    __str__ = pretty


def verify(program: Program) -> None:
    """Internal invariant check (SSA, defined-before-use); used after passes in tests."""
    defined = set(program.inputs) | {v for v, _ in program.consts}
    assert len(defined) == len(program.inputs) + len(program.consts), "duplicate input ids"
    for e in program.eqns:
        for a in e.inputs:
            if isinstance(a, Var):
                assert a in defined, f"{a} used before definition in {e}"
        for o in e.outputs:
            assert o not in defined, f"{o} defined twice"
            defined.add(o)
    for out in program.outputs:
        if isinstance(out, Var):
            assert out in defined, f"output {out} undefined"


_SHORT = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int32": "i32",
          "int64": "i64", "int8": "i8", "uint8": "u8", "uint32": "u32", "bool": "bool", "int16": "i16"}


def _short(dtype: str) -> str:
    return _SHORT.get(dtype, dtype)


def _fmt(v: Any) -> str:
    if isinstance(v, Program):      # a loop body: printed after its equation by Program.pretty
        return f"<body: {len(v.eqns)} eqns>"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}={_fmt(x)}" for k, x in v.items()) + "}"
    if isinstance(v, tuple):
        return "(" + ",".join(_fmt(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return repr(v) if isinstance(v, str) else str(v)
