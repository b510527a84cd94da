"""Hardware specs as data: TOML files with units in field names and a source per number.

A spec file has a top-level ``name``, ``kind`` (``"tpu"`` or ``"gpu"``) and
``description``, then tables:

``[chip]``       ``flops_bf16_per_s``, ``flops_f32_per_s``, ``hbm_bytes``, ``hbm_bw_bytes_per_s``
                 (optional ``vector_flops_per_s``: rate of non-matmul ops; default ``flops_f32_per_s``;
                 optional ``flops_fp8_per_s``: dense rate of FP8 x FP8 matmuls, on chips with FP8
                 matrix units; without it an FP8 matmul is priced at ``flops_bf16_per_s`` and the
                 report says so: :attr:`HardwareSpec.fp8_matmul_rate`)
``[ici]``        TPU only: ``link_bw_bytes_per_s`` (one way, per link), ``link_latency_s`` (per hop),
                 ``links_per_chip``
``[nvlink]``     GPU only: ``nvlink_bw_bytes_per_s`` (one way, per GPU), ``nvlink_latency_s`` (per hop)
``[network]``    GPU only: ``gpus_per_node``, ``nics_per_node``, ``nic_bw_bytes_per_s`` (one way, per NIC),
                 ``ib_latency_s`` (per hop)
``[topology]``   TPU: ``kind = "torus"``, ``pod_dims``, ``wraparound`` (``full`` | ``cube_multiple`` |
                 ``always`` | ``never``), ``cube`` (needed by ``cube_multiple``).
``[dcn]``        TPU, optional: the data-centre network that joins slices (multi-slice, several pods):
                 ``host_bw_bytes_per_s`` (one way, per host NIC), ``latency_s``, ``chips_per_host``,
                 ``pcie_bw_bytes_per_s`` (chip to its host, one way), ``max_slices``; optional
                 ``achieved_fraction`` (<= 1: the NIC bandwidth achieved, the latency divided by it) and
                 ``overlaps_compute`` (false: collectives across slices block the compute stream)
                 (:mod:`partir_emu.hwmodels.machine.slices`).
                 GPU: ``kind = "nvswitch"``, ``fabric`` (``fat_tree`` | ``rail_optimized``),
                 ``nodes_per_leaf`` (fat tree), ``nodes_per_su`` (scalable unit: the rail leaves of
                 a rail-optimized fabric; with ``spine_oversubscription`` the unit under one spine
                 group, :mod:`partir_emu.hwmodels.machine.superpod`), ``max_nodes``; optional
                 ``spine_oversubscription`` (>= 1: a scalable unit's NIC bandwidth over its uplinks to
                 the core that joins the units; without it every leaf joins one non-blocking spine).
``[compiler]``, ``[efficiency]`` (optional): how the chip's compiler fuses and what fraction of
                 each peak it reaches; see :mod:`partir_emu.hwmodels.compute.efficiency` (without them:
                 no fusion, 100 % of every peak).

Beside every number ``X`` a string ``X_source`` says where it comes from.

Search order for ``load_spec(name)``: an explicit path (anything ending in
``.toml`` or containing a path separator), then each directory of
``$PARTIR_EMU_HW_PATH`` (``os.pathsep``-separated), then the package's
``data/`` directory. A user adds hardware by dropping a file there, no code.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from partir_emu.errors import SpecError
from partir_emu.hwmodels.compute.efficiency import CompilerSpec, EfficiencySpec, parse_compiler, parse_efficiency
from partir_emu.hwmodels.compute.stack import XLA, StackSpec
from partir_emu.hwmodels.machine.spec_fields import check_ranges as _check_ranges
from partir_emu.hwmodels.machine.spec_fields import check_table as _check_table
from partir_emu.hwmodels.machine.spec_fields import top_source
from partir_emu.limits import load_toml

DATA_DIR = Path(__file__).parents[1] / "data"
ENV_VAR = "PARTIR_EMU_HW_PATH"

# schema: table -> field -> (type, required). Types: float (> 0), int (> 0), str, ints (list of int > 0),
# or a tuple of allowed strings.
_CHIP = {"flops_bf16_per_s": ("float", True), "flops_f32_per_s": ("float", True), "hbm_bytes": ("int", True),
         "hbm_bw_bytes_per_s": ("float", True), "vector_flops_per_s": ("float", False),
         "flops_fp8_per_s": ("float", False)}
_SCHEMA: dict[str, dict[str, dict[str, tuple[Any, bool]]]] = {
    "tpu": {
        "chip": _CHIP,
        "ici": {"link_bw_bytes_per_s": ("float", True), "link_latency_s": ("float", True),
                "links_per_chip": ("int", True)},
        "topology": {"kind": (("torus",), True), "pod_dims": ("ints", True),
                     "wraparound": (("full", "cube_multiple", "always", "never"), True),
                     "cube": ("ints", False)},
    },
    "gpu": {
        "chip": _CHIP,
        "nvlink": {"nvlink_bw_bytes_per_s": ("float", True), "nvlink_latency_s": ("float", True)},
        "network": {"gpus_per_node": ("int", True), "nics_per_node": ("int", True),
                    "nic_bw_bytes_per_s": ("float", True), "ib_latency_s": ("float", True)},
        "topology": {"kind": (("nvswitch",), True), "fabric": (("fat_tree", "rail_optimized"), True),
                     "nodes_per_leaf": ("int", True), "nodes_per_su": ("int", True), "max_nodes": ("int", True),
                     "spine_oversubscription": ("float", False)},
    },
}
_OPTIONAL_TABLES = ("compiler", "efficiency")     # validated by hwmodels.efficiency
_DCN = {"host_bw_bytes_per_s": ("float", True), "latency_s": ("float", True), "chips_per_host": ("int", True),
        "pcie_bw_bytes_per_s": ("float", True), "max_slices": ("int", True),
        "achieved_fraction": ("float", False), "overlaps_compute": ((True, False), False)}
_TOP = {"name": ("str", True), "kind": (("tpu", "gpu"), True), "description": ("str", False),
        "what_if": ((True, False), False), "kernels_measured_as": ("str", False)}


@dataclass(frozen=True)
class DcnSpec:
    """The data-centre network between TPU slices: each host's NIC into a non-blocking fabric."""

    host_bw_bytes_per_s: float
    latency_s: float
    chips_per_host: int
    pcie_bw_bytes_per_s: float
    max_slices: int
    # the share of the nominal NIC bandwidth a DCN transfer achieves (its latency is the nominal one
    # divided by it): 1.0 unless the spec says otherwise, e.g. fitted to multi-slice runs
    achieved_fraction: float = 1.0
    # False: a collective across slices is not overlapped with compute (the compute stream waits for
    # it where it is issued; :mod:`partir_emu.hwmodels.timeline.overlap`)
    overlaps_compute: bool = True

    @property
    def nic_bw_bytes_per_s(self) -> float:
        """The bandwidth a DCN transfer gets from its host's NIC (nominal x achieved fraction)."""
        return self.host_bw_bytes_per_s * self.achieved_fraction

    @property
    def nic_latency_s(self) -> float:
        """The latency of a NIC hop as achieved (nominal / achieved fraction)."""
        return self.latency_s / self.achieved_fraction


