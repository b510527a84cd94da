"""The ``partir-emu`` console script: it takes the stop signals before anything heavy is imported.

Importing the command line (numpy, the compiler, the hardware models) takes about two seconds;
a Ctrl-C in that window used to end in a Python traceback. Here SIGINT, SIGTERM and SIGHUP are
taken first, with only the standard library loaded: until :func:`partir_emu.app.cli.main.main`
installs its own handlers nothing has been written or started, so a stop is one line and exit
128 + N at once. (The interpreter's own start, before this module runs, keeps Python's defaults.)
A signal that is ignored as the process starts (SIGHUP under ``nohup``, SIGINT in a script's
background job) is left ignored, here and later: the parent asked for that. Under a user's
``mpirun`` the BLAS thread variables were defaulted already, before numpy is loaded, when this
module's package was imported (:func:`partir_emu.mpi.environ.set_blas_threads`).
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any


def _stopped_while_starting(signum: int, frame: Any) -> None:
    os.write(2, f"partir-emu: stopped by {signal.Signals(signum).name} while starting\n".encode())
    os._exit(128 + signum)


def main() -> int:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) != signal.SIG_IGN:
            signal.signal(s, _stopped_while_starting)
    from partir_emu.app.cli.main import main as run  # here, not at the top: the handlers above come first
    return run()


if __name__ == "__main__":
    sys.exit(main())
