"""The inference scenario's options: names, choices, defaults, presets (PaLM 540B/62B decode and
prefill) and the completion and checks of a config. Its strategies read them too
(:mod:`.strategies`), so they live apart from the scenario that assembles everything.
"""
from __future__ import annotations

from partir_emu.errors import ScenarioError
from scenarios.common import Config

SIZE_NAMES = ("batch", "prompt_len", "cache_len", "d_model", "heads", "head_dim", "kv_heads", "d_ff", "layers",
              "vocab", "phase", "precision", "mlp", "block", "norm", "tied")
CHOICES: dict[str, tuple[str, ...]] = {
    "phase": ("decode", "prefill"), "precision": ("f32", "bf16"), "mlp": ("gelu", "swiglu"),
    "block": ("serial", "parallel"), "norm": ("layernorm", "rmsnorm"),
}
FLAG_NAMES = ("tied",)
DEFAULTS: Config = dict(phase="decode", precision="f32", mlp="gelu", block="serial", norm="layernorm", tied=0)
_PALM = dict(DEFAULTS, precision="bf16", mlp="swiglu", block="parallel", norm="layernorm", tied=1, kv_heads=1,
             head_dim=256, vocab=256000, cache_len=2048)

PRESETS: dict[str, Config] = {
    "tiny": dict(DEFAULTS, batch=8, prompt_len=6, cache_len=8, d_model=16, heads=4, kv_heads=1, d_ff=32, layers=2,
                 vocab=32),
    "palm540b-decode": dict(_PALM, phase="decode", batch=64, prompt_len=1920, d_model=18432, heads=48, d_ff=73728,
                            layers=118),
    "palm540b-prefill": dict(_PALM, phase="prefill", batch=512, prompt_len=2048, d_model=18432, heads=48,
                             d_ff=73728, layers=118),
    "palm62b-decode": dict(_PALM, phase="decode", batch=64, prompt_len=1920, d_model=8192, heads=32, d_ff=32768,
                           layers=64),
}


def complete_config(cfg: Config) -> Config:
    """``cfg`` with every option present: the defaults, ``head_dim = d_model // heads`` and
    ``kv_heads = 1`` (multi-query) where absent."""
    out = dict(DEFAULTS, **cfg)
    out.update({k: str(out[k]) for k in CHOICES})
    if "head_dim" not in out:
        if out["d_model"] % out["heads"]:
            raise ScenarioError(f"inference: d_model={out['d_model']} is not divisible by heads={out['heads']}; "
                                "change --set d_model=... or heads=..., or set head_dim=...")
        out["head_dim"] = out["d_model"] // out["heads"]
    out.setdefault("kv_heads", 1)
    return out


def check_config(cfg: Config) -> None:
    if cfg["heads"] % cfg["kv_heads"]:
        raise ScenarioError(f"inference: kv_heads={cfg['kv_heads']} does not divide heads={cfg['heads']}; "
                            "grouped-query attention needs whole groups (kv_heads=1 is multi-query)")
    fits = cfg["prompt_len"] <= cfg["cache_len"] if cfg["phase"] == "prefill" else cfg["prompt_len"] < cfg["cache_len"]
    if not fits:
        raise ScenarioError(f"inference: phase={cfg['phase']} with prompt_len={cfg['prompt_len']} does not fit "
                            f"cache_len={cfg['cache_len']} (prefill writes prompt_len positions, decode writes "
                            "position prompt_len); raise --set cache_len=... or lower prompt_len")


__all__ = ["SIZE_NAMES", "CHOICES", "FLAG_NAMES", "DEFAULTS", "PRESETS", "complete_config", "check_config"]
