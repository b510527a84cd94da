"""Everything that touches MPI: the launcher and its supervision (:mod:`.launch`, :mod:`.supervise`,
:mod:`.sentinel`, :mod:`.deaths`, :mod:`.failure_report`, :mod:`.interrupts`), the job files that
cross into the ranks (:mod:`.jobs`), what runs inside a rank (:mod:`.ranks`), and the user's own script under
``mpiexec`` (:mod:`.session`)::

    import partir_emu.mpi as pmpi        # no jax, and MPI starts only when a session name is used
    if pmpi.is_root(): ...
    else: pmpi.serve()

The driver-side modules import neither mpi4py nor jax, so importing this package does not
initialise MPI: the session's names load :mod:`.session` (and mpi4py) on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

_SESSION = ("is_root", "rank", "size", "run", "serve", "finish", "DEFAULT_TIMEOUT_S")
__all__ = list(_SESSION)


def __getattr__(name: str) -> Any:
    if name in _SESSION:
        return getattr(importlib.import_module("partir_emu.mpi.session"), name)
    raise AttributeError(f"module 'partir_emu.mpi' has no attribute {name!r}")
