"""The search behind :class:`~partir_emu.compiler.tactics.AutomaticPartition`: Monte Carlo tree
search over the decisions of one axis, each candidate lowered and priced.

**Tree.** The families of the tactic (:mod:`.auto_space`, largest first) are decided in order.
A node is a prefix of decisions: "family F tiled on dim d" or "F left to propagation". A family
that the node's decisions already tiled through propagation is decided and skipped (after
``mlp/w_in`` on its columns, which propagates Megatron's pairing to ``w_out``, the tree does not
branch on ``w_out``). Every node is a complete strategy: the undecided families are left to
propagation.

**Evaluation.** A candidate is applied to the state the earlier tactics left (one ManualPartition
with every decision of the candidate, as :func:`partir_emu.compiler.auto.apply_automatic` will apply the winner),
then the manual tactics that follow in the schedule, then lowered and priced by the cost
function. Results are cached by decision set and by the propagated state's fingerprint (two
decision sets that propagate alike are lowered once); a candidate whose application or lowering
raises a PartirError is infeasible. ``evaluations`` counts calls of the cost function.

**MCTS.** Each iteration selects a path by UCT (``Q + c·sqrt(ln N / n)``, ``Q`` the mean of the
subtree's rewards blended half and half with its best, as in single-player MCTS, since only the
best strategy matters), expands the next untried action of the last node and prices the new
node: its rollout is the default policy "leave every family not yet decided to propagation",
which is deterministic and is itself a complete strategy. ``rollouts`` adds that many random
completions per new node (each open family left with probability 1/2, else tiled on a random
legal dim, from a generator seeded by ``seed``), each priced. Default 0: measured on the t48 and
t32 presets with their layers as a loop, random rollouts cost up to 35 % in the strategy found at
14-32 evaluations (half the budget goes to random strategies) and gain 1-8 % at 64-96. The reward
of a candidate is ``e* / e``: ``e`` its effective cost (its value, stretched by how far it
overflows the memory limit and doubled if it does), ``e*`` the least effective cost priced so far
(applied when a node is selected, so every reward is on today's scale: 1 for the best, 0 for
infeasible; a scale fixed by the baseline would squeeze every strategy that fits into a sliver
when the baseline does not fit, as at full size). A subtree whose leaves are all priced is
closed, so on a small space the search is exhaustive and exact. It stops at ``budget``
evaluations, after ``seconds`` (the evaluation under way finishes), or when the tree is closed.

**Polish.** Unless the tree was exhausted, :func:`polish` descends from its best: extend a
decision to the other families of its kind, or drop one, while that is better, within ``polish``
more evaluations (see its docstring).

**Choice.** The best candidate is the cheapest that fits the memory limit (if none fits, the
one that overflows least); a candidate replaces the best only if cheaper by more than 1e-9
relatively, ties going to fewer decisions, then lower dims. Deterministic for a given budget and
seed; the ``seconds`` cap can only cut it short (``stopped`` says why it ended).
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from partir_emu.compiler.auto.space import Price, Space, fingerprint, open_choices
from partir_emu.compiler.auto.space import family as family_glob
from partir_emu.compiler.lowering.lower import lower
from partir_emu.compiler.propagate import apply_tactic
from partir_emu.compiler.state import ShardingState
from partir_emu.compiler.tactics import AutomaticPartition, ManualPartition
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import PartirError, TacticError

LEAVE = -1          # the action "leave this family to propagation"


class _SettingError(TacticError):
    """A search setting the cost function cannot serve: raised to the user, never a candidate's fault."""

_UCT_C = 0.3


@dataclass
class Candidate:
    """One priced strategy: its decisions (family position → dim) and price."""

    decisions: dict[int, int]
    price: Price | None              # None: infeasible (application or lowering failed)
    fits: bool
    effective: float                 # value, stretched when it overflows the limit (inf: infeasible)
    order: int                       # when it was first priced
    fingerprint: int = 0
    error: str = ""
    over: int = 0                    # bytes per device over the memory limit


