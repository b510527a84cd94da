"""Small builders for compiler unit tests: hand-written programs (no jax) and a readable
einsum-like spelling of factor rules."""
from __future__ import annotations

import string
from collections.abc import Sequence

from partir_emu.compiler.api import partition
from partir_emu.compiler.lowering.lower import lower
from partir_emu.compiler.state import ShardingState
from partir_emu.compiler.tactics import Tactic
from partir_emu.core.factors import FactorRule
from partir_emu.core.ir import Atom, Eqn, Literal, Program, Var
from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram


class ProgramBuilder:
    """Builds a Program equation by equation, as a trace would (global shapes)."""

    def __init__(self) -> None:
        self.next_id = 0
        self.inputs: list[Var] = []
        self.names: list[str] = []
        self.eqns: list[Eqn] = []

    def var(self, *shape: int, dtype: str = "float32") -> Var:
        v = Var(self.next_id, tuple(shape), dtype)
        self.next_id += 1
        return v

    def input(self, name: str, *shape: int, dtype: str = "float32") -> Var:
        v = self.var(*shape, dtype=dtype)
        self.inputs.append(v)
        self.names.append(name)
        return v

    def op(self, prim: str, *ins: Atom, shape: Sequence[int], dtype: str = "float32", **params) -> Var:
        (out,) = self.op_n(prim, *ins, shapes=[shape], dtype=dtype, **params)
        return out

    def op_n(self, prim: str, *ins: Atom, shapes: Sequence[Sequence[int]], dtype: str = "float32",
             **params) -> tuple[Var, ...]:
        outs = tuple(self.var(*s, dtype=dtype) for s in shapes)
        self.eqns.append(Eqn(prim, tuple(ins), outs, params, f"test.py:{len(self.eqns)}"))
        return outs

    # -- common ops ------------------------------------------------------------------------
    def matmul(self, x: Var, w: Var) -> Var:
        return self.op("dot_general", x, w, shape=(x.shape[0], w.shape[1]),
                       dimension_numbers=(((1,), (0,)), ((), ())), preferred_element_type="float32")

    def unary(self, prim: str, x: Var) -> Var:
        return self.op(prim, x, shape=x.shape)

    def binary(self, prim: str, x: Atom, y: Atom) -> Var:
        if x.ndim == y.ndim:   # lax broadcasts size-1 dims of rank-equal operands
            shape = tuple(max(a, b) for a, b in zip(x.shape, y.shape))
        else:                  # a scalar operand
            shape = x.shape if x.ndim > y.ndim else y.shape
        return self.op(prim, x, y, shape=shape)

    def transpose(self, x: Var, perm: Sequence[int]) -> Var:
        return self.op("transpose", x, shape=tuple(x.shape[p] for p in perm), permutation=tuple(perm))

    def reshape(self, x: Var, *shape: int) -> Var:
        return self.op("reshape", x, shape=shape, new_sizes=tuple(shape), dimensions=None)

    def reduce(self, prim: str, x: Var, axes: Sequence[int]) -> Var:
        return self.op(prim, x, shape=tuple(n for i, n in enumerate(x.shape) if i not in axes), axes=tuple(axes))

    def cumsum(self, x: Var, axis: int) -> Var:
        return self.op("cumsum", x, shape=x.shape, axis=axis, reverse=False)

    def build(self, *outs: Atom, names: Sequence[str] | None = None) -> Program:
        names = tuple(names) if names is not None else tuple(f"out{k}" for k in range(len(outs)))
        return Program(tuple(self.inputs), tuple(self.names), tuple(self.eqns), tuple(outs), names)


def lit(value: float, dtype: str = "float32") -> Literal:
    return Literal(value, dtype)


def state_after(prog: Program, mesh: Mesh, *schedule: Tactic, cost_model=None) -> ShardingState:
    (st,) = partition(prog, mesh, list(schedule), keep_states=False, cost_model=cost_model)
    return st


def lowered(prog: Program, mesh: Mesh, *schedule: Tactic, state_outputs=None) -> SpmdProgram:
    return lower(state_after(prog, mesh, *schedule), state_outputs)


def collectives(spmd: SpmdProgram) -> list[tuple]:
    """(prim, params...) of every collective of the lowered program, in program order."""
    out = []
    for e in spmd.program.eqns:
        if e.prim in ("all_gather", "reduce_scatter", "all_slice"):
            out.append((e.prim, tuple(e.params["axes"]), e.params["dim"]))
        elif e.prim == "all_reduce":
            out.append((e.prim, tuple(e.params["axes"]), e.params["op"]))
        elif e.prim == "all_to_all":
            out.append((e.prim, tuple(e.params["axes"]), e.params["split_dim"], e.params["concat_dim"]))
        elif e.prim == "to_partial":
            out.append((e.prim, tuple(e.params["axes"])))
    return out


def spell(rule: FactorRule) -> str:
    """The rule as an einsum: factors named a, b, c... in order of first appearance (operands,
    then results); a compound dim is parenthesised: ``(ab)c->abc``."""
    return _Speller(rule).spec


def blocked(rule: FactorRule) -> str:
    s = _Speller(rule)
    return "".join(sorted(s.names[f] for f in rule.blocked if f in s.names))


def reduction(rule: FactorRule) -> str:
    s = _Speller(rule)
    return "".join(sorted(s.names[f] for f in rule.reduction))


def sizes(rule: FactorRule) -> dict[str, int]:
    s = _Speller(rule)
    return {s.names[f]: n for f, n in enumerate(rule.sizes) if f in s.names}


class _Speller:
    def __init__(self, rule: FactorRule) -> None:
        self.names: dict[int, str] = {}
        ops = ",".join(self._tensor(o) for o in rule.operands)
        res = ",".join(self._tensor(r) for r in rule.results)
        self.spec = f"{ops}->{res}"

    def _tensor(self, dims) -> str:
        return "".join(self._dim(d) for d in dims)

    def _dim(self, factors) -> str:
        s = "".join(self.names.setdefault(f, string.ascii_letters[len(self.names)]) for f in factors)
        return s if len(factors) == 1 else f"({s})"
