"""What fraction of its peak a chip reaches, and how its compiler fuses: the ``[efficiency]`` and
``[compiler]`` tables of a spec file, validated, and the curves they define.

``[compiler]`` (how XLA / cuBLAS on this chip groups equations; :mod:`.fusion` reads it):

- ``loop_fusion``: elementwise / layout / reduction chains fuse into one loop (XLA does, on every chip);
- ``matmul_operand_fusion``: elementwise producers (converts, broadcasts, transposes) fuse into a
  dot's operands (XLA:TPU does; XLA:GPU hands dots to cuBLAS, which reads plain operands);
- ``matmul_epilogue``: which consumers fuse into a dot's output: ``"none"``, ``"bias"`` (one bias
  add, cuBLASLt's BIAS epilogue, as PyTorch's ``addmm`` runs ``nn.Linear``), ``"bias_activation"``
  (cuBLASLt epilogues: consumers that read no other full-size tensor, i.e. bias add, relu, gelu),
  ``"elementwise"`` (XLA:TPU output fusion: any elementwise consumer);
- ``kernel_launch_s`` (optional): fixed time per launched kernel (GPU launch gap; TPUs run one
  compiled program and have none).

``[efficiency]`` (every number is a fraction of a datasheet peak, per chip, never per model):

- matmul: ``time = flops / (peak(dtype) · e)`` with
  ``e = matmul_peak_fraction · pad · wave · fill`` where

  - ``pad = M/⌈M⌉ · N/⌈N⌉ · K/⌈K⌉``, each dimension rounded up to ``matmul_tile = [tm, tn, tk]``
    (the MXU's 128×128 on TPU; a CTA tile on GPU): padded work is done and thrown away;
  - ``wave = tiles / (⌈tiles / units⌉ · units)`` with ``tiles = batch·⌈M/tm⌉·⌈N/tn⌉`` and
    ``units = matmul_wave_units`` (the SM count on GPU: the last wave runs partly empty; absent on TPU).
    With ``matmul_schedule = "stream_k"`` the work quantised over the units is the ``tiles·⌈K/tk⌉``
    main-loop iterations instead (stream-K / split-K: a problem of few output tiles and a long K is
    spread over every SM, Osama et al., arXiv 2301.03598), and the pipeline fill below is paid per
    SM's share of K (at most the whole padded K) rather than per tile;
  - ``fill = S / (S + matmul_fill_elems)`` where ``S`` is the dimension named by ``matmul_fill_dim``,
    padded to its tile: the per-pass pipeline fill that a short streamed dimension does not amortise
    (GPU: K, the main loop's prologue/epilogue; TPU: M, the rows streamed through the
    weight-stationary MXU per weight-tile load). A pass takes ``S + fill`` for ``s`` useful rows, so
    ``pad · fill = s / (S + fill)``: the padding is counted once;
- vector units: ``vector_fraction`` of ``vector_flops_per_s``;
- HBM: ``hbm_curve_mb`` / ``hbm_curve_fraction``: the achievable fraction of ``hbm_bw_bytes_per_s``
  by the bytes one kernel moves, interpolated linearly in ``log10(1 + MB)`` between the points
  (small transfers do not reach the streaming bandwidth).

A spec without these tables is priced as before this model existed: no fusion, every rate at 100 %.
Every field of these tables needs a ``<field>_source`` string (checked here: a missing one is a
:class:`SpecError` naming the field).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from partir_emu.errors import SpecError

EPILOGUES = ("none", "bias", "bias_activation", "elementwise")
SCHEDULES = ("data_parallel", "stream_k")


@dataclass(frozen=True)
class CompilerSpec:
    """How the chip's compiler fuses (``[compiler]``). The default fuses nothing."""

    loop_fusion: bool = False
    matmul_operand_fusion: bool = False
    matmul_epilogue: str = "none"
    kernel_launch_s: float = 0.0
    # not a chip's: an eager stack (``StackSpec.eager``) runs each framework op as its own kernel
    eager: bool = False
    # not a chip's either: the framework ops (``op.NAME`` tags) a stack runs as hand-written kernels,
    # one kernel each whatever the compiler would fuse (``StackSpec.hand_fused``)
    hand_ops: frozenset[str] = frozenset()

    @property
    def variant(self) -> tuple[bool, bool, str, bool, tuple[str, ...]]:
        """What selects a grouping (:func:`.fusion.fuse` is computed once per program per variant)."""
        return self.loop_fusion, self.matmul_operand_fusion, self.matmul_epilogue, self.eager, tuple(sorted(self.hand_ops))


