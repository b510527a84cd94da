"""Measured attention kernels (hwmodels/compute/attention_kernels.py): the packaged FlashAttention-2
file, interpolation of its curves, and clear errors for bad kernel files."""
from __future__ import annotations

import math

import pytest
import tomllib

from partir_emu.errors import SpecError
from partir_emu.hwmodels.compute.attention_kernels import KERNEL_DIR, kernel_from_dict, list_kernels, load_kernel
from partir_emu.hwmodels.compute.stack import load_stack, stack_from_dict

FA2 = KERNEL_DIR / "flash-attention-2.toml"


def test_the_packaged_kernel_reads_back_its_numbers():
    raw = tomllib.loads(FA2.read_text())
    k = load_kernel("flash-attention-2")
    assert "flash-attention-2" in list_kernels() and k.causal_credit == 0.5
    assert k.chips() == ["a100", "h100"]
    for c in raw["curve"]:
        for s, t in zip(c["seq"], c["tflops"]):
            assert k.rate(c["chip"], s, c["head_dim"], c["causal"]) == pytest.approx(t * 1e12, rel=1e-12)
        assert c["source"].strip()


def test_rates_interpolate_in_log_seq_and_hold_at_the_ends():
    k = load_kernel("flash-attention-2")
    r1k, r2k = k.rate("h100", 1024, 128), k.rate("h100", 2048, 128)
    mid = k.rate("h100", 2 ** 10.5, 128)
    assert mid == pytest.approx((r1k + r2k) / 2, rel=1e-12)
    assert k.rate("h100", 64, 128) == k.rate("h100", 512, 128)          # below the measured range: held
    assert k.rate("h100", 2 ** 20, 128) == k.rate("h100", 16384, 128)   # above: held
    # a head dim between the measured 64 and 128 takes the nearer; ties the smaller
    assert k.rate("h100", 2048, 80) == k.rate("h100", 2048, 64)
    assert k.rate("h100", 2048, 96) == k.rate("h100", 2048, 64)
    assert k.rate("h100", 2048, 256) == k.rate("h100", 2048, 128)
    assert k.rate("tpu-v4", 2048, 128) is None                          # not measured there
    # causal work is credited at half: the causal rate is below the full one at every length
    assert all(k.rate("h100", s, 128, True) < k.rate("h100", s, 128, False) for s in (512, 2048, 16384))


def _kernel(**over):
    raw = {"name": "k", "flops_convention": "fa2", "flops_convention_source": "src",
           "curve": [{"chip": "h100", "head_dim": 128, "causal": True, "seq": [512, 1024], "tflops": [100, 200],
                      "source": "fig"}]}
    raw.update(over)
    return raw


@pytest.mark.parametrize("edit, message", [
    ({"flops_convention": "megatron"}, "flops_convention must be one of fa2"),
    ({"flops_convention_source": ""}, "flops_convention_source is missing"),
    ({"curve": []}, "no \\[\\[curve\\]\\] tables"),
    ({"extra": 1}, "unknown field extra"),
    ({"curve": [{"chip": "h100", "head_dim": 128, "causal": True, "seq": [1024, 512], "tflops": [1, 2], "source": "s"}]},
     "seq strictly increasing"),
    ({"curve": [{"chip": "h100", "head_dim": 128, "causal": True, "seq": [512], "tflops": [1, 2], "source": "s"}]},
     "same length"),
    ({"curve": [{"chip": "h100", "head_dim": 128, "causal": "yes", "seq": [512], "tflops": [1], "source": "s"}]},
     "causal must be true or false"),
    ({"curve": [{"chip": "h100", "head_dim": 128, "causal": True, "seq": [512], "tflops": [1]}]}, "source is missing"),
    ({"curve": [{"chip": "h100", "head_dim": 128, "causal": True, "seq": [512], "tflops": [math.inf], "source": "s"}]},
     "tflops must be a non-empty list of numbers"),
    ({"curve": 2 * [{"chip": "h100", "head_dim": 128, "causal": True, "seq": [512], "tflops": [1], "source": "s"}]},
     "two curves for chip 'h100'"),
])
def test_bad_kernel_files_are_named(edit, message):
    with pytest.raises(SpecError, match=message):
        kernel_from_dict(_kernel(**edit), "k.toml")


def test_a_stack_names_a_known_kernel_only():
    assert load_stack("pytorch-fsdp").kernel is not None and load_stack("megatron-lm").kernel is None
    raw = {"name": "s", "kernels": {"attention_causal_skip": True, "attention_causal_skip_source": "x",
                                    "attention_kernel": "no-such-kernel", "attention_kernel_source": "x"}}
    with pytest.raises(SpecError, match="kernels.attention_kernel must be one of 'flash-attention-2'"):
        stack_from_dict(raw, "s.toml")
    with pytest.raises(SpecError, match="no attention kernel named 'nope'"):
        load_kernel("nope")
