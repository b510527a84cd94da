"""The software stack as a model input: what the training framework does around the kernels.

A run is hardware × stack: the same H100 runs Megatron-LM's hand-fused kernels, PyTorch FSDP's
autograd and XLA's compiled program differently. A stack profile is a TOML file (like a chip spec,
every field with a ``<field>_source``), shared by every run of that stack, never per case:

.. code-block:: toml

    name = "pytorch-fsdp"
    description = "PyTorch FSDP (llm-foundry / Composer): autograd, FlashAttention-2, caching allocator"

    [kernels]
    attention_causal_skip = true      # a causal flash kernel skips the key blocks above the diagonal
    attention_block = 128             # ... in blocks of this many keys (and queries)
    attention_kernel = "flash-attention-2"   # measured fwd+bwd rates (data/kernels/), else GEMM-priced

    [memory]
    saved_activations = "kernel_inputs"   # or "residuals": what is kept for the backward (.residuals)
    reserved_bytes = 1.5e9                # per device, outside the model's tensors (context, workspaces, comm buffers)
    allocator_overhead = 0.05             # the caching allocator's fragmentation: peak × (1 + this)
    pipeline = "mpmd"                     # or "spmd": how the stack runs a pipeline's stages

What each field does to a prediction:

- ``attention_causal_skip`` / ``attention_block``: the matmul and vector FLOPs of a hand-fused
  ``flash_attention`` kernel (:mod:`.fusion`'s groups tagged by the scenario) are scaled by the
  share of ``b × b`` blocks on or below the diagonal of an ``s × s`` score matrix,
  ``(n + 1) / (2n)`` with ``n = ⌈s / b⌉`` (FlashAttention-2, arXiv 2307.08691 §3.1: causal blocks
  above the diagonal are skipped); the bytes it moves are unchanged;
- ``attention_kernel``: the kernel's measured forward+backward rate on this chip
  (:mod:`.attention_kernels`) prices the whole ``flash_attention`` group instead: its FLOPs in the
  benchmark's convention (causal: half the full score work) over the rate at its score length and
  head dimension; on a chip the kernel was not measured on, the group is priced as above;
- ``eager``: the stack runs op by op, each framework op its own kernel (PyTorch without
  ``torch.compile``): the chip's ``[compiler]`` grouping is replaced by :mod:`.fusion`'s eager one;
- ``hand_fused``: framework ops (of :data:`HAND_OPS`) the stack runs as hand-written kernels while the
  rest is grouped as the chip's compiler would (Megatron-LM's fused LayerNorm and scale-mask-softmax
  CUDA kernels): each marked region is one kernel, its backward another, instead of the separate
  reductions and elementwise passes a compiler without multi-output fusion makes of it;
- ``saved_activations``: the lifetimes :func:`.residuals.saved_liveness` gives the memory profile;
- ``[efficiency] compute_fraction`` (optional, default 1): every kernel of the step takes
  ``1 / compute_fraction`` times its modelled time. It is the one *fitted* number of a stack
  (its ``_source`` starts with "fit", ``partir-emu fidelity --fits`` lists the runs it is fitted on
  and ``--holdout`` refits it without the held-out runs): what the stack loses against the kernels'
  measured rates that no mechanism here models (sustained clocks under load, NCCL kernels sharing
  the SMs and HBM with the compute they overlap, allocator and launch stalls);
- ``pipeline``: ``"spmd"`` (default) prices a pipeline's stash as the lowered program holds it, in
  lock-step; ``"mpmd"`` (each stage its own program, as Megatron-LM runs it) holds only the slots an
  MPMD stage 0 holds (:mod:`partir_emu.hwmodels.ring_buffers`);
- ``reserved_bytes`` and ``allocator_overhead``: the memory the device needs beyond the profile's
  peak: ``needed = peak · (1 + allocator_overhead) + reserved_bytes``; a run fits if
  ``needed <= hbm_bytes``.

The default stack (:data:`XLA`, also ``--stack xla``) is the program as XLA runs it: no skipped
blocks (the scenario's flash kernel computes every block, as MaxText's Pallas kernel did with
``causal=False``), jax's residuals kept, nothing reserved.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from partir_emu.errors import SpecError
from partir_emu.hwmodels.compute.attention_kernels import AttentionKernel, list_kernels, load_kernel
from partir_emu.hwmodels.compute.efficiency import CompilerSpec, check_fields
from partir_emu.limits import load_toml

POLICIES = ("residuals", "kernel_inputs")     # what a stack keeps for the backward (.residuals)
REDUCE_DTYPES = ("as_traced", "float32")
EXECUTIONS = ("spmd", "mpmd")      # how a stack runs a pipeline's stages ([memory] pipeline; hwmodels.ring_buffers)
# the mesh axes the scenarios' strategies shard the batch over (bp, z2, z3 and their combinations):
# a reduction over one of them that is not also over another axis sums gradients across replicas
DATA_AXES = frozenset({"batch"})
_REDUCTIONS = frozenset({"all_reduce", "reduce_scatter"})
_NARROW = frozenset({"bfloat16", "float16"})
STACK_DIR = Path(__file__).parents[1] / "data" / "stacks"

_KERNELS = {"attention_causal_skip": ("bool", True), "attention_block": ("int", False),
            "attention_kernel": (tuple(list_kernels()), False), "eager": ("bool", False),
            "hand_fused": ("names", False)}
# the framework ops the scenarios mark (``scenarios.training.op_scope``) that a stack may run as
# hand-written kernels (``hand_fused``)
HAND_OPS = ("layernorm", "rmsnorm", "gelu", "relu", "silu", "scale_mask_softmax", "cross_entropy", "adam")
_COMM = {"gradient_reduce_dtype": (REDUCE_DTYPES, True)}
_MEMORY = {"saved_activations": (POLICIES, True), "reserved_bytes": ("float", False),
           "allocator_overhead": ("float", False), "pipeline": (EXECUTIONS, False)}
_EFFICIENCY = {"compute_fraction": ("fraction", True)}


@dataclass(frozen=True)
class StackSpec:
    """One software stack's profile (module docstring). The default is XLA running the program."""

    name: str = "xla"
    description: str = "XLA running the program as lowered: every block computed, jax's residuals kept"
    attention_causal_skip: bool = False
    attention_block: int = 128
    attention_kernel: str = ""          # a measured kernel (.attention_kernels); "": priced as its GEMMs
    eager: bool = False                 # each framework op its own kernel (.fusion, eager), no compiler
    hand_fused: tuple[str, ...] = ()    # framework ops run as one hand-written kernel each under a compiler
    saved_activations: str = "residuals"
    gradient_reduce_dtype: str = "as_traced"   # or "float32": 16-bit gradient reductions run in fp32
    reserved_bytes: float = 0.0
    allocator_overhead: float = 0.0
    pipeline: str = "spmd"              # or "mpmd": each stage its own program (hwmodels.ring_buffers)
    compute_fraction: float = 1.0       # the share of the modelled kernel rates the stack sustains
    path: str = ""
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False, hash=False)

    def causal_share(self, seq: int) -> float:
        """The share of a causal flash kernel's FLOPs this stack's kernel computes at sequence ``seq``."""
        if not self.attention_causal_skip or seq <= 0:
            return 1.0
        n = math.ceil(seq / self.attention_block)
        return (n + 1) / (2 * n)

    @functools.cached_property
    def kernel(self) -> AttentionKernel | None:
        """The measured attention kernel this stack runs (None: priced as its GEMMs)."""
        return load_kernel(self.attention_kernel) if self.attention_kernel else None

    def wire(self, prim: str, axes: tuple[str, ...], nbytes: int, dtype: str) -> tuple[int, str]:
        """The bytes and dtype a collective moves under this stack: a 16-bit reduction over the
        data-parallel axes (:data:`DATA_AXES` only) is a gradient reduction, which a stack with
        ``gradient_reduce_dtype = "float32"`` runs in fp32 (twice the bytes); anything else as traced."""
        if (self.gradient_reduce_dtype == "float32" and prim in _REDUCTIONS and dtype in _NARROW
                and axes and set(axes) <= DATA_AXES):
            return 2 * nbytes, "float32"
        return nbytes, dtype

    def compiler(self, chip: CompilerSpec) -> CompilerSpec:
        """How the chip's kernels are grouped under this stack: the chip's compiler, or eager
        (:mod:`.fusion`): framework ops one kernel each, GEMMs through cuBLASLt with a bias epilogue."""
        if not self.eager:
            return replace(chip, hand_ops=frozenset(self.hand_fused)) if self.hand_fused else chip
        return replace(chip, loop_fusion=True, matmul_operand_fusion=False, matmul_epilogue="bias", eager=True)

    def needed_bytes(self, peak_bytes: float) -> float:
        """Device memory a run with this profile peak needs (allocator and reserved memory included)."""
        return peak_bytes * (1.0 + self.allocator_overhead) + self.reserved_bytes

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "attention_causal_skip": self.attention_causal_skip, "attention_block": self.attention_block,
                "attention_kernel": self.attention_kernel, "eager": self.eager, "hand_fused": list(self.hand_fused),
                "saved_activations": self.saved_activations, "gradient_reduce_dtype": self.gradient_reduce_dtype,
                "reserved_bytes": self.reserved_bytes,
                "allocator_overhead": self.allocator_overhead, "pipeline": self.pipeline,
                "compute_fraction": self.compute_fraction,
                "path": self.path}