@dataclass
class Node:
    decisions: dict[int, int]
    next_pos: int                               # families before this position are decided
    choices: list[tuple[int, tuple[int, ...]]]  # open (family, dims) from next_pos on, in this node's state
    value: Candidate
    children: dict[int, Node] = field(default_factory=dict)
    untried: list[int] = field(default_factory=list)
    visits: int = 0
    total: float = 0.0
    best: float = 0.0
    closed: bool = False

    @property
    def branch(self) -> tuple[int, tuple[int, ...]] | None:
        return self.choices[0] if self.choices else None


class Evaluator:
    """Applies, lowers and prices candidates, with the two caches (see the module docstring)."""

    def __init__(self, base: ShardingState, space: Space, tactic: AutomaticPartition, index: int,
                 later: Sequence[ManualPartition], cost_fn: Callable[[SpmdProgram], float | Price],
                 state_outputs: dict[str, str] | None = None) -> None:
        self.base, self.space, self.tactic, self.index, self.later = base, space, tactic, index, list(later)
        self.state_outputs = state_outputs
        self.cost_fn = cost_fn
        self.label = tactic.name or f"auto:{tactic.axis}"
        self.by_decisions: dict[frozenset, tuple[Candidate, list]] = {}
        self.by_state: dict[int, Candidate] = {}
        self.evaluations = 0
        self.limit: int | None = tactic.memory_limit
        self.least = math.inf               # the least effective cost priced so far (e*)

    def state_of(self, decisions: Mapping[int, int]) -> ShardingState:
        st = self.base.copy()
        if decisions:
            apply_tactic(st, self.space.tactic(decisions, self.tactic.axis, self.label), self.index)
        return st

    def evaluate(self, decisions: Mapping[int, int]) -> tuple[Candidate, list]:
        """(candidate, open choices of its state after position 0) for ``decisions``, cached."""
        key = frozenset(decisions.items())
        hit = self.by_decisions.get(key)
        if hit is not None:
            return hit
        order = len(self.by_decisions)
        try:
            st = self.state_of(decisions)
            choices = open_choices(st, self.space, self.tactic.axis)
            for k, t in enumerate(self.later):
                apply_tactic(st, t, self.index + 1 + k)
            fp = fingerprint(st)
            cand = self.by_state.get(fp)
            if cand is None:
                cand = self._price(dict(decisions), order, fp, st)
                self.by_state[fp] = cand
            elif _simplicity(decisions) < _simplicity(cand.decisions):
                cand.decisions = dict(decisions)     # the same program, written with fewer decisions
        except _SettingError:
            raise                                    # the user's settings, not this candidate, are wrong
        except PartirError as exc:
            cand, choices = Candidate(dict(decisions), None, False, math.inf, order, error=str(exc)), []
        self.by_decisions[key] = (cand, choices)
        return cand, choices

    def _price(self, decisions: dict[int, int], order: int, fp: int, st: ShardingState) -> Candidate:
        spmd = lower(st, self.state_outputs)
        self.evaluations += 1
        raw = self.cost_fn(spmd)
        price = raw if isinstance(raw, Price) else Price(float(raw))
        limit = self.limit if self.limit is not None else price.capacity
        if limit is not None and price.peak_bytes is None:
            raise _SettingError(f"{self.tactic.describe()}: memory_limit={limit} but the cost function returns no "
                              "peak memory; return a partir_emu.compiler.auto.tactic.Price(value, peak_bytes=...)")
        over = 0 if limit is None else max(0, (price.peak_bytes or 0) - limit)
        fits = over == 0
        eff = price.value if fits else 2 * price.value * (1 + over / max(limit or 1, 1))
        return Candidate(decisions, price, fits, eff if math.isfinite(eff) else math.inf, order, fp, over=over)

    def reward(self, c: Candidate) -> float:
        """``1 / e`` (0 if infeasible); the search multiplies by ``e*`` when it compares."""
        if not math.isfinite(c.effective):
            return 0.0
        self.least = min(self.least, c.effective)
        return 1.0 / c.effective if c.effective > 0 else 0.0     # a free strategy: nothing to scale by


