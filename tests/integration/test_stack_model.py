"""The software stack in the hardware model (issue 23 item 2-3), on traced transformer programs:
what PyTorch-style stacks keep for the backward against arXiv 2205.05198's closed form, a hand
kernel's on-chip values, causal block skipping against its closed form, and that the default
(XLA) stack and the runtime's memory convention are what they were."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import tomllib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from partir_emu.app.cli.main import main  # noqa: E402
from partir_emu.app.experiment import Experiment  # noqa: E402
from partir_emu.app.programs import ProgramCache  # noqa: E402
from partir_emu.core.mesh import Mesh  # noqa: E402
from partir_emu.hwmodels import load_spec, simulate  # noqa: E402
from partir_emu.hwmodels.compute.attention_kernels import KERNEL_DIR  # noqa: E402
from partir_emu.hwmodels.compute.kernel_times import group_times  # noqa: E402
from partir_emu.hwmodels.compute.memory import peak_memory  # noqa: E402
from partir_emu.hwmodels.compute.program import analyze  # noqa: E402
from partir_emu.hwmodels.compute.stack import load_stack  # noqa: E402

S, B, H, HEADS = 256, 8, 256, 4          # sequence, batch, d_model, heads: s·b·h = 524,288
CACHE = ProgramCache()


def program(layers: int, attention: str = "flash", mesh: str = "batch=1", strategy: str = "bp"):
    sets = (f"batch={B},seq={S},d_model={H},heads={HEADS},d_ff={4 * H},layers={layers},vocab=64,remat=0,"
            f"precision=bf16,mlp=gelu,block=serial,norm=layernorm,bias=1,tied=1,attention={attention}")
    exp = Experiment("transformer", strategy, Mesh.parse(mesh), None, dict(kv.split("=") for kv in sets.split(",")))
    return CACHE.spmd(exp)


def activations(layers: int, policy: str) -> int:
    prog = program(layers).program
    return analyze(prog).memory_for(prog, policy).breakdown["activations"]


def test_kernel_inputs_keep_what_megatron_counts_per_layer():
    """arXiv 2205.05198 sec. 4.1: a layer keeps 34·s·b·h bytes for its backward (11 attention +
    19 MLP + 4 LayerNorm, with two sbh-byte dropout masks this model has not), plus 5·a·s²·b
    for the scores, which a flash kernel does not keep. The policy's per-layer growth must land
    within 10 % of 32-34 sbh; jax's own residuals keep markedly more."""
    sbh = S * B * H
    per_layer = (activations(3, "kernel_inputs") - activations(2, "kernel_inputs")) / sbh
    assert 32 * 0.9 <= per_layer <= 34 * 1.1, per_layer
    jax_kept = (activations(3, "residuals") - activations(2, "residuals")) / sbh
    assert jax_kept > 1.3 * per_layer, (jax_kept, per_layer)


def test_a_flash_kernels_scores_stay_on_chip():
    """The hand kernel's s×s values are never in HBM under the hardware model's policies; the
    runtime's convention ("program") still counts them, as the arrays exist there."""
    prog = program(2).program
    pc = analyze(prog)
    scores = HEADS * S * S * B * 4                    # one float32 [b, heads, s, s] tensor
    assert pc.memory is pc.memory_for(prog, "program") and pc.memory == peak_memory(prog)
    on_chip = pc.memory_for(prog, "residuals")
    inside = [i for i, e in enumerate(prog.eqns) if e.kernel == "flash_attention/bwd"
              and any(o.shape == (B, HEADS, S, S) and o.dtype == "float32" for o in e.outputs)]
    assert inside
    for i in inside:                                  # point i + 1: while equation i runs
        assert pc.memory.live_bytes[i + 1] - on_chip.live_bytes[i + 1] >= scores
    assert on_chip.peak_bytes <= pc.memory.peak_bytes
    naive = program(2, "naive").program
    pn = analyze(naive)
    assert pn.memory_for(naive, "residuals").peak_bytes == pn.memory.peak_bytes     # no hand kernel: nothing on chip


def mechanisms(name: str):
    """A stack profile's mechanisms without its fitted ``compute_fraction`` (tested apart, in
    tests/unit/test_stacks.py): what each field does is then visible on its own."""
    return dataclasses.replace(load_stack(name), compute_fraction=1.0)


