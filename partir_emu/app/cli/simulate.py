"""``partir-emu simulate`` and ``partir-emu hardware``: the analytical model from the command line.

:func:`add_subcommands` registers both on the ``partir-emu`` parser (:mod:`partir_emu.app.cli.main`).
Nothing here imports jax: ``simulate`` lowers the scenario through ``Experiment.lower``
(abstract tracing, no arrays), which imports the compiler only when called, and
``hardware`` only reads spec files.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from partir_emu.app import checks
from partir_emu.app.atomic import finite_json
from partir_emu.app.cli.exits import one_line
from partir_emu.app.cli.faults import add_fault_args, fault_kwargs
from partir_emu.app.cli.phases import Phases
from partir_emu.app.common import (
    add_experiment_args,
    add_overlap_args,
    experiment_from_args,
    print_warnings,
    write_report,
)
from partir_emu.app.experiment import Experiment
from partir_emu.collectives.algorithms import ALGORITHMS
from partir_emu.core.spmd import COMM_PRIMS
from partir_emu.errors import PartirError, UsageError
from partir_emu.hwmodels.analytical import Analyzer, SimReport, simulate
from partir_emu.hwmodels.compute.stack import list_stacks, load_stack
from partir_emu.hwmodels.machine.placement import Placement
from partir_emu.hwmodels.machine.search import PlacementChoice, resolve_placement
from partir_emu.hwmodels.machine.slices import chips_limit
from partir_emu.hwmodels.machine.specs import HardwareSpec, TorusSpec, list_specs, load_spec


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="predict step time and per-device memory on a hardware spec (no arrays)")
    add_experiment_args(p)
    p.add_argument("--hardware", default="tpu-v4", help="spec name (see `partir-emu hardware`) or a .toml path "
                   "(default %(default)s)")
    add_stack_arg(p)
    add_placement_arg(p)
    p.add_argument("--slice", dest="slice_dims", default=None, metavar="AxBxC",
                   help="TPU slice shape, e.g. 8x8x8 (default: derived from the mesh / placement); one dim more "
                        "in front is the number of slices joined by DCN, e.g. 2x16x16 on tpu-v5e (put a mesh "
                        "axis of that size first: --mesh dcn=2,batch=256 --strategy bp+z3@batch)")
    add_overlap_args(p)
    add_fault_args(p)                     # --comm-streams, --straggler, --degrade-link, --fail-link
    p.add_argument("--algorithm", default=None, metavar="ALG | KIND=ALG,...",
                   help="collective algorithm for every kind (ring, bidir_ring, recursive, torus, hierarchical, "
                        "direct) or per kind, e.g. all_reduce=ring,all_gather=bidir_ring; default: as the runtime "
                        "would choose on the placed topology")
    p.add_argument("--top", type=checks.positive_int, default=10,
                   help="slowest collectives to list (default %(default)s)")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.set_defaults(fn=cmd_simulate)

    p = sub.add_parser("hardware", help="list the hardware specs (or show one with its sources)")
    p.add_argument("name", nargs="?", default=None, help="show this spec in full, with the source of each number")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(fn=cmd_hardware)


# -- simulate -----------------------------------------------------------------------------------------
def parse_algorithms(text: str | None) -> str | dict[str, str] | None:
    """``"ring"`` (every kind) or ``"all_reduce=ring,all_gather=bidir_ring"`` (per kind), validated."""
    if text is None or not text.strip():
        return None

    def check(alg: str) -> str:
        if alg not in ALGORITHMS:
            raise UsageError(f"--algorithm: unknown collective algorithm {alg!r}; "
                                        f"use one of {', '.join(ALGORITHMS)}")
        return alg

    text = text.strip()
    if "=" not in text:
        return check(text)
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        kind, eq, alg = (s.strip() for s in part.partition("="))
        if not eq:
            raise UsageError(f"--algorithm: item {part!r} is not KIND=ALGORITHM; write e.g. "
                                        f"all_reduce=ring,all_gather=bidir_ring")
        if kind not in COMM_PRIMS:
            raise UsageError(f"--algorithm: unknown collective kind {kind!r}; "
                                        f"kinds are {', '.join(COMM_PRIMS)}")
        out[kind] = check(alg)
    return out


def parse_slice(text: str | None) -> tuple[int, ...] | None:
    if text is None or not text.strip():
        return None
    try:
        dims = tuple(int(s) for s in text.lower().replace(",", "x").split("x"))
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise UsageError(f"--slice {text!r}: write the slice shape as positive integers joined "
                                    f"by 'x', e.g. 8x8x8")
    return dims


def simulate_experiment(args: argparse.Namespace) -> tuple[dict, SimReport]:
    """Lower the experiment of ``args`` and simulate it: (JSON report, SimReport)."""
    # cheap checks first: a bad path, spec, algorithm, slice or mesh fails before the (slow) lowering
    checks.check_output_path(getattr(args, "report", None), "--report")
    spec = load_spec(args.hardware).with_stack(load_stack(args.stack))
    checks.only_with(args.prefetch_bytes, "--prefetch-bytes", args.overlap, "with --overlap (the default)",
                     "without overlap every gather blocks where it is used")
    algorithms = parse_algorithms(args.algorithm)
    faults = fault_kwargs(args)
    slice_dims = parse_slice(args.slice_dims)
    exp = experiment_from_args(args)
    checks.check_mesh_size(exp.mesh, checks.MAX_SIMULATE_DEVICES, getattr(args, "cmd", "simulate"))
    checks.check_fits_hardware(exp.mesh, chips_limit(spec, slice_dims), spec.name)
    analyzer = Analyzer()                # this command's session: one topology, one placement, one analysis
    check_placement(exp.mesh, spec, args.placement, slice_dims, analyzer)
    with Phases(getattr(args, "cmd", "simulate"), quiet=getattr(args, "quiet", False)) as phases:
        phases.phase("lowering")
        t0 = time.perf_counter()
        low = exp.lower()
        t1 = time.perf_counter()
        print_warnings(low.warnings)     # a tactic whose own decisions conflict (compiler.conflicts)
        phases.phase("placing")
        placed = choose_placement(low.spmd, spec, args.placement, analyzer, overlap=args.overlap,
                                  slice_dims=slice_dims, algorithms=algorithms, prefetch_bytes=args.prefetch_bytes,
                                  **faults)       # the cheapest under the same streams and faults
        phases.phase("simulating")
        model_flops = model_flops_per_device(exp)
        sim = simulate(low.spmd, spec, placed.placement, overlap=args.overlap, prefetch_bytes=args.prefetch_bytes,
                       algorithms=algorithms, analyzer=analyzer,
                       model_flops=model_flops, **faults)
        t2 = time.perf_counter()          # simulate_s: placing (the search) and simulating
    rep = sim.to_json()
    rep.update(placed.to_json(sim.step_s))
    rep.update({
        "model_flops_per_device": model_flops,
        "scenario": exp.scenario_name, "strategy": exp.strategy, "size": exp.cfg,
        "preset": exp.preset or exp.scenario.default_preset,
        "params": int(exp.scenario.param_count(exp.cfg)),
        "mesh": dict(exp.mesh.axes), "devices": exp.mesh.size, "hardware": spec.name, "hardware_path": spec.path,
        "stack": spec.stack.to_json(), "algorithm": algorithms, "equations": len(low.spmd.program.eqns),
        "lower_s": t1 - t0, "simulate_s": t2 - t1,
        # what each AutomaticPartition chose and why (compiler.auto.SearchResult)
        "auto": [dict(res.to_json(), label=label, text=res.report(label)) for label, res in low.final_state.auto_results],
    })
    return rep, sim


def cmd_simulate(args: argparse.Namespace) -> int:
    rep, sim = simulate_experiment(args)
    write_report(rep, args.report)
    size = ",".join(f"{k}={v}" for k, v in rep["size"].items())
    print(f"{rep['scenario']} / {rep['strategy']} on {rep['devices']} devices {rep['mesh']}  "
          f"[{rep['preset']}: {size}; {rep['params']:,} params]")
    for line in placement_lines(rep):
        print(line)
    print(sim.table(top=args.top))
    for auto in rep["auto"]:
        print("\n" + auto["text"])
    print(f"\nMFU {_util(sim.mfu)}   HFU {_util(sim.hfu)}   ({rep['equations']} equations; lowered in "
          f"{rep['lower_s']:.2f} s, simulated in {1e3 * rep['simulate_s']:.1f} ms)")
    if args.report:
        print(f"wrote {args.report}")
    return 0


# -- placement (--placement auto | default | AXIS=DIMS,...) ---------------------------------------------
def add_placement_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", default="auto", metavar="auto|default|AXIS=DIMS,...",
                   help="mesh axes onto physical dims: auto (default: the cheapest of the legal placements, "
                        "priced by the analytical model), default (fill the physical dims in order), or explicit, "
                        "e.g. model=x,batch=yz, batch=x+y+z[4],model=z[4] (a part of a dim), GPU: model=gpu,batch=node")


def check_placement(mesh, spec: HardwareSpec, text: str | None, slice_dims: tuple[int, ...] | None,
                    analyzer: Analyzer) -> None:
    """A bad ``--placement`` or ``--slice`` fails here, before the (slow) lowering; what it builds
    stays in ``analyzer`` for the command to use."""
    if text is None or text.strip().lower() == "auto":
        analyzer.topology(spec, mesh.size, slice_dims)
    else:
        analyzer.placement(mesh, spec, text, slice_dims)


@dataclass(frozen=True)
class Placed:
    """The placement a command runs on, how it was chosen, and its priced warnings."""

    placement: Placement
    mode: str                         # "auto" | "default" | "explicit"
    choice: PlacementChoice | None    # the search, if one ran (auto, or to price a warning)
    warnings: tuple[str, ...]

    def to_json(self, step_s: float) -> dict:
        return {"placement_mode": self.mode, "placement_mapping": self.placement.mapping_text(),
                "placement_step_s": step_s, "placement_warnings": list(self.warnings),
                "placement_search": self.choice.to_json() if self.choice is not None else None}


def choose_placement(spmd, spec: HardwareSpec, text: str | None, analyzer: Analyzer | None = None, *,
                     overlap: bool = False, slice_dims: tuple[int, ...] | None = None, **simulate_kwargs) -> Placed:
    """``--placement`` resolved on the lowered program (``auto``: the search; see
    :func:`~partir_emu.hwmodels.machine.search.resolve_placement`)."""
    mode = ("auto" if text is None or text.strip().lower() == "auto"
            else "default" if text.strip().lower() == "default" else "explicit")
    placement, choice, warnings = resolve_placement(spmd, spec, text, analyzer, overlap, slice_dims,
                                                    **simulate_kwargs)
    return Placed(placement, mode, choice, tuple(warnings))


def placement_lines(rep: dict) -> list[str]:
    """The chosen placement, the runner-up (or the best found) with steps, and the priced warnings."""
    search = rep.get("placement_search")
    mode, mapping = rep.get("placement_mode", "default"), rep.get("placement_mapping") or rep.get("placement")
    out: list[str] = []
    if search is None:
        out.append(f"placement ({mode}): {mapping}")
    elif mode == "auto":
        out.append(f"placement (auto): {search['mapping']}  step {search['step_s'] * 1e3:.4f} ms  "
                   f"(cheapest of {len(search['candidates'])} placements, searched in {search['search_s'] * 1e3:.0f} ms)")
        if search["runner_up"] is not None:
            out.append(f"runner-up: {search['runner_up']}  step {search['runner_up_step_s'] * 1e3:.4f} ms  "
                       f"({search['runner_up_step_s'] / search['step_s']:.2f}x)")
        if search["default_mapping"] not in (search["mapping"], search["runner_up"], None):
            out.append(f"default fill: {search['default_mapping']}  step {search['default_step_s'] * 1e3:.4f} ms  "
                       f"({search['default_step_s'] / search['step_s']:.2f}x)")
        out += [f"note: default fill avoided: {w}" for w in search["default_warnings"]]
    else:
        out.append(f"placement ({mode}): {mapping}  step {rep['placement_step_s'] * 1e3:.4f} ms")
        out.append(f"best found: {search['mapping']}  step {search['step_s'] * 1e3:.4f} ms  "
                   f"(of {len(search['candidates'])} placements, searched in {search['search_s'] * 1e3:.0f} ms)")
    # auto already chose the cheapest: what is questionable about it is a note, not a warning
    label = "note: chosen placement" if mode == "auto" else "warning: placement"
    out += [f"{label}: {w}" for w in rep.get("placement_warnings", ())]
    return out


def model_flops_per_device(exp: Experiment) -> float:
    """Model FLOPs of one step per device, the numerator of MFU (``Scenario.model_flops``: 6·N per
    token plus attention, no recomputation, no elementwise FLOPs), over the mesh's devices."""
    return float(exp.scenario.model_flops(exp.cfg)) / exp.mesh.size


