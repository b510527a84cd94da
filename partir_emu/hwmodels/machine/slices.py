"""The topology a spec gives for a number of chips (:func:`topology_for`): one torus slice, whole GPU
nodes, or several TPU slices joined by the data-centre network (DCN: multi-slice training, pods).

A :class:`SlicedTopology` is ``slices`` copies of one torus slice, physical dims ``(slice, x, y[, z])``.
Inside a slice the chips talk over ICI exactly as on :meth:`Topology.torus` (the same links, routes
and wraparound). Between slices every transfer goes chip → its host over PCIe → the host's NIC →
the DCN → the other host's NIC → PCIe → chip, so the ``chips_per_host`` chips of a host share its
NIC's bandwidth (spec ``[dcn]``, :class:`~partir_emu.hwmodels.machine.specs.DcnSpec`). The DCN itself is
taken as non-blocking: no published figure says how oversubscribed Google's fabric is between
slices, so only the host links are modelled. A host serves ``chips_per_host`` consecutive chips of
a slice in row-major order (a 1 x 8 run rather than the 4 x 2 block of a real v5e host: only the
number of chips that share the NIC enters the DCN price).

A mesh axis on the ``slice`` dim (``--mesh dcn=2,batch=256`` on ``--slice 2x16x16``) then runs its
collectives over DCN, the other axes over ICI; a reduction over both is priced as the algorithm
over the placed group (dimension by dimension, ICI and DCN alike), and a ZeRO gradient reduction is
the hierarchical form by construction: a reduce-scatter over the slice's ICI axis, then an
all-reduce of the shard across slices.

Link ids: slice ``s``'s ICI links are ``s * L + l`` (``l`` its id in the one-slice torus, ``L`` its
link count); then per chip its PCIe up and down links, then per host its NIC up and down links.
Routes are array operations as on a torus (:meth:`SlicedTopology.route_matrix`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from partir_emu.errors import PlacementError
from partir_emu.hwmodels.machine.specs import DcnSpec, GpuClusterSpec, HardwareSpec, TorusSpec
from partir_emu.hwmodels.machine.superpod import gpu_topology
from partir_emu.hwmodels.machine.topology import Link, Topology

DCN_SWITCH = "dcn"
SLICE_DIM = "slice"


class SlicedTopology(Topology):
    """``slices`` torus slices (``one``) joined by DCN. Build with :meth:`build`."""

    __slots__ = ("one", "slices", "chips_per_host", "dcn_overlaps_compute", "_pcie0", "_nic0")
    one: Topology                 # the torus of one slice
    slices: int
    chips_per_host: int
    dcn_overlaps_compute: bool    # spec [dcn] overlaps_compute
    _pcie0: int                   # id of the first PCIe link
    _nic0: int                    # id of the first NIC link

    @classmethod
    def build(cls, one: Topology, slices: int, dcn: DcnSpec, name: str = "") -> SlicedTopology:
        if one.kind != "torus":
            raise PlacementError(f"slices of {one.describe()}: only TPU torus slices are joined by DCN")
        if slices < 1:
            raise PlacementError(f"{slices} slices: give a positive number")
        n = one.num_chips
        if n % dcn.chips_per_host and n > dcn.chips_per_host:
            raise PlacementError(f"a slice of {n} chips is not whole hosts of {dcn.chips_per_host} chips "
                                 f"(spec [dcn] chips_per_host); use a slice of whole hosts")
        per_host = min(dcn.chips_per_host, n)
        links: list[Link] = []
        for s in range(slices):
            off = s * n
            for lk in one.links:
                links.append(Link(len(links), int(lk.src) + off, int(lk.dst) + off, lk.bw_bytes_per_s,
                                  lk.latency_s, lk.kind, f"slice{s} {lk.label}"))
        pcie0 = len(links)
        for chip in range(slices * n):
            host = f"host{chip // per_host}"
            links.append(Link(len(links), chip, host, dcn.pcie_bw_bytes_per_s, 0.0, "pcie", f"pcie chip{chip}->{host}"))
            links.append(Link(len(links), host, chip, dcn.pcie_bw_bytes_per_s, 0.0, "pcie", f"pcie {host}->chip{chip}"))
        nic0 = len(links)
        for h in range(slices * n // per_host):
            links.append(Link(len(links), f"host{h}", DCN_SWITCH, dcn.nic_bw_bytes_per_s, dcn.nic_latency_s, "dcn",
                              f"dcn host{h}->{DCN_SWITCH}"))
            links.append(Link(len(links), DCN_SWITCH, f"host{h}", dcn.nic_bw_bytes_per_s, dcn.nic_latency_s, "dcn",
                              f"dcn {DCN_SWITCH}->host{h}"))
        self = cls("slices", (slices, *one.dims), (SLICE_DIM, *one.dim_names), (False, *one.wrap), tuple(links), name)
        self.one, self.slices, self.chips_per_host = one, slices, per_host
        self.dcn_overlaps_compute = dcn.overlaps_compute
        self._pcie0, self._nic0 = pcie0, nic0
        return self

    def route_tuple(self, src: int, dst: int) -> tuple[Link, ...]:
        key = (src, dst)
        r = self._routes.get(key)
        if r is None:
            row = self.route_matrix([src], [dst])[0]
            r = self._routes[key] = tuple(self.links[i] for i in row.tolist() if i >= 0)
        return r

    def route_matrix(self, src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> np.ndarray:
        """Routes as on :meth:`Topology.route_matrix`: the slice's torus route inside a slice (its link
        ids moved to the slice's), and PCIe, NIC, NIC, PCIe across slices."""
        src, dst = self.chip_pairs(src, dst)
        n, per_link = self.one.num_chips, len(self.one.links)
        s_src, s_dst = src // n, dst // n
        same = np.flatnonzero(s_src == s_dst)
        cross = np.flatnonzero(s_src != s_dst)
        inside = self.one.route_matrix(src[same] % n, dst[same] % n) if same.size else np.zeros((0, 1), np.int64)
        width = max(inside.shape[1], 4 if cross.size else 1)
        out = np.full((len(src), width), -1, dtype=np.int64)
        if same.size:
            out[same, :inside.shape[1]] = np.where(inside >= 0, inside + (s_src[same] * per_link)[:, None], -1)
        if cross.size:
            a, b = src[cross], dst[cross]
            out[cross, 0] = self._pcie0 + 2 * a
            out[cross, 1] = self._nic0 + 2 * (a // self.chips_per_host)
            out[cross, 2] = self._nic0 + 2 * (b // self.chips_per_host) + 1
            out[cross, 3] = self._pcie0 + 2 * b + 1
        return out

    def describe(self) -> str:
        return (f"{self.name or 'tpu'} {self.slices} slice(s) of {self.one.describe().split(' ', 1)[1]} "
                f"joined by DCN ({self.num_chips} chips, {self.chips_per_host} per host)")

    __str__ = describe


def chips_limit(spec: HardwareSpec, slice_dims: Sequence[int] | None = None) -> int:
    """The most chips ``spec`` holds as asked: one pod (a GPU cluster's nodes), or ``S`` pods when
    ``slice_dims`` asks for ``S`` slices over DCN."""
    net = spec.network
    if isinstance(net, TorusSpec) and slice_dims is not None and len(slice_dims) == len(net.pod_dims) + 1:
        return net.pod_chips * int(slice_dims[0])
    return net.max_chips


def sliced(one: Topology, slices: int, dcn: DcnSpec | None, spec_name: str) -> Topology:
    """``one`` itself for one slice, else ``slices`` of it over ``dcn`` (an error if the spec has none)."""
    if slices == 1:
        return one
    if dcn is None:
        raise PlacementError(f"{slices} slices of {spec_name}: its spec has no [dcn] table to join slices by; "
                             f"add one (host_bw_bytes_per_s, latency_s, chips_per_host, pcie_bw_bytes_per_s, "
                             f"max_slices) or use one slice")
    if slices > dcn.max_slices:
        raise PlacementError(f"{slices} slices of {spec_name}: its spec allows at most {dcn.max_slices} "
                             f"(dcn.max_slices)")
    return SlicedTopology.build(one, slices, dcn, spec_name)


# -- building the topology a spec gives for a number of chips ------------------------------------------
def torus_wraparound(spec: TorusSpec, dims: tuple[int, ...]) -> tuple[bool, ...]:
    """Which dims of a slice of shape ``dims`` have wraparound links, per the spec's rule."""
    rule = spec.wraparound
    if rule == "always":
        return (True,) * len(dims)
    if rule == "never":
        return (False,) * len(dims)
    if rule == "full":
        return tuple(s == p for s, p in zip(dims, spec.pod_dims))
    assert rule == "cube_multiple" and spec.cube is not None
    whole_cubes = all(s % c == 0 for s, c in zip(dims, spec.cube))
    return (whole_cubes,) * len(dims)


def default_slice(spec: TorusSpec, num_chips: int) -> tuple[int, ...]:
    """The most balanced slice shape of ``num_chips`` that fits the pod (dims ascending); whole cubes
    (or full dims) are preferred when they exist, as the real slice shapes are."""
    nd = len(spec.pod_dims)
    best: tuple | None = None
    for combo in _factorizations(num_chips, nd):
        if any(s > p for s, p in zip(combo, sorted(spec.pod_dims))):
            continue
        dims = tuple(combo)
        wraps = sum(torus_wraparound(spec, dims))
        score = (max(dims), -wraps, -min(dims), dims)
        if best is None or score < best[0]:
            best = (score, dims)
    if best is None:
        more = (f", or several pods joined by DCN with a leading slice count (--slice 2x{'x'.join(map(str, spec.pod_dims))})"
                if spec.dcn is not None else "")
        raise PlacementError(f"{num_chips} chips do not fit a pod of {'x'.join(map(str, spec.pod_dims))}; "
                             f"use at most {spec.max_chips} devices, in a shape that fits the pod{more}")
    return best[1]


def _factorizations(n: int, k: int, least: int = 1) -> list[tuple[int, ...]]:
    """Every way to write ``n`` as a non-decreasing product of ``k`` factors ≥ ``least``
    (the smallest factor is at most n^(1/k), so this is fast even for absurd ``n``)."""
    if k == 1:
        return [(n,)] if n >= least else []
    out = []
    a = least
    while a ** k <= n:
        if n % a == 0:
            out += [(a,) + rest for rest in _factorizations(n // a, k - 1, a)]
        a += 1
    return out


def topology_for(spec: HardwareSpec, num_chips: int, dims: tuple[int, ...] | None = None,
                 wrap: tuple[bool, ...] | None = None) -> Topology:
    """The topology of ``num_chips`` chips of ``spec``: a torus slice (``dims`` or :func:`default_slice`,
    wraparound per the spec's rule unless ``wrap`` says otherwise) or whole GPU nodes (in scalable units
    when the spec's spine is oversubscribed, :mod:`.superpod`). A TPU ``dims``
    with one dim more than the pod, ``(S, *slice)``, is ``S`` slices joined by DCN (``--slice 2x16x16``);
    they are never assumed: more chips than a pod holds without it is an error."""
    net = spec.network
    if isinstance(net, GpuClusterSpec):
        if dims is not None and math.prod(dims) != num_chips:
            raise PlacementError(f"GPU dims {dims} hold {math.prod(dims)} GPUs, not {num_chips}")
        return gpu_topology(num_chips, net, spec.name)      # one spine, or scalable units (.superpod)
    slices = 1
    if dims is not None and len(dims) == len(net.pod_dims) + 1:
        slices, dims = int(dims[0]), tuple(dims[1:])
    if num_chips % slices:
        raise PlacementError(f"{num_chips} chips do not make {slices} equal slices; choose a mesh of "
                             f"{slices} x the slice's chips")
    per_slice = num_chips // slices
    if dims is None:
        dims = default_slice(net, per_slice)
    dims = tuple(dims)
    if len(dims) != len(net.pod_dims):
        raise PlacementError(f"slice {dims} of {spec.name} needs {len(net.pod_dims)} dims "
                             f"(pod {'x'.join(map(str, net.pod_dims))}), or one more in front for the "
                             f"number of slices joined by DCN")
    if math.prod(dims) != per_slice:
        raise PlacementError(f"slice {'x'.join(map(str, dims))} has {math.prod(dims)} chips, not {per_slice}; "
                             f"choose dims whose product is the mesh size" + (" / slices" if slices > 1 else ""))
    if any(s > p for s, p in zip(dims, net.pod_dims)):
        raise PlacementError(f"slice {'x'.join(map(str, dims))} does not fit the {spec.name} pod "
                             f"{'x'.join(map(str, net.pod_dims))}")
    one = Topology.torus(dims, wrap if wrap is not None else torus_wraparound(net, dims),
                         link_bw_bytes_per_s=net.link_bw_bytes_per_s, link_latency_s=net.link_latency_s,
                         name=spec.name)
    return sliced(one, slices, net.dcn, spec.name)


__all__ = ["DCN_SWITCH", "SLICE_DIM", "SlicedTopology", "chips_limit", "default_slice", "sliced", "topology_for", "torus_wraparound"]
