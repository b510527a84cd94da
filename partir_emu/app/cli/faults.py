"""Fault and stream options shared by ``simulate`` and ``simulate-des`` (and ``replay``'s link faults).

``--straggler DEV:FACTOR``, ``--degrade-link LINK:FACTOR``, ``--fail-link LINK`` and
``--comm-streams K`` mean the same in both hardware models (:mod:`partir_emu.hwmodels.machine.links`);
:func:`fault_kwargs` turns them into the keyword arguments both ``simulate`` and ``simulate_des``
take. A malformed value is refused before anything is lowered; a well-formed one that names no link
or device of the run is refused by the model (:class:`~partir_emu.hwmodels.machine.links.FaultError`).
"""
from __future__ import annotations

import argparse
import math
from typing import Any

from partir_emu.app import checks
from partir_emu.hwmodels.machine.links import FaultError


class FaultArgumentError(FaultError):
    """A malformed ``--straggler`` / ``--degrade-link`` command-line value."""


def add_link_fault_args(p: argparse.ArgumentParser) -> None:
    """``--degrade-link`` and ``--fail-link`` (repeatable)."""
    p.add_argument("--degrade-link", action="append", default=[], metavar="LINK:FACTOR",
                   help="run LINK (A->B one way, A-B both ways, #ID) at FACTOR of its bandwidth (repeatable)")
    p.add_argument("--fail-link", action="append", default=[], metavar="LINK",
                   help="LINK carries nothing; routes detour around it (repeatable)")


def add_fault_args(p: argparse.ArgumentParser, links: bool = True) -> None:
    """``--straggler``, ``--comm-streams`` and (with ``links``) the link faults."""
    p.add_argument("--comm-streams", type=checks.positive_int, default=1,
                   help="collectives a device runs at once with --overlap (default 1)")
    p.add_argument("--straggler", action="append", default=[], metavar="DEVICE:FACTOR",
                   help="device DEVICE computes FACTOR times slower (repeatable)")
    if links:
        add_link_fault_args(p)


def parse_pairs(items: list[str], what: str, key_int: bool) -> dict:
    """``["3:1.5", ...]`` -> ``{3: 1.5}`` (``key_int``) or ``["0->1:0.5"]`` -> ``{"0->1": 0.5}``; the
    factor must be a finite number (its range is the model's to check)."""
    out: dict = {}
    for item in items:
        k, sep, v = item.rpartition(":")
        try:
            if not sep or not math.isfinite(float(v)):
                raise ValueError
            out[int(k) if key_int else k] = float(v)
        except ValueError:
            raise FaultArgumentError(f"{what} {item!r}: write {'DEVICE' if key_int else 'LINK'}:FACTOR, "
                                     f"e.g. {'3:1.5' if key_int else '0->1:0.5'}") from None
    return out


def link_fault_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``degraded_links`` and ``failed_links`` from ``args`` (empty when the command has no such flags)."""
    return {"degraded_links": parse_pairs(getattr(args, "degrade_link", None) or [], "--degrade-link", False),
            "failed_links": tuple(getattr(args, "fail_link", None) or ())}


def fault_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``stragglers``, ``degraded_links``, ``failed_links`` and ``comm_streams`` from ``args``."""
    out = link_fault_kwargs(args)
    out["stragglers"] = parse_pairs(getattr(args, "straggler", None) or [], "--straggler", True)
    out["comm_streams"] = int(getattr(args, "comm_streams", 1) or 1)
    return out