@dataclass(frozen=True)
class TorusSpec:
    """TPU inter-chip interconnect: a 2D/3D torus (slices of it), and the DCN between slices if given."""

    link_bw_bytes_per_s: float
    link_latency_s: float
    links_per_chip: int
    pod_dims: tuple[int, ...]
    wraparound: str
    cube: tuple[int, ...] | None = None
    dcn: DcnSpec | None = None

    @property
    def pod_chips(self) -> int:
        """Chips of one pod: the largest slice."""
        return math.prod(self.pod_dims)

    @property
    def max_chips(self) -> int:
        """Chips of one slice at most (several slices over DCN are asked for: ``chips_limit``)."""
        return self.pod_chips


@dataclass(frozen=True)
class GpuClusterSpec:
    """GPU nodes: NVSwitch inside a node, InfiniBand fat-tree (optionally rail-optimized) across."""

    nvlink_bw_bytes_per_s: float
    nvlink_latency_s: float
    gpus_per_node: int
    nics_per_node: int
    nic_bw_bytes_per_s: float
    ib_latency_s: float
    fabric: str
    nodes_per_leaf: int
    nodes_per_su: int
    max_nodes: int
    # a scalable unit's NIC bandwidth over its uplinks to the core (None: no unit tier, one non-blocking
    # spine joins every leaf; :mod:`partir_emu.hwmodels.machine.superpod`)
    spine_oversubscription: float | None = None

    @property
    def max_chips(self) -> int:
        return self.max_nodes * self.gpus_per_node