@dataclass(frozen=True)
class EfficiencySpec:
    """Achievable fractions of peak (``[efficiency]``). The default is 100 % everywhere."""

    matmul_peak_fraction: float = 1.0
    matmul_tile: tuple[int, int, int] = (1, 1, 1)
    matmul_wave_units: int = 0                   # 0: no wave quantisation
    matmul_fill_dim: str = "k"
    matmul_fill_elems: float = 0.0
    matmul_schedule: str = "data_parallel"       # or "stream_k"
    vector_fraction: float = 1.0
    hbm_curve_mb: tuple[float, ...] = (0.0,)
    hbm_curve_fraction: tuple[float, ...] = (1.0,)


# field -> (type, required); types: bool, fraction (0 < x <= 1), float (> 0), int (> 0), ints3, floats
_COMPILER = {"loop_fusion": ("bool", True), "matmul_operand_fusion": ("bool", True),
             "matmul_epilogue": (EPILOGUES, True), "kernel_launch_s": ("float", False)}
_EFFICIENCY = {"matmul_peak_fraction": ("fraction", True), "matmul_tile": ("ints3", True),
               "matmul_wave_units": ("int", False), "matmul_fill_dim": (("m", "k"), True),
               "matmul_fill_elems": ("float", True), "matmul_schedule": (SCHEDULES, False), "vector_fraction": ("fraction", True),
               "hbm_curve_mb": ("floats", True), "hbm_curve_fraction": ("floats", True)}


def parse_compiler(sub: Any, where: str) -> CompilerSpec:
    """Validate a ``[compiler]`` table (``None``: the default, no fusion)."""
    if sub is None:
        return CompilerSpec()
    return CompilerSpec(**check_fields(sub, _COMPILER, where, "compiler"))


def parse_efficiency(sub: Any, where: str) -> EfficiencySpec:
    """Validate an ``[efficiency]`` table (``None``: the default, 100 % of peak)."""
    if sub is None:
        return EfficiencySpec()
    vals = check_fields(sub, _EFFICIENCY, where, "efficiency")
    mb, frac = vals["hbm_curve_mb"], vals["hbm_curve_fraction"]
    if len(mb) != len(frac) or list(mb) != sorted(mb) or len(set(mb)) != len(mb):
        raise SpecError(f"{where}: fields efficiency.hbm_curve_mb and efficiency.hbm_curve_fraction must be lists of "
                        f"the same length with hbm_curve_mb strictly increasing; got {list(mb)} and {list(frac)}")
    if any(not 0 < f <= 1 for f in frac) or list(frac) != sorted(frac):
        raise SpecError(f"{where}: field efficiency.hbm_curve_fraction must be non-decreasing fractions in (0, 1], "
                        f"got {list(frac)}")
    if vals.get("matmul_schedule") == "stream_k" and (vals["matmul_fill_dim"] != "k" or not vals.get("matmul_wave_units")):
        raise SpecError(f"{where}: field efficiency.matmul_schedule = 'stream_k' splits K over the units: it needs "
                        f"matmul_fill_dim = 'k' and matmul_wave_units; got {vals['matmul_fill_dim']!r} and "
                        f"{vals.get('matmul_wave_units')!r}")
    return EfficiencySpec(**vals)


def check_fields(sub: Any, fields: Mapping[str, tuple[Any, bool]], where: str, table: str) -> dict[str, Any]:
    if not isinstance(sub, dict):
        raise SpecError(f"{where}: field {table!r} must be a table [{table}], got {type(sub).__name__}")
    out: dict[str, Any] = {}
    for key, value in sub.items():
        if key.endswith("_source"):
            if not isinstance(value, str) or not value.strip():
                raise SpecError(f"{where}: field {table}.{key} must be a non-empty string naming a public source")
            continue
        if key not in fields:
            raise SpecError(f"{where}: unknown field {table}.{key}; known fields here: "
                            f"{', '.join(table + '.' + f for f in fields)}")
        if f"{key}_source" not in sub:
            raise SpecError(f"{where}: field {table}.{key}_source is missing; say where {table}.{key} comes from "
                            f"(a datasheet, a published measurement or a documented fit)")
        out[key] = _value(value, fields[key][0], where, f"{table}.{key}")
    for key, (_, required) in fields.items():
        if required and key not in out:
            raise SpecError(f"{where}: field {table}.{key} is missing; add it under [{table}] with {key}_source")
    return out