def _util(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def add_stack_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stack", default="xla", metavar="NAME|PATH",
                   help="the software stack around the kernels: " + ", ".join(list_stacks())
                        + " or a .toml stack profile (default %(default)s: XLA running the program as lowered)")


# -- hardware -----------------------------------------------------------------------------------------
def _spec_row(spec: HardwareSpec) -> dict:
    net = spec.network
    if isinstance(net, TorusSpec):
        topo = (f"{len(net.pod_dims)}D torus {'x'.join(map(str, net.pod_dims))}"
                + (f" of {'x'.join(map(str, net.cube))} cubes" if net.cube else "")
                + f", wraparound {net.wraparound}")
        links = f"{net.links_per_chip} x {net.link_bw_bytes_per_s / 1e9:g} GB/s ICI"
        link_bw = net.link_bw_bytes_per_s
    else:
        topo = (f"{net.max_nodes} nodes x {net.gpus_per_node} GPUs, NVSwitch + IB "
                f"{net.fabric.replace('_', '-')}")
        links = f"NVLink {net.nvlink_bw_bytes_per_s / 1e9:g} GB/s, NIC {net.nic_bw_bytes_per_s / 1e9:g} GB/s"
        link_bw = net.nvlink_bw_bytes_per_s
    return {"name": spec.name, "kind": spec.kind, "max_chips": net.max_chips, "topology": topo,
            "flops_bf16_per_s": spec.flops_bf16_per_s, "hbm_bytes": spec.hbm_bytes,
            "hbm_bw_bytes_per_s": spec.hbm_bw_bytes_per_s, "link_bw_bytes_per_s": link_bw, "links": links,
            "path": spec.path}


