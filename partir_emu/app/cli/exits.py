"""Exit statuses of ``partir-emu``, and the one-line reports of what went wrong.

=====  ===============================================================================
0      success; ``run``: the result verified
1      ``run``: ran but did not verify; ``validate``: thresholds not met;
       ``replay``: the trace does not match the schedules
2      bad input: a value, path, size or file the user gave (one line on stderr)
3      internal error: a bug in partir-emu (one line; ``PARTIR_EMU_DEBUG=1`` adds the traceback)
128+N  stopped by signal N (130: Ctrl-C, 143: SIGTERM)
=====  ===============================================================================

:class:`OneLineParser` makes argparse's own errors (unknown flag, ``--seed x``) one line too.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import NoReturn

OK, NOT_VERIFIED, BAD_INPUT, INTERNAL = 0, 1, 2, 3
DEBUG_ENV = "PARTIR_EMU_DEBUG"

EPILOG = f"""exit status:
  {OK}      success (run: the result verified against the jax.jit reference)
  {NOT_VERIFIED}      run: not verified; validate: thresholds not met; replay: trace does not match
  {BAD_INPUT}      bad input (a value, path, size or file you gave); one line on stderr says what to change
  {INTERNAL}      internal error (a bug): one line on stderr; {DEBUG_ENV}=1 prints the traceback
  128+N  stopped by signal N (130: Ctrl-C, 143: SIGTERM)"""


def one_line(text: object) -> str:
    """``text`` with its lines joined: every error report is exactly one line."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (``partir-emu run: error: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(BAD_INPUT, f"{self.prog}: error: {one_line(message)} (see `{self.prog} --help`)\n")


def report_internal_error(cmd: str, exc: BaseException) -> int:
    """Print one line for an unexpected exception (where it happened, how to report it); the
    traceback only when ``PARTIR_EMU_DEBUG=1``. Returns :data:`INTERNAL`."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno} in {tb[-1].name}" if tb else ""
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(one_line(f"partir-emu {cmd}: internal error: {type(exc).__name__}: {exc}{where}; this is a bug in "
                   f"partir-emu: please report it with the command line and the output of {DEBUG_ENV}=1 "
                   f"partir-emu ..."), file=sys.stderr)
    return INTERNAL


__all__ = ["BAD_INPUT", "DEBUG_ENV", "EPILOG", "INTERNAL", "NOT_VERIFIED", "OK", "OneLineParser", "one_line",
           "report_internal_error"]
