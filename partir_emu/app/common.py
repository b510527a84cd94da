"""Command-line pieces shared by every ``partir-emu`` subcommand that names an experiment.

``add_experiment_args`` adds the scenario/strategy/mesh/size arguments (and ``--quiet``),
``experiment_from_args`` turns them into an :class:`~partir_emu.app.experiment.Experiment` (cheap:
nothing is traced until ``Experiment.lower``), and ``write_report`` writes a JSON report
atomically when a path was given.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from partir_emu.app.atomic import write_json_atomic
from partir_emu.app.checks import nonnegative_int, seed
from partir_emu.app.experiment import Experiment
from partir_emu.core.mesh import Mesh


def print_warnings(lines: Sequence[str]) -> None:
    """The lowering's warnings (e.g. a tactic whose own decisions conflict), one line each on stderr."""
    for w in lines:
        print(f"warning: {w}", file=sys.stderr)


def add_overlap_args(p: argparse.ArgumentParser) -> None:
    """``--overlap/--no-overlap`` (on by default: hardware runs collectives asynchronously) and
    ``--prefetch-bytes`` (the ZeRO-3 all-gather prefetch budget, see hwmodels.overlap)."""
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap compute and communication as the hardware does: asynchronous collectives, "
                        "ZeRO-3 gathers prefetched, gradient reductions hidden behind the backward pass "
                        "(default on; --no-overlap: every collective blocks, in program order)")
    p.add_argument("--prefetch-bytes", type=nonnegative_int, default=None, metavar="BYTES",
                   help="how many bytes of ZeRO-3 gathers may be in flight ahead of use (default: one layer's "
                        "parameters; 0: gather on demand)")


def add_experiment_args(p: argparse.ArgumentParser, mesh_default: str | None = "batch=2,model=2") -> None:
    p.add_argument("scenario", help="scenario name (see `partir-emu list`)")
    p.add_argument("--strategy", default="bp", help="strategy name, e.g. bp, mp, z3, bp+mp+z3")
    p.add_argument("--mesh", default=mesh_default, help="AXIS=N,... (default %(default)s)")
    p.add_argument("--size", default=None, help="size preset (tiny, small, ...; default: the scenario's)")
    p.add_argument("--set", dest="overrides", default=None,
                   help="size and option overrides, e.g. batch=16,hidden=64 or precision=bf16,mlp=swiglu "
                   "(`partir-emu list` names them)")
    p.add_argument("--seed", type=seed, default=0, help="random seed of the inputs, 0 <= SEED < 2**63")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr (shown on a terminal "
                   "once a command has taken 5 s)")


def experiment_from_args(args: argparse.Namespace) -> Experiment:
    return Experiment(args.scenario, args.strategy, Mesh.parse(args.mesh), args.size, args.overrides, args.seed,
                      getattr(args, "inputs", None), getattr(args, "strict", False))


def write_report(rep: dict, path: str | None) -> None:
    """Write ``rep`` as sorted, indented JSON to ``path`` atomically (nothing when ``path`` is empty)."""
    if path:
        write_json_atomic(path, rep)


__all__ = ["add_experiment_args", "experiment_from_args", "write_report"]
