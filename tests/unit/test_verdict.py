"""The verification verdict: against float64, beyond the elementwise reach of correct runs in other orders."""
from __future__ import annotations

import numpy as np
import pytest

from partir_emu.core.ir import Eqn, Program, Var
from partir_emu.errors import EmulationError
from partir_emu.runtime.verdict import compute_precision, judge, reduction_length


def _rounded(x64: np.ndarray, rng: np.random.Generator, rel: float = 2.0 ** -24) -> np.ndarray:
    """float32 values off from x64 by a few units of roundoff, like another summation order."""
    noise = rng.standard_normal(x64.shape) * rel * 4 * np.abs(x64)
    return (x64 + noise).astype(np.float32)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_identical_to_jit_verifies(rng):
    ref = rng.standard_normal((64, 32))
    jit = ref.astype(np.float32)
    v = judge([jit.copy()], [jit], [ref], ["w"], 1024)
    assert v.verified and v.worst.name == "w"


def test_other_rounding_of_the_same_size_verifies(rng):
    ref = rng.standard_normal((256, 128))
    v = judge([_rounded(ref, rng)], [_rounded(ref, rng)], [ref], ["params/w"], 4096)
    assert v.verified, v.summary()


def test_adam_sign_flips_that_correct_runs_reach_verify_and_others_fail(rng):
    """m/sqrt(v) ~ sign(g): where |g| ~ rounding, a summation order flips the update of an element
    by 2 lr. Flips at elements where correct runs in other orders flip too verify (elementwise
    allclose says NO there: max rel err ~ 1); as many flips where no correct run moves fail."""
    lr = 1e-3
    ref = rng.standard_normal((512, 512))
    at_risk = rng.choice(ref.size, size=120, replace=False)

    def flipped(where: np.ndarray, sign: float = 1.0) -> np.ndarray:
        x = ref.astype(np.float32)
        x.flat[where] += np.float32(sign * 2 * lr)
        return x

    jit = flipped(at_risk[:40])
    others = [[flipped(at_risk)], [flipped(at_risk, -1.0)]]        # an antithetic pair
    ours = flipped(at_risk[60:])
    assert not np.allclose(ours, jit, rtol=1e-5, atol=1e-6)      # the old criterion said NO
    v = judge([ours], [jit], [ref], ["1/params/w"], 512, others=others)
    assert v.verified, v.summary()
    assert v.worst.excess == 0.0
    stable = np.setdiff1d(np.arange(ref.size), at_risk)[:60]
    bad = judge([flipped(stable)], [jit], [ref], ["1/params/w"], 512, others=others)
    assert not bad.verified and bad.worst.over > 2, bad.summary()


def test_missing_all_reduce_fails_far_above_the_bound(rng):
    ref = rng.standard_normal((128, 64))
    jit = ref.astype(np.float32)
    ours = jit.copy()
    ours[:, :32] *= 0.5          # one device's half of a pending sum never arrived
    v = judge([jit, ours], [jit, jit], [ref, ref], ["0", "1/grads/w"], 1 << 20)
    assert not v.verified
    w = v.worst
    assert w.name == "1/grads/w" and not w.ok
    assert w.excess > 100 * w.bound and w.over > 100
    assert v.to_json()["worst_output"] == "1/grads/w"


def test_low_precision_leaves_out_one_flip_of_a_small_tensor_but_not_of_a_loss(rng):
    """bfloat16: the largest ceil(n/256) elements of the excess are left out (a flipped element of
    a 16-element bias), never more than an eighth of the output (a loss is checked whole); n counts
    the elements rounding moves in a correct run (jax.jit's bias is off float64 at each, like a real run's)."""
    ref = np.zeros(16)
    bias = (ref + rng.standard_normal(16) * 1e-9).astype(np.float32)
    flip = bias.copy()
    flip[3] = 2e-3
    assert judge([flip], [bias], [ref], ["1/b"], 16, precision="bfloat16").verified
    two = flip.copy()
    two[5] = 2e-3
    assert not judge([two], [bias], [ref], ["1/b"], 16, precision="bfloat16").verified
    loss = np.array(2.0)
    assert not judge([np.float32(2.5)], [np.float32(2.0)], [loss], ["0"], 16, precision="bfloat16").verified


