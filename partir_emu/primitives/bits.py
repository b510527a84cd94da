"""Integer bit primitives: shifts, ``population_count``, ``clz`` and ``bitcast_convert_type``.

Semantics are XLA's, which differ from numpy's where C leaves things undefined: a shift by an
amount >= the bit width (or by a negative amount, read as unsigned) gives 0, or the sign fill
for ``shift_right_arithmetic``; ``shift_right_logical`` of a signed int shifts its bits as
unsigned. ``bitcast_convert_type`` reinterprets bytes in the machine's (little-endian) order,
as XLA CPU does: to a narrower type it adds a trailing dim of ``ratio`` elements, to a wider
type it consumes one.

Rules: the shifts and counts are elementwise (``elementwise_rule``); a bitcast between equal
widths too, and between different widths its leading dims are shared and the trailing dim it
adds or consumes is blocked (it holds the bytes of one element). Costs: 1 op per element;
a bitcast is a memory op (a copy, unfused).

**Rng.** The RNG primitives of ``jax.random`` under its default ``threefry2x32`` implementation, with
the same bits as JAX (so dropout masks and ``jax.random.normal`` verify exactly).

Keys are physical here: the trace turns a ``key<fry>[S]`` value into ``uint32[S, 2]`` (the key
data, as ``jax.random.key_data`` shows it), so ``random_wrap``/``random_unwrap``/``random_clone``
are copies and every other entry takes and returns that trailing dim of 2.

Entries: ``random_seed``, ``random_split``, ``random_fold_in``, ``random_bits``, ``random_wrap``,
``random_unwrap``, ``random_clone`` and the hash itself, ``threefry2x32``. The impls follow
``jax._src.random.threefry2x32`` with ``jax_threefry_partitionable`` on (the default since
jax 0.5): the counter of element ``i`` of a ``shape``-sized draw is the 64-bit ``i`` as two
words (hi, lo); ``random_bits`` xors the two hashed words (32 bits), truncates them (8, 16) or
joins them (64).

Rules: a key array's own dims are shared factors (each key draws on its own); the trailing key
dim and the dims of ``shape`` that a key draws are blocked, since the bits of an element depend
on its global position in the draw (a device holding a block of it would need its offset).
Dropout masks are therefore drawn whole on each device and sliced where they meet a tiled value.
Cost: the integer ops of one hash of a word pair, counted from the algorithm in
:func:`threefry2x32` (:data:`HASH_OPS`), filed as FLOPs of kind ``elementwise``; a draw hashes one
pair per element (``random_split``, ``random_fold_in``: per key).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from partir_emu.core.dtypes import np_dtype
from partir_emu.core.factors import FactorRule, RuleBuilder
from partir_emu.core.ir import Eqn
from partir_emu.core.registry import Primitive, register
from partir_emu.primitives.costs import Cost, copy_cost, elementwise_cost, elems, in_bytes, out_bytes
from partir_emu.primitives.elementwise import elementwise_rule


def _unsigned(x: np.ndarray) -> np.ndarray:
    return x.view(np.dtype(f"u{x.dtype.itemsize}")) if x.dtype.kind == "i" else x


def _shift(kind: str) -> Callable[..., np.ndarray]:
    def impl(x: Any, y: Any, **_: Any) -> np.ndarray:
        if isinstance(x, (int, bool)) and not isinstance(y, (int, bool)):   # a weak literal takes the other's type
            x = np.asarray(x).astype(np.asarray(y).dtype)
        x = np.asarray(x)
        y = np.asarray(y).astype(x.dtype)
        x, y = np.broadcast_arrays(x, y)
        nbits = 8 * x.dtype.itemsize
        amount = _unsigned(np.ascontiguousarray(y))
        ok = amount < nbits
        safe = np.where(ok, amount, 0).astype(amount.dtype)
        if kind == "left":
            return np.where(ok, _unsigned(np.ascontiguousarray(x)) << safe, 0).astype(_unsigned(x).dtype).view(x.dtype)
        if kind == "logical":
            ux = _unsigned(np.ascontiguousarray(x))
            return np.where(ok, ux >> safe, 0).astype(ux.dtype).view(x.dtype)
        fill = np.where(x < 0, -1, 0).astype(x.dtype)   # arithmetic: sign fill
        return np.where(ok, x >> safe.astype(x.dtype), fill).astype(x.dtype)
    return impl


def _population_count(x: Any, **_: Any) -> np.ndarray:
    x = np.asarray(x)
    return np.bitwise_count(_unsigned(np.ascontiguousarray(x))).astype(x.dtype)   # of the bits, not |x|


def _clz(x: Any, **_: Any) -> np.ndarray:
    x = np.asarray(x)
    v = _unsigned(np.ascontiguousarray(x)).astype(np.uint64)
    nbits = 8 * x.dtype.itemsize
    length = np.zeros(x.shape, np.int64)
    for s in (32, 16, 8, 4, 2, 1):   # binary search for the highest set bit
        if s < nbits:
            t = v >> np.uint64(s)
            hit = t != 0
            length += np.where(hit, s, 0)
            v = np.where(hit, t, v)
    return (nbits - length - (v != 0)).astype(x.dtype)


def _bitcast(x: Any, new_dtype: str, **_: Any) -> np.ndarray:
    x = np.ascontiguousarray(x)
    dt = np_dtype(new_dtype)
    if dt.itemsize == x.dtype.itemsize:
        return x.view(dt)
    if dt.itemsize < x.dtype.itemsize:
        return x.view(dt).reshape(x.shape + (x.dtype.itemsize // dt.itemsize,))
    return x.view(dt).reshape(x.shape[:-1])


def bitcast_rule(eqn: Eqn) -> FactorRule:
    x, out = eqn.inputs[0], eqn.outputs[0]
    if x.ndim == out.ndim:
        return elementwise_rule(eqn)
    b = RuleBuilder()
    lead = b.fresh_dims(x.shape if x.ndim < out.ndim else out.shape)
    extra = (b.new(out.shape[-1] if out.ndim > x.ndim else x.shape[-1], blocked=True),)
    if x.ndim < out.ndim:
        return b.rule([lead], [list(lead) + [extra]])
    return b.rule([list(lead) + [extra]], [lead])


register(
    Primitive("shift_left", kind="elementwise", rule=elementwise_rule, impl=_shift("left"), cost=elementwise_cost),
    Primitive("shift_right_logical", kind="elementwise", rule=elementwise_rule, impl=_shift("logical"),
              cost=elementwise_cost),
    Primitive("shift_right_arithmetic", kind="elementwise", rule=elementwise_rule, impl=_shift("arithmetic"),
              cost=elementwise_cost),
    Primitive("population_count", kind="elementwise", rule=elementwise_rule, impl=_population_count,
              cost=elementwise_cost),
    Primitive("clz", kind="elementwise", rule=elementwise_rule, impl=_clz, cost=elementwise_cost),
    Primitive("bitcast_convert_type", kind="memory", rule=bitcast_rule, impl=_bitcast, cost=copy_cost),
)


# -- rng ---------------------------------------------------------------------------------------------
IMPL_NAME = "threefry2x32"     # the only key implementation supported (jax's default)
_U32 = np.uint32
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
# integer ops per hashed pair: 2 initial adds; 20 rounds of add, rotate (2 shifts + or), xor;
# 5 key injections of 3 adds each
HASH_OPS = 2 + 20 * 5 + 5 * 3


# -- the hash ---------------------------------------------------------------------------
def _rotl(v: np.ndarray, r: int) -> np.ndarray:
    return (v << _U32(r)) | (v >> _U32(32 - r))


def threefry2x32(k1: Any, k2: Any, x1: Any, x2: Any) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32 with 20 rounds, as jax's ``_threefry2x32_lowering`` (operands broadcast)."""
    k1, k2, x1, x2 = (np.asarray(a).astype(_U32) for a in (k1, k2, x1, x2))
    k1, k2, x1, x2 = np.broadcast_arrays(k1, k2, x1, x2)
    ks = (k1, k2, k1 ^ k2 ^ _U32(0x1BD11BDA))
    a, b = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            a = a + b
            b = _rotl(b, r) ^ a
        a = a + ks[(i + 1) % 3]
        b = b + ks[(i + 2) % 3] + _U32(i + 1)
    return a, b


