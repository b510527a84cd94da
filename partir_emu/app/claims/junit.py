"""Claim outcomes as JUnit XML, the report format CI systems read (GitLab, Jenkins, GitHub actions
that annotate tests): one ``<testcase>`` per claim, a ``<failure>`` for a claim that does not hold,
an ``<error>`` for one that could not be evaluated. The schema is the one pytest's ``--junitxml``
writes (``testsuites > testsuite > testcase``), so the same CI configuration reads both.
"""
from __future__ import annotations

import os
import socket
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence

from partir_emu.app.atomic import write_text_atomic
from partir_emu.app.claims.claims_file import Outcome


def junit_xml(outcomes: Sequence[Outcome], suite: str, seconds: float) -> str:
    """The XML document (text) for ``outcomes`` of the claims file ``suite``."""
    fails = sum(o.status == "fail" for o in outcomes)
    errors = sum(o.status == "error" for o in outcomes)
    root = ET.Element("testsuites")
    ts = ET.SubElement(root, "testsuite", name=suite, tests=str(len(outcomes)), failures=str(fails),
                       errors=str(errors), skipped="0", time=f"{seconds:.3f}",
                       timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"), hostname=socket.gethostname())
    for o in outcomes:
        tc = ET.SubElement(ts, "testcase", classname=f"partir-emu check {suite}", name=o.claim.name,
                           time=f"{o.seconds:.3f}")
        if o.status != "pass":
            el = ET.SubElement(tc, "failure" if o.status == "fail" else "error",
                               message=o.message.splitlines()[0] if o.message else o.status)
            el.text = o.message
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(path: str | os.PathLike, outcomes: Sequence[Outcome], suite: str, seconds: float) -> None:
    write_text_atomic(path, junit_xml(outcomes, suite, seconds))


__all__ = ["junit_xml", "write_junit"]