def better(a: Candidate, b: Candidate) -> bool:
    """Is ``a`` a better choice than ``b`` (see "Choice" in the module docstring)?"""
    if a.fits != b.fits:
        return a.fits
    if a.over != b.over:
        return a.over < b.over
    ea, eb = a.effective, b.effective
    if ea < eb * (1 - 1e-9) or (math.isfinite(ea) and not math.isfinite(eb)):
        return True
    if eb < ea * (1 - 1e-9) or (math.isfinite(eb) and not math.isfinite(ea)):
        return False
    return _simplicity(a.decisions) < _simplicity(b.decisions)


def _simplicity(decisions: Mapping[int, int]) -> tuple:
    return (len(decisions), tuple(sorted(decisions.items())))


@dataclass
class Outcome:
    best: Candidate
    baseline: Candidate
    candidates: list[Candidate]      # every distinct priced strategy, in pricing order
    evaluations: int
    seconds: float
    nodes: int
    stopped: str                     # "exhausted", "budget" or "time"


class Mcts:
    """The tree and its iterations (see the module docstring)."""

    def __init__(self, ev: Evaluator, seed: int, rollouts: int, deadline: float = math.inf,
                 budget: float = math.inf) -> None:
        self.ev, self.rng, self.rollouts = ev, random.Random(seed), rollouts
        self.deadline = deadline            # perf_counter time after which no rollout starts
        self.budget = budget                # evaluations after which no rollout starts
        self.nodes = 0

    def node(self, decisions: dict[int, int], next_pos: int) -> Node:
        cand, choices = self.ev.evaluate(decisions)
        n = Node(decisions, next_pos, [(k, d) for k, d in choices if k >= next_pos], cand)
        if n.branch is not None:
            n.untried = [LEAVE, *n.branch[1]]
        else:
            n.closed = True
        self.nodes += 1
        return n

    def child(self, parent: Node, action: int) -> Node:
        assert parent.branch is not None, "a closed node has no children"
        fam = parent.branch[0]
        dec = dict(parent.decisions)
        if action != LEAVE:
            dec[fam] = action
        return self.node(dec, fam + 1)

    def select(self, root: Node) -> list[Node]:
        path = [root]
        node = root
        while not node.untried and node.children:
            live = [c for c in node.children.values() if not c.closed]
            if not live:
                break
            ln = math.log(max(node.visits, 1))
            scale = self.ev.least if math.isfinite(self.ev.least) else 0.0
            node = max(live, key=lambda c: 0.5 * scale * (c.total / max(c.visits, 1) + c.best)
                       + _UCT_C * math.sqrt(ln / max(c.visits, 1)))
            path.append(node)
        return path

    def rollout(self, node: Node) -> Candidate:
        dec = dict(node.decisions)
        for k, dims in node.choices:
            if self.rng.random() >= 0.5:
                dec[k] = self.rng.choice(dims)
        return self.ev.evaluate(dec)[0]

    def iterate(self, root: Node) -> None:
        path = self.select(root)
        leaf = path[-1]
        rewards = []
        if leaf.untried:
            action = leaf.untried.pop(0)
            kid = self.child(leaf, action)
            leaf.children[action] = kid
            path.append(kid)
            rewards.append(self.ev.reward(kid.value))
            for _ in range(self.rollouts if not kid.closed else 0):
                if time.perf_counter() >= self.deadline or self.ev.evaluations >= self.budget:
                    break
                rewards.append(self.ev.reward(self.rollout(kid)))
        else:
            rewards.append(self.ev.reward(leaf.value))
        r = max(rewards)
        for n in path:
            n.visits += 1
            n.total += r
            n.best = max(n.best, r)
        for n in reversed(path):     # close the nodes whose every action has a closed subtree
            if n.closed:
                continue
            if not n.untried and all(c.closed for c in n.children.values()):
                n.closed = True
            else:
                break


