"""The files a command writes, checked before any work: an output never destroys an input.

Every file the command line writes (``--report``, ``--plot``, ``--output``, ``--hlo``,
``--trace-messages``, ``simulate-des --trace``, ``check --junit``, ``study --csv``) is named in :data:`OUTPUTS`.
Before a command runs, :func:`check_outputs` refuses (a :class:`~partir_emu.errors.UsageError`: exit 2, one line):

- an output that is, after following symlinks, the same file as any file the same command reads
  (every other argument that names an existing file: ``--hardware my.toml``, ``--cases``,
  ``--inputs``, ``replay``'s trace, ...) — writing it would replace the user's input;
- an output that exists and is not a regular file: a device (``/dev/null``, ``/dev/full``), a FIFO,
  a socket. The atomic writer renames a finished temp file over its target, which would replace the
  device node itself (as root), so such paths are refused rather than written "in place"; to write
  nothing, leave the flag out;
- two outputs that are the same file.

A symlink is followed: the writer (:func:`partir_emu.app.atomic.atomic_path`) writes the link's
target atomically and the link stays a link.
"""
from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Iterator

from partir_emu.errors import UsageError

OUTPUTS = ("report", "plot", "output", "hlo", "trace_messages", "trace", "junit", "csv")
READS_TRACE = ("replay",)          # commands whose ``trace`` is an input, not an output


def _flag(dest: str, cmd: str | None) -> str:
    return dest if cmd in READS_TRACE and dest == "trace" else "--" + dest.replace("_", "-")


def _outputs(args: argparse.Namespace) -> dict[str, str]:
    cmd = getattr(args, "cmd", None)
    return {d: v for d in OUTPUTS if isinstance(v := getattr(args, d, None), str) and v
            and not (d == "trace" and cmd in READS_TRACE)}


def _inputs(args: argparse.Namespace, outputs: dict[str, str]) -> Iterator[tuple[str, str]]:
    """(flag, path) of every other argument naming an existing file (an input of the command)."""
    cmd = getattr(args, "cmd", None)
    for dest, value in vars(args).items():
        if dest in outputs or not isinstance(value, str) or not value:
            continue
        try:
            if os.path.isfile(value):
                yield _flag(dest, cmd), value
        except (OSError, ValueError):          # a value no path can be (embedded NUL, too long)
            continue


def check_output_target(path: str, flag: str) -> None:
    """``path``, after following symlinks, is a regular file or does not exist yet."""
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return                  # not there yet (or a parent is no directory: the command's own check says so)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot be checked ({exc.strerror}); choose another path") from None
    if stat.S_ISREG(mode):
        return
    kind = ("a directory" if stat.S_ISDIR(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    via = f" ({real})" if real != os.path.abspath(path) else ""
    raise UsageError(f"{flag} {path}{via}: is {kind}, and outputs are written to regular files (atomically, by "
                     f"renaming over them); give a file path, or leave {flag} out to write nothing")


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse outputs that would replace an input, a device or another output (module docstring)."""
    cmd = getattr(args, "cmd", None)
    outs = _outputs(args)
    ins = list(_inputs(args, outs))
    seen: dict[str, str] = {}
    for dest, path in outs.items():
        flag = _flag(dest, cmd)
        check_output_target(path, flag)
        real = os.path.realpath(path)
        for in_flag, in_path in ins:
            if os.path.exists(real) and os.path.samefile(real, in_path):
                raise UsageError(f"{flag} {path}: is the file {in_flag} {in_path} that this command reads; "
                                 f"writing {flag} would replace it: give another path")
        if real in seen:
            raise UsageError(f"{flag} {path} and {seen[real]} name the same file; give each output its own path")
        seen[real] = f"{flag} {path}"


__all__ = ["OUTPUTS", "check_output_target", "check_outputs"]