XLA = StackSpec()


def list_stacks() -> list[str]:
    """The built-in stack profiles (``xla`` and the files of ``partir_emu/hwmodels/data/stacks``)."""
    return sorted({"xla", *(p.stem for p in STACK_DIR.glob("*.toml"))})


def load_stack(name_or_path: str | os.PathLike | StackSpec | None) -> StackSpec:
    """A stack by name (``"pytorch-fsdp"``), by path to a ``.toml`` profile, or as given (None: XLA)."""
    if name_or_path is None or isinstance(name_or_path, StackSpec):
        return name_or_path or XLA
    s = str(name_or_path)
    if s == "xla":
        return XLA
    path = Path(s) if s.endswith(".toml") or os.sep in s else STACK_DIR / f"{s}.toml"
    if not path.is_file():
        if path.parent == STACK_DIR:
            raise SpecError(f"no software stack named {s!r}; known stacks: {', '.join(list_stacks())}. "
                            f"Pass a path to a .toml stack profile for your own")
        raise SpecError(f"stack profile file {s} does not exist or is not a regular file; give a .toml stack profile")
    return stack_from_dict(load_toml(path, SpecError, what="stack profile"), str(path))


def stack_from_dict(data: Any, where: str = "<dict>") -> StackSpec:
    """Validate a stack profile (every field needs its ``_source``; unknown fields are errors)."""
    if not isinstance(data, dict):
        raise SpecError(f"{where}: a stack profile is a TOML table")
    unknown = sorted(set(data) - {"name", "description", "kernels", "comm", "memory", "efficiency"})
    if unknown:
        raise SpecError(f"{where}: unknown field {unknown[0]}; a stack profile has name, description, "
                        f"[kernels], [comm], [memory] and [efficiency]")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip() or len(name) > 64:
        raise SpecError(f"{where}: field name must be a non-empty string of at most 64 characters")
    kernels = check_fields(data.get("kernels", {}), _KERNELS, where, "kernels")
    unknown_ops = [op for op in kernels.get("hand_fused", ()) if op not in HAND_OPS]
    if unknown_ops:
        raise SpecError(f"{where}: field kernels.hand_fused names {unknown_ops[0]!r}, which no scenario marks as a "
                        f"framework op; known ops: {', '.join(HAND_OPS)}")
    memory = check_fields(data.get("memory", {}), _MEMORY, where, "memory")
    comm = check_fields(data["comm"], _COMM, where, "comm") if "comm" in data else {}
    efficiency = check_fields(data["efficiency"], _EFFICIENCY, where, "efficiency") if "efficiency" in data else {}
    if memory.get("allocator_overhead", 0.0) > 0.5:
        raise SpecError(f"{where}: field memory.allocator_overhead = {memory['allocator_overhead']:g} is above 0.5; "
                        f"it is a fraction of the peak (0.05 = 5 %)")
    if memory.get("reserved_bytes", 0.0) > 2 ** 40:
        raise SpecError(f"{where}: field memory.reserved_bytes = {memory['reserved_bytes']:g} is above 1 TiB per device")
    sources = tuple(sorted((f"{t}.{k}", str(v)) for t in ("kernels", "comm", "memory", "efficiency")
                           for k, v in data.get(t, {}).items() if k.endswith("_source")))
    return StackSpec(name=name, description=str(data.get("description", "")), path=where, sources=sources,
                     **kernels, **comm, **memory, **efficiency)
