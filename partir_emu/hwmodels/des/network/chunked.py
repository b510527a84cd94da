"""The store-and-forward network: messages cut into chunks queue at each directed link.

Each directed link is a ``simpy.Resource`` of capacity 1 (FIFO). A message of
``n`` bytes is cut into chunks of ``chunk_bytes``; a chunk holds a link for
``size / bw``, then travels the link's latency, then queues at the next link.
The sender pushes its chunks back to back, so a message pipelines over its
route; concurrent messages interleave chunk by chunk at shared links (a
round-robin approximation of fair sharing).

Alone on a route of ``h`` hops a message takes ``L + n/B + (h-1)·c/B`` (the last
term is the pipeline fill): exact for neighbour messages, slower than the
closed form otherwise unless ``c`` is small — and events grow as ``n/c · h``.
It is here to measure the flow model against (``network="chunk"``); see
:mod:`.network` for the comparison and ``benchmarks/des_speed.py`` for numbers.
It records bytes per link but neither per-collective contention nor link
utilization counters in the trace (the flow model does).

Why flows and not store-and-forward chunks (this module, ``network="chunk"``):
a chunk model needs ``chunks × hops`` events per message and its uncontended
time is ``L + n/B + (hops-1)·chunk/B`` — off the closed form by the pipeline fill
unless chunks are small (and then slower still); the flow model is exact when
nothing contends and takes O(1) events per batch of messages. Measured
(``benchmarks/des_speed.py``) on a 64-chip step with 2-hop routes and shared
links: chunks of 64 KiB to 4 MiB agree with the flow model within 0.1 % and take
20x to 200x its wall time.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import simpy

from partir_emu.hwmodels.des.network.routing import FlowClasses, FlowRouter, RoutePattern
from partir_emu.hwmodels.des.protocols import ContentionSink, Delivered


class ChunkNetwork:
    """Store-and-forward chunks over FIFO links, driven by ``env``."""

    kind = "chunk"

    def __init__(self, env: simpy.Environment, router: FlowRouter, chunk_bytes: int = 1 << 20,
                 recorder: Any = None) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive number of bytes")
        self.env = env
        self.router = router
        self.chunk_bytes = int(chunk_bytes)
        self.cap = router.bw
        self.lat = router.latency
        self.link_bytes = np.zeros(router.num_links)
        self.link_max_flows = np.zeros(router.num_links, dtype=np.int64)
        self._res: dict[int, simpy.Resource] = {}
        self.flows = 0
        self.batches = 0
        self.solves = 0
        self.recomputes = 0
        self.chunks = 0

    def _link(self, lid: int) -> simpy.Resource:
        r = self._res.get(lid)
        if r is None:
            r = self._res[lid] = simpy.Resource(self.env, capacity=1)
        return r

    def send(self, route: RoutePattern, idx: np.ndarray | None, nbytes: np.ndarray, on_delivered: Delivered,
             owner: ContentionSink | None = None, classes: FlowClasses | None = None) -> None:
        if classes is not None:
            raise ValueError("the chunk network moves every message itself: send flows, not classes of flows")
        ids = np.arange(route.n) if idx is None else idx
        self.batches += 1
        for f, n in zip(ids.tolist(), np.asarray(nbytes).tolist()):
            links = [x for x in route.links[f].tolist() if x >= 0]
            for lid in links:
                self.link_bytes[lid] += n
            self.flows += 1
            self.env.process(self._message(links, float(n), f, on_delivered))

    def _message(self, links: list[int], nbytes: float, f: int, cb: Delivered):
        env = self.env
        first = self._link(links[0])
        bw0 = self.cap[links[0]]
        k = max(1, math.ceil(nbytes / self.chunk_bytes))
        last = None
        for i in range(k):
            size = min(self.chunk_bytes, nbytes - i * self.chunk_bytes)
            self.chunks += 1
            req = first.request()
            yield req
            yield env.timeout(size / bw0)
            first.release(req)
            last = env.process(self._onward(links, size))
        yield last
        cb(np.array([f]), env.now)

    def _onward(self, links: list[int], size: float):
        env = self.env
        yield env.timeout(self.lat[links[0]])
        for lid in links[1:]:
            res = self._link(lid)
            req = res.request()
            yield req
            yield env.timeout(size / self.cap[lid])
            res.release(req)
            yield env.timeout(self.lat[lid])
