"""Software-stack profiles (``hwmodels/compute/stack.py``): the packaged files load, every field is
sourced, bad profiles are errors naming the file and field, and the closed forms the profile's
fields stand for (the causal block share, the memory a peak needs beside the tensors)."""
from __future__ import annotations

import math

import pytest
import tomllib

from partir_emu.errors import SpecError
from partir_emu.hwmodels import load_spec
from partir_emu.hwmodels.compute.stack import STACK_DIR, XLA, list_stacks, load_stack, stack_from_dict


def test_packaged_stacks_load_and_every_field_has_a_source():
    assert {"xla", "megatron-lm", "pytorch-fsdp", "maxtext"} <= set(list_stacks())
    for path in STACK_DIR.glob("*.toml"):
        raw = tomllib.loads(path.read_text())
        st = load_stack(path.stem)
        assert st.name == path.stem == raw["name"]
        for table in ("kernels", "comm", "memory", "efficiency"):
            for key in raw.get(table, {}):
                if not key.endswith("_source"):
                    assert len(raw[table][f"{key}_source"]) > 30, (path.name, key)
    assert load_stack("xla") is XLA and load_stack(None) is XLA


@pytest.mark.parametrize("seq, block, share", [(2048, 128, 17 / 32), (128, 128, 1.0), (129, 128, 3 / 4),
                                               (8192, 128, 65 / 128), (1, 128, 1.0)])
def test_causal_share_counts_the_blocks_on_and_below_the_diagonal(seq, block, share):
    st = stack_from_dict({"name": "t", "kernels": {"attention_causal_skip": True, "attention_causal_skip_source": "x",
                                                   "attention_block": block, "attention_block_source": "x"},
                          "memory": {"saved_activations": "residuals", "saved_activations_source": "x"}})
    n = math.ceil(seq / block)
    assert st.causal_share(seq) == pytest.approx(share) == pytest.approx((n * (n + 1) / 2) / n ** 2)
    assert XLA.causal_share(seq) == 1.0


def test_memory_beside_the_tensors_decides_what_fits():
    h100 = load_spec("h100")
    fsdp = load_stack("pytorch-fsdp")
    spec = h100.with_stack(fsdp)
    assert spec.stack is fsdp and h100.stack is XLA and h100.with_stack(XLA) is h100
    assert h100.fits_bytes == h100.hbm_bytes
    assert spec.fits_bytes == pytest.approx((h100.hbm_bytes - fsdp.reserved_bytes) / (1 + fsdp.allocator_overhead))
    assert fsdp.needed_bytes(spec.fits_bytes) == pytest.approx(h100.hbm_bytes)
    assert spec.to_json()["stack"]["name"] == "pytorch-fsdp"


def _profile(**memory):
    mem = {"saved_activations": "kernel_inputs", "saved_activations_source": "s"}
    mem.update(memory)
    return {"name": "mine", "kernels": {"attention_causal_skip": False, "attention_causal_skip_source": "s"},
            "memory": mem}


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["memory"].pop("saved_activations_source"), "memory.saved_activations_source is missing"),
    (lambda d: d["memory"].update(saved_activations="all"), "memory.saved_activations must be one of"),
    (lambda d: d["memory"].update(allocator_overhead=0.9, allocator_overhead_source="s"), "above 0.5"),
    (lambda d: d["memory"].update(reserved_bytes=2.0 ** 50, reserved_bytes_source="s"), "above 1 TiB"),
    (lambda d: d["kernels"].update(attention_block=0, attention_block_source="s"), "a positive integer"),
    (lambda d: d.update(optimizer={"fused": True}), "unknown field optimizer"),
    (lambda d: d["kernels"].update(flash=True), "unknown field kernels.flash"),
    (lambda d: d["kernels"].update(hand_fused=["softmax"], hand_fused_source="s"), "names 'softmax'"),
    (lambda d: d["kernels"].update(hand_fused="layernorm", hand_fused_source="s"), "a list of names"),
    (lambda d: d.update(name=""), "field name"),
    (lambda d: d.update(efficiency={"compute_fraction": 1.5, "compute_fraction_source": "s"}),
     "efficiency.compute_fraction must be"),
    (lambda d: d.update(efficiency={"compute_fraction": 0.7}), "efficiency.compute_fraction_source is missing"),
])
def test_bad_profiles_name_the_file_and_field(tmp_path, edit, words):
    d = _profile()
    edit(d)
    with pytest.raises(SpecError, match="mine.toml") as exc:
        path = tmp_path / "mine.toml"
        path.write_text(_toml(d))
        load_stack(str(path))
    assert words in str(exc.value)


