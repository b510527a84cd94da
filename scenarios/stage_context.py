"""The strategy parts ``pp`` and ``cp`` (:func:`scenarios.strategies.build_strategy`), on mesh axes that
are neither data nor model axes: ``stage`` and ``context``.

- ``pp`` (pipeline parallelism): every stacked layer weight (kinds with ``stacked``: dim 0 is the
  layer, stored stage-major by a pipelined model, ``scenarios.transformer.pipeline``) and its Adam
  moments tiled on dim 0 over ``stage``, so device ``k`` of the axis holds stage ``k``'s layers.
  Propagation carries the stage tiling into the pipeline's tick loop (the stage dim of its state
  buffer, conveyor and vmapped layers); their rotations by one stage become ``collective_permute``s.
  Needs a pipelined config (``--set pipeline=P``, ``P`` a multiple of the axis size).
- ``cp`` (context parallelism): the batch's sequence dim tiled over ``context``. With
  ``--set attention=ring`` each device keeps its sequence block's queries and passes key/value
  blocks round the ring (``scenarios.transformer.ring_attention``: ``collective_permute``s); with
  another attention core the keys and values are gathered over ``context`` where the scores need
  them (Llama 3's all-gather context parallelism). The rest of the layer is per position.

Neither axis is a data axis: ``bp`` and ZeRO leave them alone (:func:`scenarios.strategies.data_axes`).
"""
from __future__ import annotations

from collections.abc import Sequence

from partir_emu.compiler.tactics import ManualPartition
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from scenarios.common import Config, ParamKind

STAGE_AXIS = "stage"
CONTEXT_AXIS = "context"


def _need_axis(name: str, part: str, axis: str, mesh: Mesh) -> int:
    if axis not in mesh.axis_names:
        raise ScenarioError(f"strategy {name!r}: {part} needs mesh axis {axis!r}, which {mesh} lacks; add it, e.g. "
                            f"--mesh batch=2,{axis}=2")
    return mesh.axis_size(axis)


def stage_tactic(name: str, kinds: Sequence[ParamKind], mesh: Mesh, cfg: Config | None) -> ManualPartition:
    """``pp``: the stacked layer weights and their moments on dim 0 over ``stage`` (see the module docstring)."""
    size = _need_axis(name, "pp", STAGE_AXIS, mesh)
    if cfg is not None:
        p = int(cfg.get("pipeline", 1))
        if p < 2 or p % size:
            raise ScenarioError(f"strategy {name!r}: pp splits a pipeline's stages over axis {STAGE_AXIS!r} (size "
                                f"{size}), and this config has pipeline={p}; set --set pipeline={size},microbatches=M "
                                f"(a multiple of {size})")
    stacked = [k for k in kinds if k.stacked]
    if not stacked:
        raise ScenarioError(f"strategy {name!r}: this model has no stacked layers for pp to split into stages; "
                            f"give it a pipeline (transformer: --set pipeline=P,microbatches=M)")
    inputs = {f"{prefix}/{k.pattern}": 0 for k in stacked for prefix in ("params", "opt/*")}
    return ManualPartition(inputs, axis=STAGE_AXIS, name=f"pp:{STAGE_AXIS}")


def context_tactic(name: str, mesh: Mesh, cfg: Config | None, batch_patterns: Sequence[str],
                   seq_dim: int | None) -> ManualPartition:
    """``cp``: the batch's sequence dim over ``context`` (see the module docstring)."""
    size = _need_axis(name, "cp", CONTEXT_AXIS, mesh)
    if seq_dim is None:
        raise ScenarioError(f"strategy {name!r}: cp splits the sequence, and this scenario's batch has no sequence "
                            f"dim; drop cp")
    if cfg is not None and cfg.get("attention") == "ring" and int(cfg.get("ring_blocks", 1)) % size:
        raise ScenarioError(f"strategy {name!r}: ring attention in ring_blocks={cfg.get('ring_blocks')} blocks cannot "
                            f"be split over axis {CONTEXT_AXIS!r} of size {size}; set --set ring_blocks={size}")
    if cfg is not None and cfg["seq"] % size:
        raise ScenarioError(f"strategy {name!r}: seq={cfg['seq']} is not divisible by axis {CONTEXT_AXIS!r} of size "
                            f"{size}; change --set seq=... or the mesh")
    # meet=reshard: where an attention core other than the ring's needs whole keys and values, the
    # meeting of the sequence tilings is where they are gathered (all-gather context parallelism)
    return ManualPartition({p: seq_dim for p in batch_patterns}, axis=CONTEXT_AXIS, name=f"cp:{CONTEXT_AXIS}",
                           meet="reshard")


__all__ = ["CONTEXT_AXIS", "STAGE_AXIS", "context_tactic", "stage_tactic"]