def cmd_hardware(args: argparse.Namespace) -> int:
    if args.name is not None:
        spec = load_spec(args.name)
        d = spec.to_json()
        d["sources"] = dict(spec.sources)
        if args.json:
            print(json.dumps(finite_json(d), indent=2, sort_keys=True, allow_nan=False))
            return 0
        row = _spec_row(spec)
        print(f"{spec.name} ({spec.kind}): {spec.description}")
        print(f"  file: {spec.path}")
        print(f"  up to {row['max_chips']} chips: {row['topology']}")
        flat = {k: v for k, v in d.items() if k not in ("network", "sources", "path", "name", "kind")}
        flat.update(d["network"])
        for k, v in flat.items():
            src = spec.sources.get(k)
            print(f"  {k:<24}{_fmt(v):>16}" + (f"   # {src}" if src else ""))
        return 0

    rows, errors = [], []
    for name in list_specs():
        try:
            rows.append(_spec_row(load_spec(name)))
        except PartirError as exc:        # one bad user file does not hide the others
            errors.append(one_line(exc))
    if args.json:
        print(json.dumps(finite_json(rows), indent=2, allow_nan=False))
    else:
        print(f"{'name':<10}{'kind':<5}{'chips':>7}  {'bf16 TFLOP/s':>12}{'HBM GiB':>9}{'HBM GB/s':>10}"
              f"{'link GB/s':>11}  topology; links")
        for r in rows:
            print(f"{r['name']:<10}{r['kind']:<5}{r['max_chips']:>7}  {r['flops_bf16_per_s'] / 1e12:>12g}"
                  f"{r['hbm_bytes'] / 2**30:>9.1f}{r['hbm_bw_bytes_per_s'] / 1e9:>10g}"
                  f"{r['link_bw_bytes_per_s'] / 1e9:>11g}  {r['topology']}; {r['links']}")
        print("link GB/s: one way, per ICI link (TPU) or NVLink per GPU (GPU)")
    if errors:
        for e in errors:
            print(f"partir-emu hardware: error: {e} (skipped; the other specs are listed)", file=sys.stderr)
        return 2
    return 0


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (list, tuple)):
        return "x".join(map(str, v))
    if isinstance(v, int) and not isinstance(v, bool) and v >= 10**6:
        return f"{v:,}"
    return str(v)


__all__ = ["Placed", "add_placement_arg", "add_stack_arg", "add_subcommands", "check_placement", "choose_placement", "cmd_hardware",
           "cmd_simulate", "model_flops_per_device", "parse_algorithms", "parse_slice", "placement_lines",
           "simulate_experiment"]
