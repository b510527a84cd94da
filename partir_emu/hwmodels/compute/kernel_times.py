"""The time of each fused kernel (:mod:`.fusion`'s groups) on one chip.

Pricing (:func:`group_times`, vectorised per spec): ``max(matmul time + vector time, bytes / achieved
HBM bw) + launch overhead``; matmul time at the dot dtype's peak (f32, 16-bit, or FP8 when both operands
are FP8: :attr:`~partir_emu.hwmodels.machine.specs.HardwareSpec.fp8_matmul_rate`) times
:func:`.efficiency.matmul_efficiency` (the same curve for every dtype: the one measured sweep per chip
is bf16's, so an FP8 matmul is assumed to reach the fraction of its peak a bf16 one of its shape does),
vector time at ``vector_flops_per_s · vector_fraction``, HBM bandwidth times
:func:`.efficiency.hbm_fraction` of the group's bytes. Matmul and vector work are summed (conservative: an
epilogue is small next to its dot). A hand-fused flash-attention kernel's FLOPs are scaled by the share
of its score blocks the stack's kernel computes (:meth:`.stack.StackSpec.causal_share`), or, when the
stack names a measured kernel (:mod:`.attention_kernels`) with a curve for this chip, the whole group
is priced from that measurement instead. The group's time lands on its **last** equation (zero on the others):
the overlap schedule and the DES see one op at the group's end.
"""
from __future__ import annotations

import numpy as np

from partir_emu.hwmodels.compute.efficiency import hbm_fraction, matmul_efficiency
from partir_emu.hwmodels.compute.fusion import FusionPlan
from partir_emu.hwmodels.machine.specs import HardwareSpec


def group_times(plan: FusionPlan, spec: HardwareSpec) -> np.ndarray:
    """Seconds of every group on one chip of ``spec`` (vectorised)."""
    eff = spec.efficiency
    G = plan.num_groups
    mm: np.ndarray                 # float64 per group (numpy's stubs type a weighted bincount as ints)
    if len(plan.dot_flops):
        d = plan.dot_dims
        e = matmul_efficiency(eff, d[:, 0], d[:, 1], d[:, 2], d[:, 3])
        rate = np.where(plan.dot_fp8, spec.fp8_matmul_rate,
                        np.where(plan.dot_f32, spec.flops_f32_per_s, spec.flops_bf16_per_s))
        mm = np.bincount(plan.dot_group, weights=plan.dot_flops / (rate * e), minlength=G)
    else:
        mm = np.zeros(G)
    vec = plan.vec_flops / (spec.vector_flops_per_s * eff.vector_fraction)
    measured = _measured_flash(plan, spec)
    if spec.stack.attention_causal_skip and plan.causal_seq.any():
        # the stack's causal flash kernel skips the blocks above the diagonal (.stack.StackSpec.causal_share)
        share = np.ones(G)
        flash = np.flatnonzero(plan.causal_seq)
        share[flash] = [spec.stack.causal_share(int(s)) for s in plan.causal_seq[flash]]
        mm = mm * share
        vec = vec * share
    mem = plan.bytes / (spec.hbm_bw_bytes_per_s * hbm_fraction(eff, plan.bytes))
    t = np.maximum(mm + vec, mem)
    for g, seconds in measured.items():
        t[g] = seconds              # the kernel's measured time covers its softmax, its HBM traffic, all of it
    if spec.stack.compute_fraction != 1.0:     # what the stack sustains of those rates (fitted, .stack)
        t = t / spec.stack.compute_fraction
    launch = spec.compiler.kernel_launch_s
    if launch:
        t = t + launch * plan.work
    return t

def _measured_flash(plan: FusionPlan, spec: HardwareSpec) -> dict[int, float]:
    """Seconds of each flash-attention group the stack's measured kernel prices on this chip: its
    dots' FLOPs in the kernel's convention over the measured rate at its score length and head width
    (.attention_kernels). Groups on a chip without a measured curve are left to the GEMM model."""
    kernel = spec.stack.kernel
    if kernel is None or not plan.causal_seq.any():
        return {}
    flops = np.bincount(plan.dot_group, weights=plan.dot_flops, minlength=plan.num_groups)
    out = {}
    for g in np.flatnonzero(plan.causal_seq).tolist():
        rate = kernel.rate(spec.kernel_chip, float(plan.causal_seq[g]), float(plan.flash_head_dim[g]), causal=True)
        if rate is not None:
            out[g] = float(flops[g]) * kernel.causal_credit / rate
    return out


def eqn_times(plan: FusionPlan, spec: HardwareSpec) -> np.ndarray:
    """Per equation: its group's time on the group's last equation, zero on the others (a fresh array)."""
    times = np.zeros(len(plan.group_of))
    times[plan.last] = group_times(plan, spec)
    return times
