"""The message of a failed MPI launch: which rank failed first, on which device, in which op.

Built from three sources, because none is complete on its own: mpiexec's output (the ranks'
``partir-emu rank R device D op K …`` lines and hydra's exit codes), the ranks' progress
records (:mod:`partir_emu.runtime.progress`; MPI_Abort can stop mpiexec before it forwarded a
rank's last words) and the exit times :class:`~partir_emu.mpi.deaths.DeathWatch` saw
(a rank killed or out of memory says nothing). On a timeout it also names the ranks still
computing before a collective that the others already wait in.
"""
from __future__ import annotations

import math
import re

from partir_emu.mpi.deaths import TIE_S, exit_statuses
from partir_emu.runtime.progress import device_str, op_position

RANK_PREFIX = "partir-emu rank"
WARNING_PREFIX = "partir-emu: warning"
# what ssh (hydra's default launcher) says of a host it cannot reach
_SSH_FAILED = re.compile(r"ssh: (?:connect to host (\S+) port \d+|Could not resolve hostname (\S+?)):? (.+)$", re.M)


def failure_message(text: str, rc: int | None, timed_out: bool, progress: list[dict],
                    silent: list[tuple[float, dict]], ranks: int, timeout_s: float, tie_s: float = TIE_S,
                    watched_here: bool = True) -> str:
    """``text``: mpiexec's output; ``silent``: ranks that exited without a word, by exit time;
    ``tie_s``: how close two exit times are to be told apart (the watch's resolution).
    ``watched_here=False``: the ranks were watched on their hosts (several hosts; the progress
    records are theirs, and the hosts' line is in ``text``), so no positions are read here."""
    if timed_out:
        lines = [f"the MPI run ({ranks} ranks) timed out after {timeout_s:g} s (--timeout) and was stopped"]
    else:
        lines = [f"the MPI run ({ranks} ranks) failed: mpiexec exit code {rc}"]
    said = [ln for ln in text.splitlines() if ln.startswith(RANK_PREFIX)]
    said += [ln for p in progress if p.get("phase") == "failed"
             for ln in str(p.get("error", "")).splitlines() if ln.startswith(RANK_PREFIX)]
    msgs = list(dict.fromkeys(said))
    first_failure = min((r.get("t", math.inf) for r in progress if r.get("phase") == "failed"), default=math.inf)
    silent = [(t, r) for t, r in silent if t < first_failure]   # died before anyone reported
    if silent and not timed_out:
        lines += silent_death_lines(silent, exit_statuses(text), tie_s)
    lines += msgs[:8] + ([f"... and {len(msgs) - 8} more rank messages"] if len(msgs) > 8 else [])
    lines += list(dict.fromkeys(ln for ln in text.splitlines() if ln.startswith(WARNING_PREFIX)))[:4]
    if watched_here and (not msgs or timed_out or any("timed out" in m for m in msgs)):
        lines += laggards(progress)
        lines.append("last positions: " + positions(progress, ranks))
    lines += unreachable_hosts(text)
    if not msgs and not silent:
        tail = "\n".join(ln for ln in text.splitlines() if ln.strip())[-1500:]
        if tail:
            lines.append("mpiexec output (tail):\n" + tail)
    return "\n".join(lines)


def unreachable_hosts(text: str) -> list[str]:
    """One line per host that hydra's launcher could not reach (ssh's words in mpiexec's output)."""
    out: dict[str, str] = {}
    for m in _SSH_FAILED.finditer(text):
        host = m.group(1) or m.group(2)
        out.setdefault(host, f"partir-emu: host {host} is unreachable ({m.group(3).strip()}): hydra's launcher "
                             f"could not start the job's proxy there; check that {host} is up and that "
                             f"`ssh {host}` works from this host, or leave it out of --hosts")
    return list(out.values())


