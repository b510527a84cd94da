"""Stop signals (SIGINT, SIGTERM, SIGHUP) as one exception, and the one line that reports them.

A process that must clean up when the user stops it — the launcher of an MPI run, which owns
mpiexec, the ranks, their ``/dev/shm`` segments and a temp dir — runs under
:func:`signals_raise`: each stop signal raises :class:`Interrupted` (a ``KeyboardInterrupt``,
so every ``except BaseException``/``finally`` on the way unwinds as for Ctrl-C). Whoever
cleans up records what it stopped and removed on the exception (:func:`note`); the CLI prints
:func:`describe` as one line and exits with :func:`exit_status` (128 + signal number, the
shell's convention: 130 for Ctrl-C). :func:`signals_deferred` shields a cleanup from a second
signal.

Only the standard library: both the launcher and an MPI rank import this.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# A stop signal the parent made us ignore stays ignored, as Python itself does for SIGINT: under
# ``nohup`` SIGHUP is SIG_IGN, and a background job of a script (``cmd &``) ignores SIGINT. (The
# console script leaves these ignored too, :mod:`partir_emu.app.cli.entry`, so at import they still are.)
IGNORED_AT_START: frozenset[int] = frozenset(int(s) for s in STOP_SIGNALS if signal.getsignal(s) == signal.SIG_IGN)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived; ``stopped``/``removed`` say what the cleanup on the way did."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def signum_of(exc: BaseException) -> int:
    """The signal behind ``exc`` (a plain KeyboardInterrupt is Python's SIGINT)."""
    return getattr(exc, "signum", int(signal.SIGINT))


def note(exc: BaseException, *, stopped: str | None = None, removed: str | None = None) -> None:
    """Record on ``exc`` what a cleanup stopped (processes) and removed (files)."""
    for key, what in (("stopped", stopped), ("removed", removed)):
        if what:
            items = getattr(exc, f"partir_{key}", [])
            setattr(exc, f"partir_{key}", [*items, what])


def describe(exc: BaseException) -> str:
    """``'stopped by SIGTERM: stopped the MPI job (4 ranks); removed 1 /dev/shm segment, its temp dir'``."""
    line = f"stopped by {signal.Signals(signum_of(exc)).name}"
    stopped, removed = getattr(exc, "partir_stopped", []), getattr(exc, "partir_removed", [])
    if stopped:
        line += f": stopped {', '.join(stopped)}"
    if removed:
        line += f"; removed {', '.join(removed)}"
    return line


def exit_status(exc: BaseException) -> int:
    """128 + the signal number (130 for Ctrl-C), as a shell reports a process killed by it."""
    return 128 + signum_of(exc)


def leave_now(status: int) -> NoReturn:
    """Exit at once with ``status``, skipping the interpreter's finalization: an interrupt that
    lands inside a jax computation leaves XLA threads behind that crash it (SIGSEGV at exit
    seen after SIGTERM during ``jax.jit``). Call it only once every cleanup has run."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def install(handler: Callable[[int, Any], None] | signal.Handlers) -> dict[int, Any]:
    """Set ``handler`` for every stop signal not ignored since the start (main thread only); the
    previous handlers."""
    if not _in_main_thread():
        return {}
    return {int(s): signal.signal(s, handler) for s in STOP_SIGNALS if int(s) not in IGNORED_AT_START}


def restore(previous: dict[int, Any]) -> None:
    for s, h in previous.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)


def _raise(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


def _redeliver_swallowed(previous_hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """An ``sys.unraisablehook`` that sends a stop signal again when its :class:`Interrupted` was
    raised where Python can only print and drop it (a gc callback, a ``__del__``: jax's
    ``_xla_gc_callback`` swallowed Ctrl-C and the command went on to exit 0). The signal comes back
    from a timer thread a moment later, so the main thread takes it outside that callback."""

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, Interrupted):
            timer = threading.Timer(0.02, os.kill, (os.getpid(), exc.signum))
            timer.daemon = True
            timer.start()
            return
        previous_hook(unraisable)

    return hook


_raising = 0          # signals_raise regions entered by the main thread


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Inside: SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted`, and one that lands where
    Python would drop it is sent again (:func:`_redeliver_swallowed`): a stop is never swallowed."""
    global _raising
    previous = install(_raise)
    hook = sys.unraisablehook
    if previous:                                # (the main thread: handlers are installed)
        sys.unraisablehook = _redeliver_swallowed(hook)
        _raising += 1
    try:
        yield
    finally:
        if previous:
            _raising -= 1
        sys.unraisablehook = hook
        restore(previous)


T = TypeVar("T")


def responsive(fn: Callable[[], T]) -> T:
    """``fn()`` in a helper thread while the main thread waits in Python, inside
    :func:`signals_raise`: a signal handler runs only between the main thread's bytecodes, so a stop
    during a long C call (jax's import, tracing, an XLA compile: 1.5-2 s seen under load) would
    otherwise wait for the call to end. If interrupted, the helper is abandoned (the CLI then leaves
    without finalization, :func:`leave_now`). Elsewhere (a library caller, a helper thread already)
    it is a plain call."""
    if not _raising or not _in_main_thread():
        return fn()
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:      # handed to the caller
            box["error"] = exc

    helper = threading.Thread(target=call, name="partir-emu-jax", daemon=True)
    helper.start()
    while helper.is_alive():
        helper.join(0.05)
    if "error" in box:
        raise box["error"]
    return box["value"]


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Inside: stop signals are ignored (a second Ctrl-C must not cut a cleanup short)."""
    previous = install(signal.SIG_IGN)
    try:
        yield
    finally:
        restore(previous)
