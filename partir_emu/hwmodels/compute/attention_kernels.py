"""Measured attention-kernel throughput: what a hand-written flash-attention kernel reaches on a chip.

A stack that runs a library kernel for attention (FlashAttention-2 under PyTorch, cuDNN's fused
attention, ...) names it in its profile (``[kernels] attention_kernel = "flash-attention-2"``). The
kernel's file, ``partir_emu/hwmodels/data/kernels/<name>.toml``, holds published forward+backward
measurements as curves, one per (chip, head dimension, causal mask)::

    name = "flash-attention-2"
    flops_convention = "fa2"            # fwd = 4·b·s²·h·d (halved when causal), bwd = 2.5 × fwd
    flops_convention_source = "..."

    [[curve]]
    chip = "h100"                       # a spec name (``partir-emu hardware``)
    head_dim = 128
    causal = true
    seq = [512, 1024, 2048, 4096, 8192, 16384]
    tflops = [163, 221, 265, 294, 308, 328]
    source = "..."                      # where each number was read

:meth:`AttentionKernel.rate` interpolates a curve linearly in ``log2(seq)`` and holds its end values
outside the measured range (the kernel is compute-bound past a few thousand tokens; it does not get
faster without bound). A head dimension between two measured ones takes the nearer (ties: the
smaller); a chip without a curve has no rate, and the kernel is then priced as its GEMMs
(:mod:`.kernel_times` says which in the report). The rate is applied to the FLOPs counted the way
the benchmark counted them (``fa2``: causal work is half the full score matrix), so the measured
time comes back exactly for the measured shapes.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from partir_emu.errors import SpecError
from partir_emu.limits import load_toml

KERNEL_DIR = Path(__file__).parents[1] / "data" / "kernels"
CONVENTIONS = {"fa2": 0.5}       # convention -> share of the full s×s work a causal kernel is credited with


@dataclass(frozen=True)
class Curve:
    chip: str
    head_dim: int
    causal: bool
    seq: tuple[float, ...]
    flop_per_s: tuple[float, ...]
    source: str

    def at(self, seq: float) -> float:
        x = np.log2(np.asarray(self.seq))
        return float(np.interp(math.log2(max(seq, 1.0)), x, np.asarray(self.flop_per_s)))


@dataclass(frozen=True)
class AttentionKernel:
    """One library kernel's measured curves (module docstring)."""

    name: str
    causal_credit: float              # the convention's share of the full work for a causal kernel
    curves: tuple[Curve, ...]
    path: str = ""

    def rate(self, chip: str, seq: float, head_dim: float, causal: bool = True) -> float | None:
        """FLOP/s (in the kernel's convention) at score length ``seq``; None: not measured on ``chip``."""
        cands = [c for c in self.curves if c.chip == chip and c.causal == causal]
        if not cands:
            return None
        best = min(cands, key=lambda c: (abs(c.head_dim - head_dim), c.head_dim))
        return best.at(seq)

    def chips(self) -> list[str]:
        return sorted({c.chip for c in self.curves})


def list_kernels() -> list[str]:
    return sorted(p.stem for p in KERNEL_DIR.glob("*.toml"))


def load_kernel(name_or_path: str | os.PathLike) -> AttentionKernel:
    """A kernel by name (``"flash-attention-2"``) or by path to its ``.toml``."""
    s = str(name_or_path)
    path = Path(s) if s.endswith(".toml") or os.sep in s else KERNEL_DIR / f"{s}.toml"
    if not path.is_file():
        raise SpecError(f"no attention kernel named {s!r}; known kernels: {', '.join(list_kernels()) or 'none'} "
                        f"(files in {KERNEL_DIR}), or give a path to a .toml kernel file")
    return kernel_from_dict(load_toml(path, SpecError, what="attention kernel file"), str(path))


def kernel_from_dict(data: Any, where: str) -> AttentionKernel:
    """Validate a kernel file: every curve named by chip, head dim and mask, sorted seqs, a source each."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: an attention kernel file is a TOML table")
    unknown = sorted(set(data) - {"name", "description", "flops_convention", "flops_convention_source", "curve"})
    if unknown:
        raise SpecError(f"{where}: unknown field {unknown[0]}; a kernel file has name, description, "
                        f"flops_convention (+ _source) and [[curve]] tables")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"{where}: field name must be a non-empty string")
    conv = data.get("flops_convention")
    if conv not in CONVENTIONS:
        raise SpecError(f"{where}: field flops_convention must be one of {', '.join(CONVENTIONS)}, got {conv!r}")
    if not isinstance(data.get("flops_convention_source"), str) or not data["flops_convention_source"].strip():
        raise SpecError(f"{where}: field flops_convention_source is missing; say where the FLOP count comes from")
    raw = data.get("curve")
    if not isinstance(raw, list) or not raw:
        raise SpecError(f"{where}: no [[curve]] tables; give at least one measured curve")
    curves = tuple(_curve(c, f"{where}: curve {i + 1}") for i, c in enumerate(raw))
    keys = [(c.chip, c.head_dim, c.causal) for c in curves]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup:
        raise SpecError(f"{where}: two curves for chip {dup[0]!r}, head_dim {dup[1]}, causal {dup[2]}; keep one")
    return AttentionKernel(name, CONVENTIONS[conv], curves, where)


def _curve(c: Any, where: str) -> Curve:
    if not isinstance(c, dict):
        raise SpecError(f"{where}: must be a table")
    unknown = sorted(set(c) - {"chip", "head_dim", "causal", "seq", "tflops", "source"})
    if unknown:
        raise SpecError(f"{where}: unknown field {unknown[0]}; a curve has chip, head_dim, causal, seq, tflops, source")
    chip, hd, causal, seq, tf, src = (c.get(k) for k in ("chip", "head_dim", "causal", "seq", "tflops", "source"))
    if not isinstance(chip, str) or not chip:
        raise SpecError(f"{where}: field chip must be a spec name such as 'h100'")
    if isinstance(hd, bool) or not isinstance(hd, int) or not 1 <= hd <= 1024:
        raise SpecError(f"{where}: field head_dim must be an integer in 1..1024, got {hd!r}")
    if not isinstance(causal, bool):
        raise SpecError(f"{where}: field causal must be true or false, got {causal!r}")
    if not isinstance(src, str) or not src.strip():
        raise SpecError(f"{where}: field source is missing; say where these numbers were read")

    def numbers(v: Any, name: str, lo: float, hi: float) -> tuple[float, ...]:
        if (not isinstance(v, list) or not v
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not lo <= x <= hi for x in v)):
            raise SpecError(f"{where}: field {name} must be a non-empty list of numbers in [{lo:g}, {hi:g}], got {v!r}")
        return tuple(float(x) for x in v)

    s = numbers(seq, "seq", 1, 2 ** 24)
    t = numbers(tf, "tflops", 1e-3, 1e5)
    if len(s) != len(t) or list(s) != sorted(set(s)):
        raise SpecError(f"{where}: fields seq and tflops must be lists of the same length with seq strictly increasing")
    return Curve(chip, hd, causal, s, tuple(x * 1e12 for x in t), src)