def test_permuted_block_fails(rng):
    ref = rng.standard_normal((64, 64))
    jit = ref.astype(np.float32)
    ours = np.concatenate([jit[32:], jit[:32]])
    assert not judge([ours], [jit], [ref], ["x"], 64).verified


def test_integer_outputs_must_match_exactly():
    base = np.arange(10, dtype=np.int32)
    assert judge([base.copy()], [base], [base.astype(np.int64)], ["step"], 1).verified
    off = base.copy()
    off[3] += 1
    v = judge([off], [base], [base], ["step"], 1)
    assert not v.verified and v.worst.worst_index == (3,)


def test_nonfinite_values_must_sit_where_the_reference_has_them():
    ref = np.array([1.0, np.inf, np.nan, 2.0])
    jit = ref.astype(np.float32)
    assert judge([jit.copy()], [jit], [ref], ["x"], 1).verified
    moved = np.array([1.0, np.nan, np.inf, 2.0], np.float32)
    assert not judge([moved], [jit], [ref], ["x"], 1).verified
    new_nan = jit.copy()
    new_nan[0] = np.nan
    assert not judge([new_nan], [jit], [ref], ["x"], 1).verified


def test_allowance_grows_with_reduction_length(rng):
    ref = rng.standard_normal(1000)
    jit = ref.astype(np.float32)
    ours = (ref * (1 + 3e-5)).astype(np.float32)    # 3e-5 relative: beyond rounding of short sums
    assert not judge([ours], [jit], [ref], ["x"], 16).verified
    assert judge([ours], [jit], [ref], ["x"], 1 << 22).verified


def test_mismatched_output_lists_are_an_error():
    with pytest.raises(EmulationError, match="outputs"):
        judge([np.zeros(2)], [], [np.zeros(2)], ["x"], 1)
    with pytest.raises(EmulationError, match="'x'"):
        judge([np.zeros(2)], [np.zeros(3)], [np.zeros(2)], ["x"], 1)


def test_reduction_length_reads_contractions_and_sums():
    x, w = Var(0, (8, 96), "float32"), Var(1, (96, 4), "float32")
    y, s = Var(2, (8, 4), "float32"), Var(3, (4,), "float32")
    eqns = (Eqn("dot_general", (x, w), (y,), {"dimension_numbers": (((1,), (0,)), ((), ()))}),
            Eqn("reduce_sum", (y,), (s,), {"axes": (0,)}))
    prog = Program((x, w), ("x", "w"), eqns, (s,), ("s",))
    assert reduction_length(prog) == 96
    assert reduction_length(Program((x,), ("x",), (), (x,), ("x",))) == 1


def _noise_output(rng, n: int = 64):
    """An output whose exact value is ~0 while float32 runs carry the rounding of O(1e-6) terms
    (HF BERT's key-bias Adam ``mu``: 7e-14 in float32 runs, 5e-23 in float64): the reference,
    jax.jit and four other orders (an antithetic pair at ALPHA = 32 times one order's rounding)."""
    ref = rng.standard_normal(n) * 1e-23
    one_order = 1e-14
    jit = (ref + rng.standard_normal(n) * one_order).astype(np.float32)
    xi = rng.standard_normal((2, n)) * 32 * one_order
    others = [[(ref + s * x).astype(np.float32)] for x in xi for s in (1, -1)]
    return ref, jit, others, one_order


def test_an_output_that_is_rounding_noise_is_judged_against_the_rounding_not_its_own_norm(rng):
    """One element beyond every correct run by about one order's rounding: the allowance is the
    rounding one correct order makes (‖reach‖/α), not c·u·sqrt(K)·‖ref64‖ ≈ 1e-27, which failed
    such outputs; the report's relative figures are against the reach, not 1e8 (noise over noise)."""
    ref, jit, others, one_order = _noise_output(rng)
    reach = np.max([np.abs(o[0] - ref) for o in others] + [np.abs(jit - ref)], axis=0)
    ours = (ref + reach * np.sign(rng.standard_normal(ref.size)) * 0.5).astype(np.float32)
    ours[7] = np.float32(ref[7] + reach[7] + 2 * one_order)
    v = judge([ours], [jit], [ref], ["2/0/mu/key/bias"], 32, others=others)
    assert v.verified, v.summary()
    c = v.worst
    assert c.excess > 0 and c.err < 1 and c.baseline_err < 1 and c.reach == pytest.approx(1.0)