def test_causal_skip_scales_the_flash_kernels_by_the_block_share():
    prog = program(2).program
    plan = analyze(prog).fusion.plan(load_spec("h100").compiler)
    flash = plan.causal_seq > 0
    assert flash.sum() >= 4 and set(plan.causal_seq[flash].tolist()) == {S}    # forward and backward, each layer
    h100 = load_spec("h100")
    # compute-bound pricing (no HBM or launch time): the flash groups' time is their FLOPs alone
    bound = dataclasses.replace(h100, hbm_bw_bytes_per_s=1e30,
                                compiler=dataclasses.replace(h100.compiler, kernel_launch_s=0.0))
    # the block-skipping rule alone: pytorch-fsdp without its measured kernel
    fsdp = dataclasses.replace(mechanisms("pytorch-fsdp"), attention_kernel="")
    t_xla = group_times(plan, bound)
    t_fsdp = group_times(plan, bound.with_stack(fsdp))
    share = fsdp.causal_share(S)
    assert share == pytest.approx(3 / 4)                                        # n = 2 blocks of 128
    assert t_fsdp[flash] == pytest.approx(share * t_xla[flash], rel=1e-12)
    assert (t_fsdp[~flash] == t_xla[~flash]).all()


def test_a_measured_kernel_prices_the_flash_groups_from_its_curve():
    """pytorch-fsdp runs FlashAttention-2: on h100 each flash group takes its dots' FLOPs, halved for
    the causal mask (the benchmark's convention), over the measured rate; head dim 64 = d_model / heads,
    S = 256 below the curve's first point (512: 141 TFLOP/s, held). Other groups are unchanged; on a
    chip the kernel was not measured on (h200) the groups are priced as their GEMMs."""
    prog = program(2).program
    h100 = load_spec("h100")
    plan = analyze(prog).fusion.plan(h100.compiler)
    flash = plan.causal_seq > 0
    assert set(plan.flash_head_dim[flash].tolist()) == {H // HEADS}
    kernel_file = tomllib.loads((KERNEL_DIR / "flash-attention-2.toml").read_text())
    curve = next(c for c in kernel_file["curve"] if (c["chip"], c["head_dim"], c["causal"]) == ("h100", 64, True))
    assert curve["seq"][0] == 512 > S
    rate = curve["tflops"][0] * 1e12
    fsdp = mechanisms("pytorch-fsdp")
    t = group_times(plan, h100.with_stack(fsdp))
    flops = np.bincount(plan.dot_group, weights=plan.dot_flops, minlength=plan.num_groups)
    launch = h100.compiler.kernel_launch_s
    assert t[flash] == pytest.approx(flops[flash] * 0.5 / rate + launch, rel=1e-12)
    no_kernel = group_times(plan, h100.with_stack(dataclasses.replace(fsdp, attention_kernel="")))
    assert (t[~flash] == no_kernel[~flash]).all()
    h200 = load_spec("h200")
    plan200 = analyze(prog).fusion.plan(h200.compiler)
    assert (group_times(plan200, h200.with_stack(fsdp))
            == group_times(plan200, h200.with_stack(dataclasses.replace(fsdp, attention_kernel="")))).all()


def test_a_what_if_chip_and_the_40gb_a100_keep_the_measured_kernel_rates():
    """Measured rates are looked up by chip name: a what-if spec (``h100[ici_bw*2]``) keeps its base chip's
    (they were lost before: its flash groups fell back to the GEMM model), and ``a100-40gb`` takes the
    80 GB part's (``kernels_measured_as``); a what-if of the HBM bandwidth changes no flash group's time."""
    from partir_emu.app.study.whatif import WhatIf, apply

    prog = program(2).program
    fsdp = mechanisms("pytorch-fsdp")
    for base, other, same_flash in (("h100", apply("h100", WhatIf.parse("ici_bw*2")), True),
                                    ("h100", apply("h100", WhatIf.parse("hbm_bw*2")), True),
                                    ("a100", load_spec("a100-40gb"), True)):
        spec = load_spec(base)
        plan = analyze(prog).fusion.plan(spec.compiler)
        flash = plan.causal_seq > 0
        t, t_other = group_times(plan, spec.with_stack(fsdp)), group_times(plan, other.with_stack(fsdp))
        gemm_priced = group_times(plan, other.with_stack(dataclasses.replace(fsdp, attention_kernel="")))
        assert other.kernel_chip == base and (t_other[flash] == t[flash]).all() == same_flash, other.name
        assert (t_other[flash] != gemm_priced[flash]).any(), other.name


def test_the_stack_changes_a_flash_step_and_not_a_naive_one():
    h100 = load_spec("h100")
    fsdp = h100.with_stack(mechanisms("pytorch-fsdp"))
    flash, naive = program(2), program(2, "naive")
    assert simulate(flash, fsdp, overlap=True).step_s < simulate(flash, h100, overlap=True).step_s
    a, b = simulate(naive, h100, overlap=True), simulate(naive, h100.with_stack(load_stack("megatron-lm")), overlap=True)
    assert a.step_s == b.step_s and b.peak_bytes_per_device < a.peak_bytes_per_device
    assert b.needed_bytes == pytest.approx(b.peak_bytes_per_device * 1.05 + 1.5e9)
    assert (a.stack, b.stack) == ("xla", "megatron-lm")


def test_simulate_stack_option(tmp_path, capsys):
    report = tmp_path / "r.json"
    args = ["simulate", "transformer", "--strategy", "z3", "--mesh", "batch=2", "--hardware", "h100",
            "--set", "batch=4,seq=64,d_model=64,heads=4,d_ff=256,layers=2,vocab=64,attention=flash", "--quiet"]
    assert main(args + ["--stack", "pytorch-fsdp", "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "with the pytorch-fsdp stack's allocator and reserved memory" in out
    assert json.loads(report.read_text())["stack"]["name"] == "pytorch-fsdp"
    assert main(args + ["--stack", "torch-magic"]) == 2
    err = capsys.readouterr().err
    assert "'torch-magic'" in err and "pytorch-fsdp" in err


def test_the_des_prices_a_stack_as_the_analytical_model_does():
    """The stack rides on the spec, so the DES replays the same stack-aware kernel times: on a
    program without contention both models give the same step, and the causal skip shortens both."""
    from partir_emu.hwmodels.des import simulate_des

    spmd = program(2, mesh="batch=2", strategy="z3")
    steps = {}
    for name, stack in (("xla", load_stack("xla")), ("pytorch-fsdp", load_stack("pytorch-fsdp")),
                        ("mechanisms", mechanisms("pytorch-fsdp"))):
        spec = load_spec("h100").with_stack(stack)
        a, d = simulate(spmd, spec, overlap=True), simulate_des(spmd, spec, overlap=True)
        assert d.step_s == pytest.approx(a.step_s, rel=1e-9), name      # the fitted fraction included
        steps[name] = a.step_s
    assert steps["mechanisms"] < steps["xla"] < steps["pytorch-fsdp"]


def test_fp32_gradient_reductions_in_both_models():
    """A bf16 ZeRO-3 step reduce-scatters some gradients in bf16 (as traced); a stack that reduces
    gradients in fp32 moves those at twice the bytes, in the analytical model and in the DES alike,
    and leaves the parameter all-gathers alone."""
    from partir_emu.hwmodels.des import simulate_des

    spmd = program(2, mesh="batch=2", strategy="z3")
    narrow = [e for e in spmd.program.eqns if e.prim == "reduce_scatter" and e.inputs[0].dtype == "bfloat16"]
    assert narrow
    h100 = load_spec("h100")
    fsdp = load_stack("pytorch-fsdp")
    as_traced = dataclasses.replace(fsdp, gradient_reduce_dtype="as_traced")
    a32, a16 = (simulate(spmd, h100.with_stack(s), overlap=False) for s in (fsdp, as_traced))
    rs32, rs16 = a32.by_collective["reduce_scatter"]["bytes"], a16.by_collective["reduce_scatter"]["bytes"]
    extra = sum(int(np.prod(e.inputs[0].shape)) * 2 for e in narrow)           # the bf16 inputs' bytes, once more
    assert rs32 - rs16 == extra
    assert a32.by_collective["all_gather"] == a16.by_collective["all_gather"]
    assert a32.comm_s > a16.comm_s
    d32 = simulate_des(spmd, h100.with_stack(fsdp), overlap=False)
    assert d32.step_s == pytest.approx(a32.step_s, rel=1e-9)
