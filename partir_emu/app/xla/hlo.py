"""The collectives of an XLA HLO module, read from its text, named by our mesh axes.

Each collective instruction (``all-reduce``, ``all-gather``, ``reduce-scatter``,
``all-to-all``, ``collective-permute``, and their ``-start`` halves; the ``-done`` halves are
skipped) becomes a :class:`HloCollective`: its kind, the mesh axes its device groups span, how
many tensors it moves and their bytes, counted as our SpmdProgram counts them (the full buffer:
an all-gather's output, the input of the others).

Device groups come in three spellings, all read here: explicit lists ``{{0,1},{2,3}}``, iota
lists ``[2,2]<=[2,2]T(1,0)`` (``iota(4).reshape(2,2).transpose(1,0).reshape(2,2)``) and the
Shardy mesh form ``mesh['a'=2,'b'=2] {'a'}`` (the devices that differ only along the listed
axes, sub-axes ``'a':(pre)size`` included). The ids are logical device ids, that is
positions in the jax mesh's device array, which :func:`partir_emu.interop.jax_mesh` lays out
row-major like ours, so a group is matched to the set of our mesh axes that produces exactly
those groups (:meth:`~partir_emu.core.mesh.Mesh.groups`). A group no axis set produces is
named ``?`` plus its size.

No jax here: the text is parsed in whichever process has it.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import asdict, dataclass

import numpy as np

from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram, collective_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
                    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_IOTA = re.compile(r"^\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(r"^mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}")


@dataclass(frozen=True)
class HloCollective:
    name: str            # the instruction's name in the HLO text
    kind: str            # one of KINDS
    axes: str            # our mesh axes, comma-joined in mesh order ("" for none, "?N" if no axis set fits)
    tensors: int         # arrays it moves (a combined tuple all-reduce moves several)
    bytes: int           # the full buffer, summed over its tensors (our SpmdProgram's convention)
    group_size: int

    def to_json(self) -> dict:
        return asdict(self)


def collectives(hlo_text: str, mesh: Mesh) -> list[HloCollective]:
    """Every collective instruction in ``hlo_text`` (an HLO module as printed by XLA)."""
    out = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        kind, attrs = m.group("op"), line[m.end():]
        arrays = [(dt, [int(x) for x in dims.split(",") if x]) for dt, dims in _ARRAY.findall(m.group("shape"))]
        if m.group("start") and kind != "collective-permute" and len(arrays) > 1:
            arrays = arrays[len(arrays) // 2:]      # an async start's shape is (operands, results)
        if kind == "collective-permute":
            axes, g = _permute_axes(attrs, mesh)
        else:
            groups = _replica_groups(attrs, mesh.size)
            axes, g = (_axes_of_groups(groups, mesh), len(groups[0])) if groups else ("?", 0)
        sizes = [_DTYPE_BYTES.get(dt, 4) * math.prod(dims) for dt, dims in arrays]
        if kind == "reduce-scatter":
            sizes = [s * g for s in sizes]            # the input: the group's blocks
        tensors = 1 if kind == "all-to-all" else len(sizes)   # a tuple all-to-all is one exchange, one operand a peer
        out.append(HloCollective(m.group("name"), kind, axes, tensors, sum(sizes), g))
    return out


def spmd_collectives(spmd: SpmdProgram) -> list[HloCollective]:
    """Our program's communicating collectives as the same records (``all_gather`` ->
    ``all-gather``; axes in mesh order), so the two sides count alike."""
    mesh = spmd.mesh
    out = []
    for k, e in enumerate(spmd.collectives()):
        axes = [a for a in mesh.axis_names if a in e.params.get("axes", ())]
        out.append(HloCollective(f"{e.prim}.{k}", e.prim.replace("_", "-"), ",".join(axes), 1, collective_bytes(e),
                                 mesh.group_size(axes)))
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _replica_groups(attrs: str, ndev: int) -> list[list[int]] | None:
    """The device groups of ``replica_groups=...`` in any of its spellings (None if absent)."""
    m = re.search(r"replica_groups=", attrs)
    if m is None:
        return None
    text = attrs[m.end():]
    if text.startswith("{}"):
        return [list(range(ndev))]                   # empty: every device in one group
    if text.startswith("{"):
        body = text[1:text.index("}}") + 1] if "}}" in text else ""
        return [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", body)]
    if (mi := _IOTA.match(text)) is not None:
        shape, dims = _ints(mi.group(1)), _ints(mi.group(2))
        perm = _ints(mi.group(3)) if mi.group(3) else list(range(len(dims)))
        return np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(shape).tolist()
    if (mm := _MESH.match(text)) is not None:
        return _mesh_groups(mm.group(1), mm.group(2), mm.group(3))
    return None


def _mesh_groups(axes_text: str, device_ids: str | None, group_axes: str) -> list[list[int]] | None:
    """Shardy's ``mesh[...] {axes}``: split every (sub-)axis into its digits, then group the
    devices that differ only in the listed ones, ordered by them major→minor."""
    names, sizes = [], []
    for item in filter(None, (s.strip() for s in axes_text.split(","))):
        n, _, s = item.rpartition("=")
        names.append(n.strip().strip("'\""))
        sizes.append(int(s))
    devices = np.arange(math.prod(sizes)) if not device_ids else np.asarray(_device_ids(device_ids.strip()))
    # digits: each axis n of size s as (pre, size, s // (pre * size)) for its sub-axes; full axes are one digit
    parts: list[tuple[int, int, int]] = []            # (axis index, pre, size) of each listed group axis
    for item in filter(None, (s.strip() for s in group_axes.split(","))):
        sm = re.match(r"^'?([^':]+)'?(?::\((\d+)\)(\d+))?$", item)
        if sm is None or sm.group(1) not in names:
            return None
        k = names.index(sm.group(1))
        parts.append((k, int(sm.group(2) or 1), int(sm.group(3) or sizes[k])))
    coords = np.stack(np.unravel_index(np.arange(devices.size), sizes), axis=1)   # position -> axis coords
    key_in, key_out = [], []
    for c in coords:
        inside = []
        rest = list(c)
        for k, pre, size in parts:
            minor = sizes[k] // (pre * size)
            inside.append((c[k] // minor) % size)
            rest[k] = rest[k] - ((c[k] // minor) % size) * minor
        key_in.append(tuple(inside))
        key_out.append(tuple(rest))
    groups: dict[tuple, list[tuple[tuple, int]]] = {}
    for pos in range(devices.size):
        groups.setdefault(key_out[pos], []).append((key_in[pos], int(devices[pos])))
    return [[d for _, d in sorted(g)] for _, g in sorted(groups.items())]


def _device_ids(text: str) -> list[int]:
    """A mesh's ``device_ids``, flat: an iota ``[4]<=[2,2]T(1,0)`` or ``[2,2]T(1,0)`` (iota over
    the dims, transposed), or a plain list ``0,2,1,3``."""
    mi = re.match(r"^\[([0-9,]+)\](?:<=\[([0-9,]+)\])?(?:T\(([0-9,]+)\))?$", text)
    if mi is None:
        return _ints(text.strip("[]{}"))
    dims = _ints(mi.group(2) or mi.group(1))
    perm = _ints(mi.group(3)) if mi.group(3) else list(range(len(dims)))
    return np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(-1).tolist()


def _axes_of_groups(groups: list[list[int]], mesh: Mesh) -> str:
    want = {frozenset(g) for g in groups}
    for r in range(len(mesh.axis_names) + 1):
        for axes in itertools.combinations(mesh.axis_names, r):
            if {frozenset(g) for g in mesh.groups(axes)} == want:
                return ",".join(axes)
    return f"?{len(groups[0])}"


def _permute_axes(attrs: str, mesh: Mesh) -> tuple[str, int]:
    """The axes along which a collective-permute's pairs move data (a pair to itself moves none)."""
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    pairs = [tuple(_ints(p)) for p in re.findall(r"\{([0-9,]+)\}", m.group(1) + "}")] if m else []
    moved = set()
    for src, dst in (p for p in pairs if len(p) == 2 and p[0] != p[1]):
        if max(src, dst) >= mesh.size:
            return "?", 0
        a, b = mesh.coords(src), mesh.coords(dst)
        moved |= {n for n in mesh.axis_names if a[n] != b[n]}
    axes = [n for n in mesh.axis_names if n in moved]
    return ",".join(axes), mesh.group_size(axes)
