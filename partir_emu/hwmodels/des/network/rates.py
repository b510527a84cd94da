"""Max-min fair rates of a set of flows, and the per-batch statistics the DES reports.

The flow network (:mod:`.network`) keeps its flows in *batches* (one step of one collective), each
either single flows of a :class:`~.routing.RoutePattern` or classes of its flows
(:class:`~.routing.FlowClasses`, with multiplicities). :func:`flow_matrix` lays the flows of some
batches out as one padded link matrix, :func:`max_min_rates` fills it progressively and
:func:`solve` returns one rate per entry (a flow, or a class whose flows must share one rate) and
per batch the most crowded of its links.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from partir_emu.hwmodels.des.network.routing import FlowClasses, RoutePattern

SAME_INSTANT = 1e-12
"""Relative: two times this close are one instant (far below the network's 1 ns resolution); a flow
due this close to now is due now."""

Part = tuple[RoutePattern, "FlowClasses | None", np.ndarray]
"""A batch's entries in flight: its route, its flow classes (or ``None``: single flows) and entry ids."""


def max_min_rates(links: np.ndarray, cap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Max-min fair rates of flows ``links[f]`` (padded link ids, ``-1`` = none) on links of capacity ``cap``.

    Returns ``(rates, flows per link)``. Progressive filling: each round fixes every flow that
    crosses a link whose fair share is the smallest of the round."""
    nf = len(links)
    nl = len(cap)
    rates = np.zeros(nf)
    flat = links.ravel()
    valid = flat >= 0
    counts = np.bincount(flat[valid], minlength=nl)
    cnt = counts.astype(np.float64)
    capr = cap.astype(np.float64).copy()
    share = np.empty(nl + 1)
    share[nl] = np.inf                        # the padding index -1 reads this
    active = np.arange(nf)
    act_links = links
    while active.size:
        with np.errstate(divide="ignore", invalid="ignore"):
            np.divide(capr, cnt, out=share[:nl])
        share[:nl][cnt <= 0] = np.inf
        fs = share[act_links].min(axis=1)
        m = fs.min()
        if not np.isfinite(m):                # flows without links (cannot happen for routed flows)
            rates[active] = np.inf
            break
        fix = fs <= m * (1.0 + 1e-12)
        rates[active[fix]] = m
        fl = act_links[fix].ravel()
        dec = np.bincount(fl[fl >= 0], minlength=nl)
        capr -= dec * m
        np.maximum(capr, 0.0, out=capr)
        cnt -= dec
        keep = ~fix
        active = active[keep]
        act_links = act_links[keep]
    return rates, counts


def flow_matrix(parts: Sequence[Part]) -> tuple[np.ndarray, np.ndarray]:
    """Every flow of ``parts`` as a padded link matrix (entry after entry), and the flows per entry."""
    mats, mults = [], []
    for route, classes, ids in parts:
        if classes is None:
            mats.append(route.links[ids])
            mults.append(np.ones(len(ids), dtype=np.int64))
        else:
            flows, mult = classes.expand(ids)
            mats.append(route.links[flows])
            mults.append(mult)
    h = max(x.shape[1] for x in mats)
    mats = [x if x.shape[1] == h else np.pad(x, ((0, 0), (0, h - x.shape[1])), constant_values=-1) for x in mats]
    return np.concatenate(mats), np.concatenate(mults)


def entry_links(route: RoutePattern, classes: FlowClasses | None, ids: np.ndarray) -> np.ndarray:
    """The distinct links the entries ``ids`` of a batch use."""
    links = route.links[ids if classes is None else classes.expand(ids)[0]]
    return np.unique(links[links >= 0])


Solution = tuple[np.ndarray, list[tuple[int, int, int]]]
"""Per entry its rate; per batch (most flows of anyone on one of its links, that link, its own most)."""


def solve(parts: Sequence[Part], cap: np.ndarray) -> tuple[Solution, np.ndarray, np.ndarray]:
    """Rates of the entries of ``parts`` on links of capacity ``cap``: ``(solution, entries whose flows
    got different rates (bool), flows per link)``. A solution with such entries is not valid for them."""
    links, mult = flow_matrix(parts)
    rates, counts = max_min_rates(links, cap)
    starts = np.concatenate(([0], np.cumsum(mult)[:-1]))
    lo = np.minimum.reduceat(rates, starts)
    bad = np.maximum.reduceat(rates, starts) != lo
    # per batch: the most flows (of anyone) on one of its links, which link, and its own most
    ns = [len(ids) for _r, _c, ids in parts]
    sizes = np.add.reduceat(mult, np.concatenate(([0], np.cumsum(ns)[:-1])))
    fstarts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    ext = np.append(counts, -1)
    per = ext[links]
    j = per.argmax(axis=1)
    fmax = per[np.arange(len(per)), j]
    flink = links[np.arange(len(per)), j]
    bmax = np.maximum.reduceat(fmax, fstarts)
    stats = []
    for k, (a, n) in enumerate(zip(fstarts.tolist(), sizes.tolist())):     # few batches
        seg = links[a:a + n]
        stats.append((int(bmax[k]), int(flink[a + int(np.argmax(fmax[a:a + n] == bmax[k]))]),
                      int(np.bincount(seg[seg >= 0]).max())))
    return (lo, stats), bad, counts