@dataclass(frozen=True)
class HardwareSpec:
    """One chip type and the network that joins its chips. Immutable; build with :func:`load_spec`."""

    name: str
    kind: str                               # "tpu" | "gpu"
    flops_bf16_per_s: float
    flops_f32_per_s: float
    hbm_bytes: int
    hbm_bw_bytes_per_s: float
    vector_flops_per_s: float
    network: TorusSpec | GpuClusterSpec
    description: str = ""
    path: str = ""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    compiler: CompilerSpec = CompilerSpec()
    efficiency: EfficiencySpec = EfficiencySpec()
    stack: StackSpec = XLA                  # the software stack the chip runs (``with_stack``)
    flops_fp8_per_s: float | None = None    # dense FP8 x FP8 matmul rate; None: the chip has no FP8 units
    kernels_measured_as: str = ""           # whose measured kernel rates apply (a what-if: its base chip's)

    @property
    def kernel_chip(self) -> str:
        """The chip measured kernel rates (data/kernels/) are looked up by: this one unless it says another."""
        return self.kernels_measured_as or self.name

    def with_stack(self, stack: StackSpec) -> HardwareSpec:
        """This chip running ``stack`` (:mod:`partir_emu.hwmodels.compute.stack`)."""
        return self if stack == self.stack else replace(self, stack=stack)

    @property
    def kernels(self) -> CompilerSpec:
        """How the program's equations become kernels on this chip under its stack (:mod:`.fusion`)."""
        return self.stack.compiler(self.compiler)

    @property
    def fits_bytes(self) -> float:
        """The largest profile peak that fits: HBM less what the stack needs beside the tensors."""
        st = self.stack
        return max(0.0, (self.hbm_bytes - st.reserved_bytes) / (1.0 + st.allocator_overhead))

    def flops_per_s(self, dtype: str) -> float:
        """Peak matrix rate for operands of ``dtype`` (16-bit floats and ints: bf16 rate; FP8: the FP8
        rate, or bf16's on a chip without FP8 units; others: f32)."""
        if dtype in FP8_DTYPES:
            return self.fp8_matmul_rate
        return self.flops_bf16_per_s if dtype in MATMUL_16BIT_DTYPES else self.flops_f32_per_s

    @property
    def fp8_matmul_rate(self) -> float:
        """What an FP8 x FP8 matmul is priced at: ``flops_fp8_per_s``, or on a chip without FP8 matrix
        units the bf16 rate (XLA converts FP8 operands to a type the chip multiplies, as it does on CPU)."""
        return self.flops_fp8_per_s if self.flops_fp8_per_s is not None else self.flops_bf16_per_s

    def to_json(self) -> dict:
        net = {k: (list(v) if isinstance(v, tuple) else dict(vars(v)) if isinstance(v, DcnSpec) else v)
               for k, v in vars(self.network).items()}
        return {"name": self.name, "kind": self.kind, "flops_bf16_per_s": self.flops_bf16_per_s,
                "flops_f32_per_s": self.flops_f32_per_s, "flops_fp8_per_s": self.flops_fp8_per_s,
                "vector_flops_per_s": self.vector_flops_per_s,
                "hbm_bytes": self.hbm_bytes, "hbm_bw_bytes_per_s": self.hbm_bw_bytes_per_s, "network": net,
                "compiler": {k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in vars(self.compiler).items()},
                "efficiency": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self.efficiency).items()},
                "stack": self.stack.to_json(), "path": self.path}

    def __str__(self) -> str:
        return (f"{self.name}: {self.flops_bf16_per_s / 1e12:g} TFLOP/s bf16, {self.hbm_bytes / 2**30:g} GiB HBM "
                f"at {self.hbm_bw_bytes_per_s / 1e9:g} GB/s")


MATMUL_16BIT_DTYPES = frozenset({"bfloat16", "float16", "int8", "uint8", "int16", "uint16"})
FP8_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2"})     # the formats of FP8 matrix units (E4M3, E5M2)