def silent_death_lines(silent: list[tuple[float, dict]], status: dict[int, str] | None = None,
                       tie_s: float = TIE_S, on_host: bool = False) -> list[str]:
    """The first rank to exit without a word is the one that died; mpiexec stopped the others.
    ``status``: exit statuses by rank (None: unknown, e.g. to a watcher that is not the parent);
    ranks that exited within ``tie_s`` of the first are named together, as tied. ``on_host``:
    name each rank's host (a job of several hosts)."""
    t_first, _ = silent[0]
    same = [r for t, r in silent if t - t_first <= tie_s]
    if status:
        # exit times are stamped when a watcher thread wakes, which a loaded machine can delay by
        # more than the gap between a death and hydra's kill of the others: the statuses decide first
        same = _break_tie([r for _, r in silent], status) or same
    which = "it was the first rank to exit" if len(same) == 1 else "one of the first ranks to exit"

    def how(rank: int) -> str:
        return "" if status is None else f" ({status.get(rank, 'no exit status')})"
    return [f"{RANK_PREFIX} {r['rank']}{_on(r, on_host)} {where(r)}: died without a message{how(int(r['rank']))}; "
            f"{which}, mpiexec stopped the others" for r in same]


def _break_tie(ranks: list[dict], status: dict[int, str]) -> list[dict]:
    """The one rank that died, from hydra's exit statuses, if they tell: hydra SIGKILLs the
    survivors (status "killed by signal 9", or 0 when it reaped them first), so a rank that exited
    on its own with an error code is the one; failing that, the only one a signal killed; else
    nothing (the exit times decide)."""
    def code(r: dict) -> str:
        return status.get(int(r["rank"]), "")
    for pick in ([r for r in ranks if code(r).startswith("exit code") and code(r) != "exit code 0"],
                 [r for r in ranks if code(r).startswith("killed")]):
        if len(pick) == 1:
            return pick
    return []


def _on(p: dict, on_host: bool) -> str:
    return f" on {p['host']}" if on_host and p.get("host") else ""


def _op(p: dict) -> str:
    if "op" in p and p.get("phase") in ("step", "failed"):
        return f"{_pos(p)} ({p.get('prim')} at {p.get('source')}; {p.get('state')})"
    return f"op - ({p.get('phase')})"


def _pos(p: dict) -> str:
    """``'op 12'``, or inside a loop body ``'op 2 of the loop body at op 5, iteration 3'``."""
    try:
        return op_position(p["op"], p.get("loops") or ())
    except (TypeError, ValueError):       # a record written by something else: say what it holds
        return f"op {p['op']} (loops {p.get('loops')!r})"


def _order(p: dict) -> int:
    """How far a rank has got: its collective's number in the run (``seq``: one op runs once per
    iteration inside a loop), or the op index in records without one."""
    return int(p["seq"]) if isinstance(p.get("seq"), int) else int(p["op"])


def where(p: dict) -> str:
    """``'device 3 op 12 (all_reduce at mlp.py:103; moving data)'`` from a progress record."""
    devs = device_str(p["devices"]) + " " if p.get("devices") else ""
    return devs + _op(p)


def positions(progress: list[dict], ranks: int, on_host: bool = False) -> str:
    """Where every rank was last, ranks with the same position (and host, ``on_host``) grouped."""
    if not progress:
        return f"no rank reported progress (of {ranks}); MPI start-up failed or was too slow"
    groups: dict[str, list[int]] = {}
    for p in progress:
        groups.setdefault(_op(p) if not on_host else f"on {p.get('host')}: {_op(p)}", []).append(p["rank"])
    missing = ranks - len(progress)
    parts = [f"rank{'s' if len(r) > 1 else ''} {ranges(r)}{'' if on_host else ':'} {k}"
             for k, r in sorted(groups.items(), key=lambda kv: kv[1])]
    if missing > 0:
        parts.append(f"{missing} rank(s) never started")
    return "; ".join(parts)


def laggards(progress: list[dict], on_host: bool = False) -> list[str]:
    """On a timeout: the ranks still computing before a collective the others already wait in."""
    stepping = [p for p in progress if "op" in p and p.get("phase") in ("step", "failed")]
    waiting = [p for p in stepping if p.get("state") == "waiting for the other ranks"]
    if not waiting:
        return []
    lead = max(waiting, key=_order)
    front = _order(lead)
    behind = [p for p in stepping if _order(p) < front or (_order(p) == front and p.get("state") == "computing")]
    ahead = sorted(p["rank"] for p in waiting if _order(p) == front)
    return [f"{RANK_PREFIX} {p['rank']}{_on(p, on_host)} {where(p)}: behind the others (rank{'s' if len(ahead) > 1 else ''} "
            f"{ranges(ahead)} wait in {_pos(lead)}); it is stuck after this op" for p in behind[:8]]


def ranges(xs: list[int]) -> str:
    """``[0, 2, 3, 4]`` → ``'0,2-4'``."""
    xs = sorted(xs)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)