def _counters(shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """jax's ``iota_2x32_shape``: the row-major index of each element as (hi, lo) uint32 words."""
    i = np.arange(math.prod(shape), dtype=np.uint64).reshape(tuple(shape))
    return (i >> np.uint64(32)).astype(_U32), (i & np.uint64(0xFFFFFFFF)).astype(_U32)


def _key_words(keys: np.ndarray, extra: int) -> tuple[np.ndarray, np.ndarray]:
    """The two key words of a ``[S, 2]`` key array, shaped to broadcast against ``extra`` more dims."""
    keys = np.asarray(keys).astype(_U32)
    pad = (1,) * extra
    return keys[..., 0].reshape(keys.shape[:-1] + pad), keys[..., 1].reshape(keys.shape[:-1] + pad)


# -- impls ------------------------------------------------------------------------------
def _random_bits(keys: np.ndarray, *, bit_width: int, shape: Sequence[int], **_: Any) -> np.ndarray:
    k1, k2 = _key_words(keys, len(shape))
    hi, lo = _counters(shape)
    b1, b2 = threefry2x32(k1, k2, hi, lo)
    if bit_width == 64:
        return (b1.astype(np.uint64) << np.uint64(32)) | b2.astype(np.uint64)
    bits = b1 ^ b2
    return bits if bit_width == 32 else bits.astype(np.dtype(f"uint{bit_width}"))


def _random_split(keys: np.ndarray, *, shape: Sequence[int], **_: Any) -> np.ndarray:
    k1, k2 = _key_words(keys, len(shape))
    hi, lo = _counters(shape)
    return np.stack(threefry2x32(k1, k2, hi, lo), axis=-1)


def _random_fold_in(keys: np.ndarray, msgs: Any, **_: Any) -> np.ndarray:
    """threefry_fold_in: hash the counter pair (0, msg) (``threefry_seed`` of a uint32 msg)."""
    keys = np.asarray(keys).astype(_U32)
    msgs = np.asarray(msgs).astype(_U32)
    b1, b2 = threefry2x32(keys[..., 0], keys[..., 1], np.zeros_like(msgs), msgs)
    return np.stack([b1, b2], axis=-1)


def _random_seed(seeds: Any, **_: Any) -> np.ndarray:
    """threefry_seed: the seed's high word (0 for a 32-bit seed) and its low word."""
    s = np.asarray(seeds)
    wide = s.astype(np.int64) if s.dtype.kind == "i" else s.astype(np.uint64)
    hi = (wide >> 32).astype(_U32) if s.dtype.itemsize == 8 else np.zeros(s.shape, _U32)
    lo = (wide & 0xFFFFFFFF).astype(_U32)
    return np.stack([hi, lo], axis=-1)


def _copy(x: np.ndarray, **_: Any) -> np.ndarray:
    return np.array(x, copy=True)


# -- rules ------------------------------------------------------------------------------
def _key_dims(b: RuleBuilder, shape: Sequence[int]) -> list:
    """A physical key array ``[S, 2]``: the S dims shared, the key-data dim blocked."""
    return [(b.new(n),) for n in shape[:-1]] + [(b.new(shape[-1], blocked=True),)]


def copy_key_rule(eqn: Eqn) -> FactorRule:
    """random_wrap / random_unwrap / random_clone: the same physical array in and out."""
    b = RuleBuilder()
    dims = _key_dims(b, eqn.inputs[0].shape)
    return b.rule([dims], [dims])


def draw_rule(eqn: Eqn) -> FactorRule:
    """random_bits ``[S, 2] -> [S, *shape]`` and random_split ``[S, 2] -> [S, *shape, 2]``."""
    b = RuleBuilder()
    kdims = _key_dims(b, eqn.inputs[0].shape)
    drawn = [(b.new(n, blocked=True),) for n in eqn.params["shape"]]
    out = kdims[:-1] + drawn
    if eqn.prim == "random_split":
        out.append((b.new(2, blocked=True),))
    return b.rule([kdims], [out])


def fold_in_rule(eqn: Eqn) -> FactorRule:
    """keys ``[S, 2]`` with msgs ``[S]`` (or a scalar; size-1 dims broadcast) -> ``[S', 2]``."""
    keys, msgs = eqn.inputs
    out = eqn.outputs[0]
    b = RuleBuilder()
    odims = _key_dims(b, out.shape)

    def operand(shape: Sequence[int]) -> list:
        return [d if n == m else (b.new(1),) for d, n, m in zip(odims, shape, out.shape)]
    kdims = operand(keys.shape[:-1]) + [odims[-1]] if keys.ndim > 1 else [odims[-1]]
    mdims = operand(msgs.shape) if msgs.ndim else []
    return b.rule([kdims, mdims], [odims])


def seed_rule(eqn: Eqn) -> FactorRule:
    b = RuleBuilder()
    sdims = b.fresh_dims(eqn.inputs[0].shape)
    return b.rule([sdims], [list(sdims) + [(b.new(2, blocked=True),)]])


def threefry_rule(eqn: Eqn) -> FactorRule:
    """Elementwise over four operands (a lower-rank operand is a broadcast scalar), two results."""
    b = RuleBuilder()
    out = eqn.outputs[0]
    dims = b.fresh_dims(out.shape)
    ops = [tuple(d if n == m else (b.new(1),) for d, n, m in zip(dims, a.shape, out.shape))
           if a.ndim == out.ndim else () for a in eqn.inputs]
    return b.rule(ops, [dims, dims])


# -- costs ------------------------------------------------------------------------------
def hash_cost(e: Eqn) -> Cost:
    """:data:`HASH_OPS` per hashed pair; bytes = operands + results."""
    pairs = elems(e.outputs[0]) // (2 if e.prim in ("random_split", "random_fold_in") else 1)
    return float(HASH_OPS * pairs), float(in_bytes(e) + out_bytes(e))


register(
    Primitive("random_bits", kind="elementwise", rule=draw_rule, impl=_random_bits, cost=hash_cost),
    Primitive("random_split", kind="elementwise", rule=draw_rule, impl=_random_split, cost=hash_cost),
    Primitive("random_fold_in", kind="elementwise", rule=fold_in_rule, impl=_random_fold_in, cost=hash_cost),
    Primitive("random_seed", kind="elementwise", rule=seed_rule, impl=_random_seed, cost=elementwise_cost),
    Primitive("threefry2x32", kind="elementwise", rule=threefry_rule,
              impl=lambda k1, k2, x1, x2, **_: threefry2x32(k1, k2, x1, x2), cost=hash_cost),
    *(Primitive(name, kind="memory", rule=copy_key_rule, impl=_copy, cost=copy_cost)
      for name in ("random_wrap", "random_unwrap", "random_clone")),
)