# -- finding files ---------------------------------------------------------------------------------
def search_path() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get(ENV_VAR, "").split(os.pathsep) if p]
    return dirs + [DATA_DIR]


def list_specs() -> list[str]:
    """Names of every spec file on the search path (``$PARTIR_EMU_HW_PATH`` then the package's)."""
    names: set[str] = set()
    for d in search_path():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.toml"))
    return sorted(names)


def find_spec(name_or_path: str | os.PathLike) -> Path:
    s = str(name_or_path)
    if s.endswith(".toml") or os.sep in s or (os.altsep and os.altsep in s):
        p = Path(s)
        if not _is_file(p):
            what = ("is a directory" if p.is_dir() else "is not a regular file" if p.exists() else "does not exist")
            raise SpecError(f"hardware spec file {s} {what}; give a .toml spec file (`partir-emu hardware` lists "
                            f"the built-in ones)")
        return p
    for d in search_path():
        p = d / f"{s}.toml"
        if _is_file(p):
            return p
    raise SpecError(f"no hardware spec named {s!r}; known specs: {', '.join(list_specs())}. "
                    f"Add {s}.toml to a directory listed in ${ENV_VAR} or pass a path to a .toml file")


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except (OSError, ValueError):       # a name too long for the file system, a NUL in it
        return False


# -- loading and validating -------------------------------------------------------------------------
def load_spec(name_or_path: str | os.PathLike | HardwareSpec,
              overrides: Mapping[str, Any] | None = None) -> HardwareSpec:
    """Load and validate a spec by name (``"tpu-v4"``) or path (reads the file; a :class:`SpecLoader`
    reads each file once).

    ``overrides`` maps ``"table.field"`` (or a top-level ``"field"``) to a value applied before validation,
    e.g. ``{"topology.fabric": "rail_optimized"}``.
    """
    return SpecLoader().load(name_or_path, overrides)


class SpecLoader:
    """Loads specs and keeps each file it parsed, by (resolved path, modification time): a memo with
    hashable keys, so an edited file is read again. A load with ``overrides`` is never kept."""

    def __init__(self) -> None:
        self._specs: dict[tuple[str, int], HardwareSpec] = {}

    def clear(self) -> None:
        self._specs.clear()

    def load(self, name_or_path: str | os.PathLike | HardwareSpec,
             overrides: Mapping[str, Any] | None = None) -> HardwareSpec:
        """As :func:`load_spec`; a spec object without overrides is returned as it is."""
        if isinstance(name_or_path, HardwareSpec) and not overrides:
            return name_or_path
        if isinstance(name_or_path, HardwareSpec):
            name_or_path = name_or_path.path
        path = find_spec(name_or_path)
        key = None
        if not overrides:
            try:
                key = (str(path.resolve()), path.stat().st_mtime_ns)
            except OSError:
                key = None
            hit = self._specs.get(key) if key is not None else None
            if hit is not None:
                return hit
        spec = spec_from_dict(_read(path, overrides), str(path))
        if key is not None:
            self._specs[key] = spec
        return spec