def _value(value: Any, typ: Any, where: str, name: str) -> Any:
    def bad(expected: str) -> SpecError:
        return SpecError(f"{where}: field {name} must be {expected}, got {type(value).__name__} {value!r}")

    def number(v: Any) -> bool:
        return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)

    if isinstance(typ, tuple):
        if value not in typ:
            raise bad("one of " + ", ".join(repr(t) for t in typ))
        return value
    if typ == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if typ == "fraction":
        if not number(value) or not 0 < value <= 1:
            raise bad("a fraction in (0, 1]")
        return float(value)
    if typ == "float":
        if not number(value) or value < 0:
            raise bad("a number >= 0")
        return float(value)
    if typ == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad("a positive integer")
        return value
    if typ == "ints3":
        if (not isinstance(value, list) or len(value) != 3
                or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in value)):
            raise bad("a list of 3 positive integers [tm, tn, tk]")
        return tuple(value)
    if typ == "names":
        if not isinstance(value, list) or any(not isinstance(v, str) or not v.strip() for v in value):
            raise bad("a list of names (strings)")
        return tuple(value)
    if typ == "floats":
        if not isinstance(value, list) or not value or any(not number(v) or v < 0 for v in value):
            raise bad("a non-empty list of numbers >= 0")
        return tuple(float(v) for v in value)
    raise AssertionError(typ)


# -- the curves ----------------------------------------------------------------------------------------
def matmul_efficiency(eff: EfficiencySpec, batch: np.ndarray, m: np.ndarray, n: np.ndarray,
                      k: np.ndarray) -> np.ndarray:
    """Fraction of the matrix peak a ``[batch] M×K · K×N`` product reaches (vectorised over dots)."""
    batch, m, n, k = (np.asarray(a, dtype=np.float64) for a in (batch, m, n, k))
    tm, tn, tk = eff.matmul_tile
    tiles_m, tiles_n, tiles_k = np.ceil(m / tm), np.ceil(n / tn), np.ceil(k / tk)
    with np.errstate(divide="ignore", invalid="ignore"):
        pad = m / (tiles_m * tm) * (n / (tiles_n * tn)) * (k / (tiles_k * tk))
        # a pass streams the *padded* dimension: its time is padded + fill, its useful share s/(padded +
        # fill) = pad_s · padded/(padded + fill). Filling on the unpadded s would count the padding twice
        # (M = 1 on an 8-row sublane tile: 8·129 cycles a pass instead of 8 + 128).
        padded = tiles_m * tm if eff.matmul_fill_dim == "m" else tiles_k * tk
        u = eff.matmul_wave_units
        if u and eff.matmul_schedule == "stream_k":
            # the units share tiles·⌈K/tk⌉ main-loop iterations; each runs one stretch of K per tile it
            # touches, so the fill is paid on its share of K (never more than the whole padded K)
            iters = batch * tiles_m * tiles_n * tiles_k
            wave = iters / (np.ceil(iters / u) * u)
            padded = np.minimum(np.maximum(iters / u, 1.0) * tk, padded)
        elif u:
            tiles = batch * tiles_m * tiles_n
            wave = tiles / (np.ceil(tiles / u) * u)
        else:
            wave = 1.0
        fill = padded / (padded + eff.matmul_fill_elems)
        e = eff.matmul_peak_fraction * pad * wave * fill
    return np.where(np.isfinite(e) & (e > 0), e, 1.0)       # empty dots: no time anyway


def hbm_fraction(eff: EfficiencySpec, nbytes: np.ndarray) -> np.ndarray:
    """Achievable fraction of the HBM bandwidth for kernels moving ``nbytes`` each (vectorised)."""
    if len(eff.hbm_curve_mb) == 1:
        return np.full(np.shape(nbytes), eff.hbm_curve_fraction[0])
    x = np.log10(1.0 + np.asarray(nbytes, dtype=np.float64) / 1e6)
    xp = np.log10(1.0 + np.asarray(eff.hbm_curve_mb))
    return np.interp(x, xp, eff.hbm_curve_fraction)
