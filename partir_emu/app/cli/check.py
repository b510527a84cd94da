"""``partir-emu check CLAIMS.toml``: predictability claims for users without pytest (the file format:
:mod:`partir_emu.app.claims.claims_file`). One line per claim, JUnit XML for CI (``--junit``),
exit 0 when every claim holds, 1 when one does not, 2 when one could not be evaluated (its
configuration does not lower, say) or the file is wrong."""
from __future__ import annotations

import argparse
import time

from partir_emu.app import checks
from partir_emu.app.claims.claims_file import evaluate, load_claims
from partir_emu.app.claims.junit import write_junit
from partir_emu.app.cli import exits
from partir_emu.app.cli.phases import Phases
from partir_emu.app.common import write_report


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="check the predictability claims of a claims file (JUnit XML for CI)")
    p.add_argument("claims", metavar="CLAIMS.toml", help="[config.NAME] tables and [[claim]] entries "
                   "(see docs/claims.md)")
    p.add_argument("--junit", default=None, metavar="FILE.xml", help="write the outcomes as JUnit XML here")
    p.add_argument("--report", default=None, metavar="FILE.json", help="write the outcomes as JSON here")
    p.add_argument("--update-baselines", action="store_true",
                   help="write the baseline claims' snapshots instead of checking them (then review the diff)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(fn=cmd_check)


def cmd_check(args: argparse.Namespace) -> int:
    checks.check_output_path(args.junit, "--junit")
    checks.check_output_path(args.report, "--report")
    cf = load_claims(args.claims)            # the whole file is checked before anything is priced
    t0 = time.perf_counter()
    with Phases("check", quiet=args.quiet) as phases:
        outcomes, written = evaluate(cf, update_baselines=args.update_baselines,
                                     on_claim=lambda c: phases.phase(f"claim {c.name}"))
    seconds = time.perf_counter() - t0
    for o in outcomes:
        print(f"{o.status.upper():5} {o.claim.name} ({o.seconds:.1f} s)")
        for line in o.message.splitlines() if o.status != "pass" else ():
            print(f"      {line}")
    held = sum(o.status == "pass" for o in outcomes)
    print(f"{held} of {len(outcomes)} claims hold ({seconds:.1f} s)")
    for p in written:
        print(f"wrote {p}")
    if args.junit:
        write_junit(args.junit, outcomes, str(args.claims), seconds)
        print(f"wrote {args.junit}")
    write_report({"file": str(args.claims), "seconds": seconds, "written": [str(p) for p in written],
                  "claims": [{"name": o.claim.name, "kind": o.claim.kind, "configs": list(o.claim.configs),
                              "status": o.status, "message": o.message, "seconds": o.seconds} for o in outcomes]},
                 args.report)
    if args.report:
        print(f"wrote {args.report}")
    if any(o.status == "error" for o in outcomes):
        return exits.BAD_INPUT
    return exits.NOT_VERIFIED if held < len(outcomes) else exits.OK


__all__ = ["add_subcommands", "cmd_check"]