def test_a_wrong_value_in_a_noise_output_still_fails(rng):
    """A whole block off by far more than rounding (1e-6 where runs reach 3e-13) fails by far."""
    ref, jit, others, _ = _noise_output(rng)
    ours = jit.copy()
    ours[:16] += np.float32(1e-6)
    v = judge([ours], [jit], [ref], ["2/0/mu/key/bias"], 32, others=others)
    assert not v.verified and v.worst.over > 100, v.summary()


def test_subnormal_values_flushed_by_one_run_and_kept_by_another_verify():
    """Adam's nu of a noise gradient, (1 − β₂)·g² ≈ 1e-45: jax.jit (XLA flushes subnormals) gives 0,
    our numpy run a float32 subnormal, float64 1e-62. Every element's reach is at least
    UNDERFLOW_C·λ; the figures stay relative to the reach, not 1e17."""
    ref = np.full(16, 1e-62)
    ref[::2] = 3e-46
    jit = np.zeros(16, np.float32)
    ours = np.full(16, np.float32(1.4e-45))
    v = judge([ours], [jit], [ref], ["2/0/nu/key/bias"], 32)
    assert v.verified, v.summary()
    assert v.worst.err < 1e-6
    # above the floor, a float32 value that should be 1e-30 and is 1e-29 is wrong
    big = np.full(16, 1e-30)
    assert not judge([np.full(16, np.float32(1e-29))], [big.astype(np.float32)], [big], ["x"], 32).verified


def test_elements_no_correct_run_moves_are_never_left_out():
    """An FP8 amax history: one new amax in front of entries every run copies exactly. The trimming
    of low precision counts only moved elements, so a wrong amax is not left out as a "flip" (it
    was, when ceil(n/256) = 4 of its 1024 elements were trimmed)."""
    ref = np.zeros(1024)
    ref[0], ref[1:3] = 0.5, (0.25, 0.125)
    jit = ref.astype(np.float32)
    jit[0] = np.float32(0.5 * (1 + 2 ** -9))          # a bfloat16 amax rounds
    ours = jit.copy()
    assert judge([ours], [jit], [ref], ["2/fp8/w/x"], 16, precision="bfloat16").verified
    ours[0] = np.float32(0.9)                         # an amax reduced with a sum instead of a max
    v = judge([ours], [jit], [ref], ["2/fp8/w/x"], 16, precision="bfloat16")
    assert not v.verified and v.worst.over > 10, v.summary()


def test_fp8_counts_as_a_precision_only_where_the_program_computes_in_it():
    """Quantising to FP8 and multiplying FP8 operands into a float32 accumulator leave the program's
    precision at its other floats (the reference repeats the quantiser); a sum produced in FP8 makes
    it FP8 (docs/verdict.md, "FP8")."""
    x, w = Var(0, (8, 16), "float32"), Var(1, (16, 4), "float32")
    xq, wq = Var(2, (8, 16), "float8_e4m3fn"), Var(3, (16, 4), "float8_e4m3fn")
    y = Var(4, (8, 4), "float32")
    dims = {"dimension_numbers": (((1,), (0,)), ((), ()))}
    quantised = (Eqn("convert_element_type", (x,), (xq,), {"new_dtype": "float8_e4m3fn"}),
                 Eqn("convert_element_type", (w,), (wq,), {"new_dtype": "float8_e4m3fn"}),
                 Eqn("dot_general", (xq, wq), (y,), {**dims, "preferred_element_type": "float32"}))
    prog = Program((x, w), ("x", "w"), quantised, (y,), ("y",))
    assert compute_precision(prog) == "float32"
    y8 = Var(5, (8, 4), "float8_e5m2")
    summed = quantised[:2] + (Eqn("dot_general", (xq, wq), (y8,), {**dims, "preferred_element_type": "float8_e5m2"}),)
    assert compute_precision(Program((x, w), ("x", "w"), summed, (y8,), ("y",))) == "float8_e5m2"
