"""The flow network the DES runs on: :class:`FlowNetwork`, the max-min fair fluid network of
:mod:`.flows` plus lock-step spans.

The links lock-step spans hold (:mod:`partir_emu.hwmodels.des.lockstep`): a span prices several
steps of one collective ahead, on links that no flow in flight and no other span uses; the ledger
keeps which span holds which link and whom to tell when a send needs one of them (the span's
owner then sends what is left of it as ordinary flows).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import simpy

from partir_emu.hwmodels.des.network.flows import FluidNetwork
from partir_emu.hwmodels.des.network.rates import Solution, entry_links, solve
from partir_emu.hwmodels.des.network.routing import FlowClasses, FlowRouter, RoutePattern

_CACHE_MAX = 1 << 15        # batches whose links are kept


class SpanLedger:
    """Per link the span holding it (-1: none), per span its links and its ``on_break``."""

    def __init__(self, num_links: int) -> None:
        self._reserved = np.full(num_links, -1, dtype=np.int64)
        self._mask = np.zeros(num_links, dtype=bool)
        self._spans: dict[int, tuple[np.ndarray, Callable[[float], None]]] = {}
        self._ids = 0
        self._links_cache: dict[tuple, np.ndarray] = {}
        self.taken = 0
        self.broken = 0

    @property
    def held(self) -> bool:
        """Whether any span holds links now."""
        return bool(self._spans)

    def links_of(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None) -> np.ndarray:
        """The distinct links of a batch (cached by its key)."""
        key = (route.id, -1 if classes is None else classes.id, None if idx is None else idx.tobytes())
        hit = self._links_cache.get(key)
        if hit is None:
            if len(self._links_cache) > _CACHE_MAX:
                self._links_cache.clear()
            ids = np.arange(route.n if classes is None else classes.n) if idx is None else idx
            hit = self._links_cache[key] = entry_links(route, classes, ids)
        return hit

    def _in(self, held: np.ndarray, links: np.ndarray) -> np.ndarray:
        """Which of ``links`` are among ``held`` (both distinct link ids; a scratch mask over the links)."""
        mask = self._mask
        mask[held] = True
        out = mask[links]
        mask[held] = False
        return out

    def free_steps(self, links: np.ndarray, first: np.ndarray, n: int,
                   in_flight: Iterable[tuple[RoutePattern, FlowClasses | None, np.ndarray | None]]) -> int:
        """Of ``n`` steps whose links are ``links``, link ``links[i]`` first used by step ``first[i]``: how
        many, from the first, use only links no flow of ``in_flight`` (batches as sent) and no span holds."""
        busy = self._reserved[links] >= 0
        for sent in in_flight:                  # (few: the batches in flight)
            busy |= self._in(self.links_of(*sent), links)
        return int(first[busy].min()) if busy.any() else n

    def reserve(self, links: np.ndarray, on_break: Callable[[float], None]) -> int:
        """Hold ``links`` for a span; a send that needs one of them first calls ``on_break(now)``.
        Returns the span's id."""
        sid = self._ids
        self._ids += 1
        self._reserved[links] = sid
        self._spans[sid] = (links, on_break)
        self.taken += 1
        return sid

    def release(self, sid: int) -> None:
        """The span ended as priced: its links are free."""
        links, _ = self._spans.pop(sid)
        self._reserved[links] = -1

    def break_spans(self, links: np.ndarray, now: float) -> None:
        """A send needs ``links``: every span holding one of them is released and told (``on_break(now)``)."""
        held = self._reserved[links]
        for sid in np.unique(held[held >= 0]).tolist():
            if sid in self._spans:            # (a span broken just now may have broken this one)
                _links, on_break = self._spans[sid]
                self.release(sid)
                self.broken += 1
                on_break(now)


class FlowNetwork(FluidNetwork):
    """The fluid network with lock-step spans (:class:`~partir_emu.hwmodels.des.protocols.SpanNetwork`):
    a span holds links (:class:`SpanLedger`), a send that needs one of them breaks it first."""

    def __init__(self, env: simpy.Environment, router: FlowRouter, recorder: Any = None,
                 resolution_s: float = 1e-9, eager: bool = False) -> None:
        super().__init__(env, router, recorder, resolution_s, eager)
        self.spans = self.eager                          # spans need the eager settling
        self.ledger = SpanLedger(router.num_links)
        self.span_plans: dict[tuple, Any] = {}          # .lockstep's, by (plans, members, step)

    def _before_send(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None) -> None:
        if self.ledger.held:
            self.ledger.break_spans(self.links_of(route, classes, idx), self.env.now)

    # -- lock-step spans: steps of a collective priced ahead on links nobody else uses -----------------
    def links_of(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None) -> np.ndarray:
        """The distinct links of a batch (cached by its key)."""
        return self.ledger.links_of(route, classes, idx)

    def free_steps(self, links: np.ndarray, first: np.ndarray, n: int) -> int:
        """Of ``n`` steps whose links are ``links``, link ``links[i]`` first used by step ``first[i]``: how
        many, from the first, use only links no flow in flight and no span holds."""
        return self.ledger.free_steps(links, first, n, [b.sent for b in self._batches])

    def alone(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None) -> Solution | None:
        """The rates of a batch on links nobody else uses (per entry, and its contention row), as
        :meth:`_settle` would find them for it alone; ``None`` if its classes' flows would not share
        one rate (then it must be sent)."""
        key = ((route.id, -1 if classes is None else classes.id, None if idx is None else idx.tobytes()),)
        hit = self._cache.get(key)
        if hit is None:
            ids = np.arange(route.n if classes is None else classes.n) if idx is None else idx
            self.solves += 1
            hit, bad, counts = solve([(route, classes, ids)], self.cap)
            if bad.any():
                return None
            np.maximum(self.link_max_flows, counts, out=self.link_max_flows)
            if len(self._cache) > _CACHE_MAX:
                self._cache.clear()
            self._cache[key] = hit
        return hit

    def reserve(self, links: np.ndarray, on_break: Callable[[float], None]) -> int:
        """Hold ``links`` for a span (:meth:`.spans.SpanLedger.reserve`); returns the span's id."""
        return self.ledger.reserve(links, on_break)

    def release(self, sid: int) -> None:
        """The span ended as priced: its links are free."""
        self.ledger.release(sid)

    @property
    def spans_taken(self) -> int:
        return self.ledger.taken

    @property
    def spans_broken(self) -> int:
        return self.ledger.broken

    def call_later(self, delay: float, fn: Callable[[float], None]) -> None:
        """Call ``fn(time)`` ``delay`` from now, as the network calls its delivery callbacks (then settle)."""
        self._later(lambda _ids, now: fn(now), None, delay)


__all__ = ["FlowNetwork", "SpanLedger"]
