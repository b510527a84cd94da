"""The report of unsupported primitives: every one in the traced function at once, each with a
count and the user's own line, and advice that can be followed.

The user's line of an equation is the innermost frame of its traceback outside jax, the Python
standard library (jax's own filter, ``source_info_util.user_frames``) and the model libraries
built on jax (flax, optax, equinox, and the packages they use to build modules), so a
primitive emitted inside ``flax/core/axes_scan.py`` points at the user's ``nn.scan`` call.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jax._src import source_info_util

from partir_emu.errors import UnsupportedPrimitiveError

# Libraries whose frames are never the user's (when they are imported at all).
LIBRARIES = ("flax", "optax", "equinox", "jaxtyping", "chex", "haiku", "transformers", "penzai", "keras", "keras_hub",
             "levanter", "haliax", "praxis")
_LOOPS = {"while"}    # scan is a loop equation and cond a select (compiler.trace_loops)
_FRAMES_SHOWN = 3


def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in LIBRARIES:
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None)
        if path:
            dirs.append(os.path.dirname(path) + os.sep)
    return tuple(dirs)


def user_frame(source_infos: Sequence[Any]) -> str:
    """``file:line (function)`` of the innermost frame outside jax and the model libraries, or "".

    ``source_infos``: the equation's own, then those of the calls it is nested in, innermost
    first (the traceback of an equation in a nested jaxpr stops at the start of its call)."""
    libs = _library_dirs()
    try:
        for info in source_infos:
            for f in source_info_util.user_frames(info.traceback):
                if not f.file_name.startswith(libs):
                    return f"{f.file_name}:{f.start_line} ({f.function_name})"
    except Exception:   # source info is best-effort only: a missing frame must not hide the report
        pass
    return ""


def advice(name: str) -> str:
    base = name.split(" ", 1)[0]
    if base in _LOOPS:
        return ("a `while` loop whose trip count is known only at run time is not supported yet: give "
                "`fori_loop` bounds known when the function is traced (constants: it becomes a loop, which "
                "is supported; `lax.scan` too), or unroll the loop in Python (a `for` loop over the iterations)")
    if "PRNG key implementation" in name:
        return "use jax's default PRNG implementation, threefry2x32 (no `impl=` argument to jax.random.key)"
    if "on a PRNG key array" in name:
        return ("apply it to the key data instead (jax.random.key_data, then jax.random.wrap_key_data), "
                "or use uint32 keys (jax.random.PRNGKey)")
    return ("rewrite that line with supported jax.numpy/lax operations, or add a registry entry for it "
            "(one `Primitive` with every facet in a module of partir_emu/primitives/; see "
            "partir_emu.core.registry; the supported ones: partir_emu.primitives.names(traceable=True))")


@dataclass
class UnsupportedReport:
    """Unsupported primitives found while tracing, in order of first appearance."""

    frames: dict[str, list[str]] = field(default_factory=dict)

    def add(self, name: str, source_infos: Sequence[Any], outer: str) -> None:
        """One equation of ``name``; ``source_infos`` as :func:`user_frame` takes them, ``outer`` the
        location to fall back on."""
        self.frames.setdefault(name, []).append(user_frame(source_infos) or outer or "an unknown location")

    def raise_if_any(self, fn_name: str) -> None:
        if not self.frames:
            return
        lines = [f"{len(self.frames)} unsupported primitive(s) in {fn_name!r}; partir_emu has no entry for:"]
        for name, where in self.frames.items():
            distinct = list(dict.fromkeys(where))
            shown = ", ".join(distinct[:_FRAMES_SHOWN])
            more = f" and {len(distinct) - _FRAMES_SHOWN} more places" if len(distinct) > _FRAMES_SHOWN else ""
            lines.append(f"  - primitive {name!r} at {shown}{more}: {len(where)} equation(s). {advice(name)}")
        raise UnsupportedPrimitiveError("\n".join(lines))
