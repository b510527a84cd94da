"""The JSON form of an SPMD program's body: values, constants, equations and loop bodies in one
Var-id space (see :mod:`partir_emu.core.spmd.program` for the format and :class:`SpmdProgram` for the
envelope: format, version, mesh, meta).

Reading checks what a writer of this module always produces, so a file edited or written by
anything else fails here with an :class:`~partir_emu.errors.ArtifactError` instead of deep in the
runtime: each dtype is one of jax's (:data:`~partir_emu.core.dtypes.IR_DTYPES`), each dim is in
``0..MAX_DIM``, a literal is a number, and a value is defined before it is used (a KeyError, which
the caller reports as a malformed program). No jax: ranks read programs.
"""
from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import check_name, np_dtype
from partir_emu.core.ir import Atom, Eqn, Literal, Program, Var
from partir_emu.core.loops import LOOP
from partir_emu.core.sharding import Sharding
from partir_emu.errors import ArtifactError

MAX_DIM = 2**40                # a dim of a saved value beyond this is not a program of any machine


def program_json(p: Program, in_shardings: Sequence[Sharding], out_shardings: Sequence[Sharding],
                 global_in: Sequence[tuple[int, ...]], global_out: Sequence[tuple[int, ...]]) -> dict:
    """``inputs``, ``consts``, ``eqns`` and ``outputs`` of the file format."""
    return {
        "inputs": [{"var": _var_json(v), "name": n, "sharding": s.to_json(), "global_shape": list(g)}
                   for v, n, s, g in zip(p.inputs, p.input_names, in_shardings, global_in)],
        "consts": _consts_json(p),
        "eqns": _eqns_json(p),
        "outputs": [{"atom": _atom_json(a), "name": n, "sharding": s.to_json(), "global_shape": list(g)}
                    for a, n, s, g in zip(p.outputs, p.output_names, out_shardings, global_out)],
    }


def read_program(d: dict, where: str) -> tuple[Program, tuple[Sharding, ...], tuple[Sharding, ...],
                                                tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """The inverse of :func:`program_json`: (program, input shardings, output shardings, global input
    shapes, global output shapes)."""
    r = _Reader(where)
    inputs = tuple(r.var(i["var"]) for i in d["inputs"])
    consts = r.consts(d["consts"])
    eqns = r.eqns(d["eqns"])
    prog = Program(inputs, tuple(i["name"] for i in d["inputs"]), eqns,
                   tuple(r.atom(o["atom"]) for o in d["outputs"]), tuple(o["name"] for o in d["outputs"]), consts)
    return (prog, tuple(Sharding.from_json(i["sharding"]) for i in d["inputs"]),
            tuple(Sharding.from_json(o["sharding"]) for o in d["outputs"]),
            tuple(tuple(int(n) for n in i["global_shape"]) for i in d["inputs"]),
            tuple(tuple(int(n) for n in o["global_shape"]) for o in d["outputs"]))


def _var_json(v: Var) -> list:
    return [v.id, list(v.shape), v.dtype]


def _atom_json(a: Atom) -> Any:
    return a.id if isinstance(a, Var) else {"lit": a.value, "dtype": a.dtype}


def _consts_json(p: Program) -> list:
    return [{"var": _var_json(v), "data": base64.b64encode(np.ascontiguousarray(c).tobytes()).decode()}
            for v, c in p.consts]


def _eqns_json(p: Program) -> list:
    return [{"prim": e.prim, "in": [_atom_json(a) for a in e.inputs], "out": [_var_json(o) for o in e.outputs],
             "params": _params_json(e), "source": e.source, **({"kernel": e.kernel} if e.kernel else {})}
            for e in p.eqns]


def _params_json(e: Eqn) -> dict:
    params = dict(e.params)
    body = params.pop("body", None) if e.prim == LOOP else None
    out = _jsonable(params)
    if isinstance(body, Program):
        out["body"] = {"inputs": [_var_json(v) for v in body.inputs], "input_names": list(body.input_names),
                       "consts": _consts_json(body), "eqns": _eqns_json(body),
                       "outputs": [_atom_json(a) for a in body.outputs], "output_names": list(body.output_names)}
    return out


class _Reader:
    """Rebuilds Vars, constants and equations (loop bodies nested) from the file format, checking
    each dtype name and dim; a use of a value not defined before is a KeyError (malformed)."""

    def __init__(self, where: str) -> None:
        self.vars: dict[int, Var] = {}
        self.where = where

    def var(self, t: list) -> Var:
        shape = tuple(int(x) for x in t[1])
        if any(not 0 <= n <= MAX_DIM for n in shape):
            raise ArtifactError(f"{self.where}: value %{t[0]} has shape {list(shape)[:8]}; a dim must be in "
                                f"0..{MAX_DIM:,}")
        v = Var(int(t[0]), shape, check_name(t[2], f"{self.where}: value %{t[0]}"))
        self.vars[v.id] = v
        return v

    def atom(self, a: Any) -> Atom:
        if isinstance(a, dict):
            if not isinstance(a["lit"], (int, float, bool)):
                raise ArtifactError(f"{self.where}: literal {str(a['lit'])[:40]!r} is not a number")
            return Literal(a["lit"], check_name(a["dtype"], f"{self.where}: literal {a['lit']!r}"))
        return self.vars[a]

    def consts(self, cs: list) -> tuple[tuple[Var, np.ndarray], ...]:
        out = []
        for c in cs:
            v = self.var(c["var"])
            arr = np.frombuffer(base64.b64decode(c["data"]), dtype=np_dtype(v.dtype)).reshape(v.shape).copy()
            out.append((v, arr))
        return tuple(out)

    def eqns(self, es: list) -> tuple[Eqn, ...]:
        out = []
        for e in es:
            ins = tuple(self.atom(a) for a in e["in"])
            params = dict(e["params"])
            body = params.pop("body", None) if e["prim"] == LOOP else None
            params = _untuple(params)
            if body is not None:
                params["body"] = self.body(body)
            outs = tuple(self.var(o) for o in e["out"])
            out.append(Eqn(e["prim"], ins, outs, params, e.get("source", ""), e.get("kernel", "")))
        return tuple(out)

    def body(self, b: dict) -> Program:
        inputs = tuple(self.var(v) for v in b["inputs"])
        consts = self.consts(b["consts"])
        eqns = self.eqns(b["eqns"])
        return Program(inputs, tuple(b["input_names"]), eqns, tuple(self.atom(a) for a in b["outputs"]),
                       tuple(b["output_names"]), consts)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def _untuple(x: Any) -> Any:
    # params never hold lists, so every JSON list was a tuple
    if isinstance(x, dict):
        return {k: _untuple(v) for k, v in x.items()}
    if isinstance(x, list):
        return tuple(_untuple(v) for v in x)
    return x