def run_search(ev: Evaluator, tactic: AutomaticPartition) -> Outcome:
    """Search until the budget, the time or the tree runs out; the best candidate and the others."""
    t0 = time.perf_counter()
    deadline = math.inf if tactic.seconds is None else t0 + tactic.seconds    # a safety net only (tactics.py)
    mcts = Mcts(ev, tactic.seed, tactic.rollouts, deadline, tactic.budget)
    root = mcts.node({}, 0)
    baseline = root.value
    if baseline.price is None:
        raise TacticError(f"{tactic.describe()}: the state before the search cannot be lowered or priced: "
                          f"{baseline.error}")
    ev.reward(baseline)                     # the baseline is the first e*
    stopped = "exhausted"
    while not root.closed:
        if ev.evaluations >= tactic.budget:
            stopped = "budget"
            break
        if time.perf_counter() >= deadline:
            stopped = "time"
            break
        mcts.iterate(root)
    best = baseline
    for c in _priced(ev):
        if better(c, best):
            best = c
    if tactic.polish > 0 and stopped != "exhausted":
        best = polish(ev, best, ev.evaluations + tactic.polish, deadline)
    cands = sorted({id(c): c for c, _ in ev.by_decisions.values()}.values(), key=lambda c: c.order)
    priced = [c for c in cands if c.price is not None]
    return Outcome(best, baseline, priced, ev.evaluations, time.perf_counter() - t0, mcts.nodes, stopped)


def _priced(ev: Evaluator) -> list[Candidate]:
    cands = sorted({id(c): c for c, _ in ev.by_decisions.values()}.values(), key=lambda c: c.order)
    return [c for c in cands if c.price is not None]


def role(label: str) -> str:
    """What a family *is*, whatever block it sits in: the last two components of its glob (``conv2/w``
    of ``params/up_*/block_*/conv2/w [3, 3, 256, 256]``), layer numbers starred."""
    return "/".join(family_glob(label.split(" [", 1)[0]).split("/")[-2:])


def _moves(ev: Evaluator, best: Candidate) -> list[dict[int, int]]:
    """The neighbours :func:`polish` tries, generalisations first: each decision (family F on dim d)
    extended to every open family of the same role, rank and a legal d (layers of one kind are
    partitioned alike, as a tactic pattern like ``params/*/conv1/w`` says); then each decision dropped."""
    fams = ev.space.families
    open_dims = dict(ev.evaluate(best.decisions)[1])
    out = []
    for k, d in sorted(best.decisions.items()):
        peers = [g for g, dims in sorted(open_dims.items()) if d in dims and role(fams[g].label) == role(fams[k].label)
                 and len(fams[g].shape) == len(fams[k].shape)]
        if peers:
            out.append({**best.decisions, **{g: d for g in peers}})
    if len(best.decisions) > 1:
        out += [{f: d for f, d in best.decisions.items() if f != k} for k in sorted(best.decisions)]
    return out


def polish(ev: Evaluator, best: Candidate, budget: int, deadline: float) -> Candidate:
    """Local descent from the tree's best over :func:`_moves` (generalise a decision to its role's
    other families; drop a decision), keeping the best move while it is better, until none is or
    ``budget`` evaluations or ``deadline`` are reached. Why: the tree decides families in a fixed
    order and a limited budget reaches few of its subtrees: a decision taken high up (a large weight
    family) is kept in every strategy below it, and the same decision for a small family of the same
    kind far down may never be tried (on the GNS at full size the tree keeps node sharding next to
    edge sharding; on a U-Net it shards some blocks' convolutions Megatron-style and not the rest)."""
    improved = True
    while improved:
        improved = False
        step_best = best
        for dec in _moves(ev, best):
            if ev.evaluations >= budget or time.perf_counter() >= deadline:
                return step_best
            c = ev.evaluate(dec)[0]
            if c.price is not None and better(c, step_best):
                step_best = c
        if step_best is not best:
            best, improved = step_best, True
    return best
