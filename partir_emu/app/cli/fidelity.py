"""``partir-emu fidelity``: the subcommand (the cases and their run: :mod:`.fidelity`; the
per-chip fit behind ``--fit``: :mod:`partir_emu.app.validation.calibrate`)."""
from __future__ import annotations

import argparse
import sys

from partir_emu.app import checks
from partir_emu.app.atomic import atomic_path
from partir_emu.app.cli.phases import Phases
from partir_emu.app.common import write_report
from partir_emu.app.validation.calibrate import calibrate
from partir_emu.app.validation.fidelity import explain, run_cases
from partir_emu.app.validation.fidelity_data import load_cases, select
from partir_emu.app.validation.holdout import fits_table, fitted_constants, holdout
from partir_emu.errors import UsageError


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fidelity", help="predicted vs published measured training runs (error per case)")
    p.add_argument("--case", dest="cases", nargs="+", default=None, metavar="NAME",
                   help="run these cases (any group) instead of a group")
    p.add_argument("--group", choices=("required", "extra", "all"), default=None,
                   help="which cases to run (default: required, the five of issue 10; with --holdout: all)")
    p.add_argument("--data", default=None, metavar="FILE.toml",
                   help="a data file of measurements in the packaged file's format (default: the packaged one)")
    p.add_argument("--report", default=None, metavar="FILE.json", help="write the JSON report here")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write measured vs predicted step time")
    p.add_argument("--fit", default=None, metavar="CHIP",
                   help="fit CHIP's sustained matmul fraction to its cases in the data file and print it with "
                        "each case's leave-one-out error (see partir_emu.app.validation.calibrate)")
    p.add_argument("--holdout", default=None, choices=("source", "chip", "stack"),
                   help="refit every fitted constant without each group of cases (by published table, chip or "
                        "stack) and print each case's error predicted with constants not fitted to it")
    p.add_argument("--fits", action="store_true",
                   help="list every fitted constant of the model with the cases it is fitted on")
    p.add_argument("--explain", action="store_true",
                   help="with --case: print why each prediction is what it is (time by op kind and the rate it "
                        "achieved, exposed communication by axes, memory by category)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(fn=cmd_fidelity)


def cmd_fidelity(args: argparse.Namespace) -> int:
    checks.check_output_path(args.report, "--report")
    checks.check_plot_path(args.plot, "--plot")
    checks.only_with(args.explain or None, "--explain", bool(args.cases), "with --case NAME ...",
                     "it explains the cases named")
    if args.fit:
        print(calibrate(args.fit, load_cases(args.data)).table())
        return 0
    if args.fits:
        print(fits_table(fitted_constants(load_cases(args.data))))
        return 0
    if args.holdout:
        cases = select(load_cases(args.data), args.cases, args.group or "all")
        with Phases("fidelity", quiet=args.quiet) as phases:
            phases.phase(f"--holdout {args.holdout}")
            ho = holdout(cases, args.holdout)
        write_report(ho.to_json(), args.report)
        print(ho.table())
        if args.report:
            print(f"wrote {args.report}")
        return 0
    group = args.group or "required"
    cases = select(load_cases(args.data), args.cases, group)
    if not cases:
        raise UsageError(f"--group {group}: the data file has no such cases")
    with Phases("fidelity", quiet=args.quiet) as phases:
        rep = run_cases(cases, on_case=lambda c: phases.phase(f"case {c.case}"))
    write_report(rep.to_json(), args.report)
    if args.plot and rep.results:
        with atomic_path(args.plot) as tmp:
            rep.plot(tmp)
    print(rep.table())
    for r in rep.results if args.explain else ():
        print("\n" + explain(r))
    for path in (args.report, args.plot if rep.results else None):
        if path:
            print(f"wrote {path}")
    if rep.failures:
        c, why = rep.failures[0]
        print(f"partir-emu fidelity: {len(rep.failures)} of {len(cases)} case(s) could not run; first: {why}",
              file=sys.stderr)
        return 2
    return 0



__all__ = ["add_subcommands", "cmd_fidelity"]