def _read(path: Path, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The parsed TOML of ``path`` with ``overrides`` applied."""
    data = load_toml(path, SpecError, "hardware spec")
    for key, value in (overrides or {}).items():
        table, _, fld = key.rpartition(".")
        target = data.setdefault(table, {}) if table else data
        if not isinstance(target, dict):
            raise SpecError(f"{path}: override {key!r} names table [{table}], which is not a table")
        target[fld] = value
    return data


def spec_from_dict(data: Mapping[str, Any], where: str = "<dict>") -> HardwareSpec:
    """Validate a parsed spec (every error names ``where`` and the field) and build the HardwareSpec."""
    top = _check_table(data, _TOP, where, "", allow_tables=True)
    kind = top["kind"]
    schema = _SCHEMA[kind]
    optional = (*_OPTIONAL_TABLES, "dcn") if kind == "tpu" else _OPTIONAL_TABLES
    extra = [k for k, v in data.items() if isinstance(v, dict) and k not in schema and k not in optional]
    if extra:
        raise SpecError(f"{where}: unknown table [{extra[0]}] for a {kind} spec; "
                        f"expected tables {', '.join('[' + t + ']' for t in (*schema, *optional))}")
    vals: dict[str, dict[str, Any]] = {}
    sources: dict[str, str] = {}
    for table, fields in schema.items():
        sub = data.get(table)
        if sub is None:
            raise SpecError(f"{where}: table [{table}] is missing; a {kind} spec needs "
                            f"[{table}] with {', '.join(f for f, (_, req) in fields.items() if req)}")
        if not isinstance(sub, dict):
            raise SpecError(f"{where}: field {table!r} must be a table [{table}], got {type(sub).__name__}")
        vals[table] = _check_table(sub, fields, where, table + ".")
        sources.update({k[:-len("_source")]: v for k, v in sub.items() if k.endswith("_source")})
    if "kernels_measured_as" in top:        # a what-if spec keeps its base chip's without a source
        sources["kernels_measured_as"] = top_source(data, "kernels_measured_as", where)
    if kind == "tpu" and isinstance(data.get("dcn"), dict):
        vals["dcn"] = _check_table(data["dcn"], _DCN, where, "dcn.")
        sources.update({f"dcn.{k[:-len('_source')]}": v for k, v in data["dcn"].items() if k.endswith("_source")})
    if not top.get("what_if", False):
        _check_ranges(vals, where)
    chip = vals["chip"]
    topo = vals["topology"]
    if kind == "tpu":
        if topo["wraparound"] == "cube_multiple":
            if "cube" not in topo:
                raise SpecError(f"{where}: field topology.cube is missing; wraparound = \"cube_multiple\" needs "
                                f"the cube shape, e.g. cube = [4, 4, 4]")
            if len(topo["cube"]) != len(topo["pod_dims"]):
                raise SpecError(f"{where}: field topology.cube {topo['cube']} has {len(topo['cube'])} dims but "
                                f"topology.pod_dims {topo['pod_dims']} has {len(topo['pod_dims'])}")
        if not 1 <= len(topo["pod_dims"]) <= 3:
            raise SpecError(f"{where}: field topology.pod_dims must list 1 to 3 torus dims, got {topo['pod_dims']}")
        ici = vals["ici"]
        dcn = DcnSpec(**vals["dcn"]) if "dcn" in vals else None
        if dcn is not None and math.prod(topo["pod_dims"]) % dcn.chips_per_host:
            raise SpecError(f"{where}: field dcn.chips_per_host = {dcn.chips_per_host} does not divide the pod's "
                            f"{math.prod(topo['pod_dims'])} chips; give the chips one host serves")
        net: TorusSpec | GpuClusterSpec = TorusSpec(
            ici["link_bw_bytes_per_s"], ici["link_latency_s"], ici["links_per_chip"], topo["pod_dims"],
            topo["wraparound"], topo.get("cube"), dcn)
    else:
        nv, nw = vals["nvlink"], vals["network"]
        if nw["nics_per_node"] != nw["gpus_per_node"]:
            raise SpecError(f"{where}: field network.nics_per_node ({nw['nics_per_node']}) must equal "
                            f"network.gpus_per_node ({nw['gpus_per_node']}): the model attaches one NIC per GPU")
        net = GpuClusterSpec(nv["nvlink_bw_bytes_per_s"], nv["nvlink_latency_s"], nw["gpus_per_node"],
                             nw["nics_per_node"], nw["nic_bw_bytes_per_s"], nw["ib_latency_s"], topo["fabric"],
                             topo["nodes_per_leaf"], topo["nodes_per_su"], topo["max_nodes"],
                             topo.get("spine_oversubscription"))
    return HardwareSpec(top["name"], kind, chip["flops_bf16_per_s"], chip["flops_f32_per_s"], chip["hbm_bytes"],
                        chip["hbm_bw_bytes_per_s"], chip.get("vector_flops_per_s", chip["flops_f32_per_s"]), net,
                        top.get("description", ""), where, sources,
                        compiler=parse_compiler(data.get("compiler"), where),
                        efficiency=parse_efficiency(data.get("efficiency"), where),
                        flops_fp8_per_s=chip.get("flops_fp8_per_s"),
                        kernels_measured_as=top.get("kernels_measured_as", ""))
