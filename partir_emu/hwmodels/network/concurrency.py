"""Concurrent collectives sharing links: how much each one slows down while others are in flight.

With several communication streams (:mod:`.streams`) collectives overlap in time. Each is priced
standalone by :class:`~.comm.CommModel` (``T``); here its *link use* says what it needs from the
network, **phase by phase**: a phase is a run of consecutive steps of its schedule on the same
links (a ring: one phase; an H100 hierarchical all-reduce: NVLink, InfiniBand, NVLink; a
dimension-by-dimension torus all-reduce: one phase per dimension). Per phase, from every group's
messages on the model's routes (``CommModel.fabric``, detours around failed links included) and
effective bandwidths (``CommModel.link_bw``):

- ``share``: its fraction of ``T`` (steps priced as alpha–beta: the slowest route latency plus the
  busiest link's bytes over its bandwidth; ``T`` split in proportion);
- ``φ = T_bw / T_phase``: the part spent moving bytes (the rest is latency);
- ``util_l = bytes_l / (bw_l · T_bw)``: the fraction of link ``l`` it occupies while moving bytes,
  and ``flows_l``: how many of its flows (all groups) cross ``l`` in a step.

**Fluid model.** While a set ``S`` is in flight, each link is shared equally by the flows moving
bytes over it (as the DES's max-min network does, :mod:`.des.network`), so the byte-moving part of
``c``'s current phase is stretched by ``1 + max_l extra_c(l)`` over its links, where the expected
extra flows on ``l``, in units of ``c``'s own, are

- 1 per collective of ``S`` *in lock step* with ``c`` that uses ``l`` (the same collective, started
  at the same time: its steps move bytes exactly when ``c``'s do);
- ``util_c(l) · Σ_j φ_j · util_j(l) · flows_j(l) / flows_c(l)`` for the others ``j`` (independent:
  ``j`` moves bytes on ``l`` a fraction ``φ_j · util_j(l)`` of its time, ``c`` spends ``util_c(l)``
  of its byte moving on ``l``).

``c`` then goes through its standalone time at speed ``1 / ((1 - φ_c) + φ_c · stretch_c)``,
recomputed whenever a collective starts, changes phase or finishes (:mod:`.streams`). Collectives
on disjoint links run at full speed together; two equal all-reduces issued together on the same
links each take ``T_lat + 2·T_bw`` (as in the DES); a latency-bound collective next to a big one
barely slows it; a collective with 7 flows on a link takes 7/8 of it from one with 1 (max-min).

Why not the suggested share in proportion to bytes, or max-min rates on average demands
(``Σ_c r_c · φ_c · util_c(l) ≤ 1``): a byte-proportional share makes a small collective next to a
big one last as long as the big one, while the DES's equal per-flow share lets it finish in about
twice its standalone time; average demands miss that equal collectives issued together move bytes
at the same moments (two all-reduces with ``φ = ½`` would not slow at all, the DES gives them
1.5×); and without phases, two hierarchical all-reduces issued together (both on NVLink first)
were 9–11 % too fast.

:class:`Contention` holds the link uses of the distinct collectives of a program and returns, per
set in flight, the speeds (cached by the set; sets are small: at most ``comm_streams``).
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from partir_emu.hwmodels.network.comm import CommModel
from partir_emu.hwmodels.network.messages import Messages, schedule_messages

_EPS = 1e-12
_MAX_PHASES = 8               # more runs of distinct link sets than this: one phase, averaged over them
_BLOCK = 1 << 22              # elements per block of steps (bounds the temporary arrays)


@dataclass(frozen=True)
class Phase:
    """A run of consecutive steps of a collective that use the same links (module docstring)."""

    share: float                # fraction of the collective's standalone time
    links: np.ndarray           # link ids it moves bytes over (int64)
    util: np.ndarray            # per link: fraction of the link it occupies while moving bytes (≤ 1)
    flows: np.ndarray           # per link: its flows on the link in a step (every group; bytes-weighted mean)
    bw_frac: float              # φ = T_bw / T of the phase (0: latency-bound or no traffic)


@dataclass(frozen=True)
class LinkUse:
    """What one collective needs from the network, phase by phase."""

    phases: tuple[Phase, ...]


NO_TRAFFIC = LinkUse((Phase(1.0, np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0), 0.0),))

# per CommModel (prices are per placement, faults and algorithms: the model's): link use per collective key
_USES: weakref.WeakKeyDictionary[CommModel, dict[tuple, LinkUse]] = weakref.WeakKeyDictionary()


def link_use(model: CommModel, key: tuple) -> LinkUse:
    """The :class:`LinkUse` of the collective ``key`` = (kind, axes, nbytes, dtype, perm) on ``model``
    (computed once per model)."""
    table = _USES.get(model)
    if table is None:
        table = _USES[model] = {}
    hit = table.get(key)
    if hit is None:
        hit = table[key] = _link_use(model, *key)
    return hit


def _link_use(model: CommModel, kind: str, axes: tuple[str, ...], nbytes: int, dtype: str,
              perm: tuple | None) -> LinkUse:
    built = model.schedule(kind, axes, nbytes, dtype, perm)
    if built is None or model.cost(kind, axes, nbytes, dtype, perm).time_s <= 0.0:
        return NO_TRAFFIC
    choice, sched = built
    _, chips = model.fabric.groups(axes, choice.chips)
    acc = _Steps(model, schedule_messages(sched), chips)
    est = float(acc.lat.sum() + acc.bw.sum())
    if est <= 0.0:
        return NO_TRAFFIC
    bw_all = model.link_bw
    phases = []
    for i in range(acc.num_phases):
        t_lat, t_bw = float(acc.lat[acc.phase == i].sum()), float(acc.bw[acc.phase == i].sum())
        links = np.flatnonzero(acc.bytes[i])
        byts = acc.bytes[i][links]
        flows = np.maximum(acc.flows[i][links] / byts, 1.0)
        if t_bw <= _EPS * (t_lat + t_bw) or not len(links):
            phases.append(Phase((t_lat + t_bw) / est, links, np.zeros(len(links)), flows, 0.0))
            continue
        util = byts / (bw_all[links] * t_bw)
        util = util / max(1.0, float(util.max()))     # busier than full already in the standalone price
        phases.append(Phase((t_lat + t_bw) / est, links, util, flows, t_bw / (t_lat + t_bw)))
    return LinkUse(tuple(phases))


class _Steps:
    """Per step of a schedule run by every group ``chips``: its latency part (the largest summed link
    latency of a message's route in one group), its byte-moving part (the busiest link's bytes over its
    bandwidth), its phase; per phase, the bytes on each link and (bytes × flows) for the mean flows.
    Routes are the model's (detours around failed links included); steps with the same pairs share
    their routes (rings repeat one pattern every step)."""

    def __init__(self, model: CommModel, msgs: Messages, chips: np.ndarray) -> None:
        router = model.fabric.router
        bw = model.link_bw
        p, ptr = msgs.p, msgs.ptr
        S = msgs.num_steps
        self.lat, self.bw = np.zeros(S), np.zeros(S)
        patterns: dict[bytes, list[int]] = {}
        for s in np.flatnonzero(np.diff(ptr)).tolist():
            patterns.setdefault(msgs.pair[ptr[s]:ptr[s + 1]].tobytes(), []).append(s)
        built = []
        linkset = np.full(S, -1, dtype=np.int64)
        sets: dict[bytes, int] = {}
        for steps in patterns.values():
            lo = int(ptr[steps[0]])
            K = int(ptr[steps[0] + 1]) - lo
            pairs = msgs.pair[lo:lo + K]
            src, dst = chips[:, pairs // p], chips[:, pairs % p]          # [G, K]
            routes = router.routes(src.ravel(), dst.ravel())
            self.lat[steps] = max((float(router.latency[list(r)].sum()) for r in routes[:K]), default=0.0)
            links = np.fromiter((lk for r in routes for lk in r), dtype=np.int64)
            msg = np.repeat(np.arange(len(routes)) % K, [len(r) for r in routes])
            order = np.argsort(links, kind="stable")
            ul, starts, count = np.unique(links[order], return_index=True, return_counts=True)
            linkset[steps] = sets.setdefault(ul.tobytes(), len(sets))
            built.append((np.array(steps), K, msg[order], ul, starts, count))
        if S:                                     # a step without messages stays in its predecessor's phase
            linkset = linkset[np.maximum.accumulate(np.where(linkset >= 0, np.arange(S), 0))]
        runs = np.concatenate(([0], np.flatnonzero(np.diff(linkset)) + 1)) if S else np.zeros(0, np.int64)
        self.phase = np.zeros(S, dtype=np.int64)
        if 1 < len(runs) <= _MAX_PHASES:
            self.phase = np.repeat(np.arange(len(runs)), np.diff(np.append(runs, S)))
        self.num_phases = int(self.phase.max()) + 1 if S else 1
        L = router.num_links
        self.bytes = [np.zeros(L) for _ in range(self.num_phases)]
        self.flows = [np.zeros(L) for _ in range(self.num_phases)]
        for step_ix, K, msg, ul, starts, count in built:
            per = max(1, _BLOCK // max(1, len(msg)))
            for b0 in range(0, len(step_ix), per):
                ss = step_ix[b0:b0 + per]
                B = msgs.nbytes[ptr[ss][:, None] + np.arange(K)[None, :]]        # [S, K]
                on_link = np.add.reduceat(B[:, msg], starts, axis=1)            # [S, links of the pattern]
                self.bw[ss] = (on_link / bw[ul]).max(axis=1)
                for i in np.unique(self.phase[ss]).tolist():
                    tot = on_link[self.phase[ss] == i].sum(axis=0)
                    self.bytes[i][ul] += tot
                    self.flows[i][ul] += tot * count


class Contention:
    """Speeds of the collectives in flight (module docstring). ``uses``: per distinct collective (a
    program's ``comm_keys``), its link use; a set in flight is given as ``(index, phase, start)``
    triples (two of the same collective started at the same time run in lock step)."""

    def __init__(self, uses: Sequence[LinkUse]) -> None:
        self.uses = list(uses)
        self._memo: dict[tuple[tuple[int, int, int], ...], tuple[float, ...]] = {}

    @classmethod
    def of(cls, model: CommModel, keys: Sequence[tuple]) -> Contention:
        """The contention between the collectives ``keys`` (``ProgramCosts.comm_keys``) on ``model``."""
        return cls([link_use(model, k) for k in keys])

    def shares(self, index: int) -> list[float]:
        """The fractions of its standalone time collective ``index`` spends in each of its phases."""
        return [ph.share for ph in self.uses[index].phases]

    def speeds(self, active: Sequence[tuple[int, int, float]]) -> list[float]:
        """Per ``(index, phase, start)`` in flight, the speed at which it goes through its standalone
        time while exactly these are in flight."""
        if len(active) < 2:
            return [1.0] * len(active)
        starts = {t: i for i, t in enumerate(sorted({t for _, _, t in active}))}
        tagged = [(k, ph, starts[t]) for k, ph, t in active]
        srt = tuple(sorted(tagged))
        hit = self._memo.get(srt)
        if hit is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            hit = self._memo[srt] = self._speeds(srt)
        pos = {kt: i for i, kt in enumerate(srt)}     # equal entries have equal speeds
        return [hit[pos[kt]] for kt in tagged]

    def _speeds(self, active: tuple[tuple[int, int, int], ...]) -> tuple[float, ...]:
        uses = [self.uses[k].phases[ph] for k, ph, _ in active]
        n = len(uses)
        if not sum(len(u.links) for u in uses):
            return (1.0,) * n
        ids, inv = np.unique(np.concatenate([u.links for u in uses]), return_inverse=True)
        U = np.zeros((n, len(ids)))                        # U[i, l]: util of collective i on link l
        F = np.ones((n, len(ids)))                         # F[i, l]: its flows on l in a step
        rows = np.repeat(np.arange(n), [len(u.links) for u in uses])
        U[rows, inv.ravel()] = np.concatenate([u.util for u in uses])
        F[rows, inv.ravel()] = np.concatenate([u.flows for u in uses])
        phi = np.array([u.bw_frac for u in uses])
        tag = np.array(active)
        lock = (tag[:, None, :] == tag[None, :, :]).all(axis=2)
        np.fill_diagonal(lock, False)
        on = U > 0
        other = ~lock
        np.fill_diagonal(other, False)
        # extra flows (in units of i's own) on each of i's links while i moves bytes there: partners
        # in lock step always; the others a fraction φ_j · util_j(l) of the time, weighted by the
        # share of i's byte moving on l
        extra = lock.astype(np.float64) @ on + U * ((other * phi[None, :]) @ (U * F)) / F
        stretch = 1.0 + np.where(on, extra, 0.0).max(axis=1)
        return tuple((1.0 / ((1.0 - phi) + phi * stretch)).tolist())
