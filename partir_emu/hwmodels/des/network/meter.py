"""What the links of a DES run carried: bytes per link.

Bytes are summed per batch as sent (per flow, or per class of flows) and spread over the links of
their routes only when asked, so a send costs one array addition whatever its route's length.
"""
from __future__ import annotations

import numpy as np

from partir_emu.hwmodels.des.network.routing import FlowClasses, RoutePattern


class LinkBytes:
    """Bytes per link of everything sent (or accounted) so far."""

    def __init__(self, num_links: int) -> None:
        self._per_link = np.zeros(num_links)
        self._sent: dict[tuple[int, int], tuple[RoutePattern, FlowClasses | None, np.ndarray]] = {}

    def add(self, route: RoutePattern, classes: FlowClasses | None, idx: np.ndarray | None,
            nbytes: np.ndarray) -> None:
        """Entries ``idx`` of ``route`` (all when None; with ``classes``, classes of flows) carried ``nbytes``."""
        skey = (route.id, -1 if classes is None else classes.id)
        sent = self._sent.get(skey)
        if sent is None:
            sent = self._sent[skey] = (route, classes, np.zeros(route.n if classes is None else classes.n))
        if idx is None:
            sent[2][:] += nbytes
        else:
            sent[2][idx] += nbytes

    def per_link(self) -> np.ndarray:
        """Bytes each link carried so far."""
        nl = len(self._per_link)
        for route, classes, acc in self._sent.values():
            per_flow = acc if classes is None else np.repeat(acc, classes.mult)
            links = route.links if classes is None else route.links[classes.flows]
            ok = links >= 0
            self._per_link += np.bincount(links[ok], weights=np.repeat(per_flow, links.shape[1])[ok.ravel()],
                                          minlength=nl)
        self._sent.clear()
        return self._per_link


__all__ = ["LinkBytes"]