def test_unknown_stack_names_the_known_ones(tmp_path):
    with pytest.raises(SpecError) as exc:
        load_stack("deepspeed-9000")
    assert "'deepspeed-9000'" in str(exc.value) and "pytorch-fsdp" in str(exc.value)
    with pytest.raises(SpecError, match="does not exist"):
        load_stack(str(tmp_path / "nope.toml"))


def _toml(d: dict) -> str:
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v + '"'
        return repr(v)
    lines = [f"{k} = {val(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for k, v in d.items():
        if isinstance(v, dict):
            lines += [f"[{k}]"] + [f"{kk} = {val(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def test_gradient_reductions_run_in_fp32_only_over_the_data_axes():
    fsdp, xla = load_stack("pytorch-fsdp"), XLA
    assert fsdp.gradient_reduce_dtype == "float32" and xla.gradient_reduce_dtype == "as_traced"
    assert fsdp.wire("reduce_scatter", ("batch",), 1000, "bfloat16") == (2000, "float32")
    assert fsdp.wire("all_reduce", ("batch",), 1000, "float16") == (2000, "float32")
    assert fsdp.wire("all_reduce", ("batch",), 1000, "float32") == (1000, "float32")        # already fp32
    assert fsdp.wire("all_gather", ("batch",), 1000, "bfloat16") == (1000, "bfloat16")      # parameters
    assert fsdp.wire("all_reduce", ("model",), 1000, "bfloat16") == (1000, "bfloat16")      # activations (TP)
    assert fsdp.wire("all_reduce", ("batch", "model"), 1000, "bfloat16") == (1000, "bfloat16")
    assert xla.wire("reduce_scatter", ("batch",), 1000, "bfloat16") == (1000, "bfloat16")


def test_compute_fraction_divides_every_kernel_time_and_nothing_else():
    """A stack's fitted ``compute_fraction`` f: each fused group's time is the modelled one over f
    (GEMMs, vector and memory-bound kernels alike); communication is not compute and keeps its price."""
    import dataclasses

    import numpy as np

    from partir_emu.core.ir import Eqn, Program, Var
    from partir_emu.hwmodels.analytical import analyze
    from partir_emu.hwmodels.compute.kernel_times import group_times

    x, w, y, z = Var(0, (512, 512), "bfloat16"), Var(1, (512, 512), "bfloat16"), Var(2, (512, 512), "bfloat16"), \
        Var(3, (512, 512), "bfloat16")
    dn = (((1,), (0,)), ((), ()))
    p = Program((x, w), ("x", "w"), (Eqn("dot_general", (x, w), (y,), {"dimension_numbers": dn}),
                                     Eqn("tanh", (y,), (z,), {})), (z,), ("z",))
    fsdp = load_stack("pytorch-fsdp")
    assert 0 < fsdp.compute_fraction < 1 and dict(fsdp.sources)["efficiency.compute_fraction_source"].startswith("fit")
    base = load_spec("h100").with_stack(dataclasses.replace(fsdp, compute_fraction=1.0))
    half = base.with_stack(dataclasses.replace(fsdp, compute_fraction=0.5))
    plan = analyze(p).fusion.plan(base.kernels)
    t1, t2 = group_times(plan, base), group_times(plan, half)
    launch = base.compiler.kernel_launch_s * plan.work
    assert np.all(t1 > launch) and np.allclose(t2 - launch, 2 * (t1 - launch), rtol=1e-12)
