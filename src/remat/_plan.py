"""The planner: one decision per block so the predicted peak fits a budget at least cost.

Model
-----
The candidates are a chain of blocks run in order in forward and in reverse
order in backward (a transformer's layers). For block ``i`` and decision
``d`` in ``keep``, ``recompute``, ``selective``, ``offload`` the profile
(:mod:`remat._profile`) measures

* ``retained[i][d]``: bytes the block leaves alive for the rest of the
  step: what was allocated from its forward start to the next block's
  forward start (for the last block: to its own forward end). Measured up
  to the next block rather than to the block's end because what follows a
  block (a residual add, the loss) may free its output under ``keep`` while
  a selective cache holds it;
* ``fwd_excess[i][d]``: peak during its forward above what was alive when it
  started;
* ``bwd_excess[i][d]``: peak during its backward above what was alive when
  its backward started (recomputed activations live here), or above the start
  the model assumes (below) where more was alive; for the last block also the
  peak between the end of forward and its backward under ``d``;
* ``cost[i][d]``: the time (or FLOPs) the decision adds to a step; ``keep`` is 0;

and, once, under all-``keep``: ``fwd_start[i]`` / ``bwd_start[i]``, the bytes
alive when block ``i``'s forward / backward starts, and ``top``, the peak
between the end of forward and the first block's backward (loss, logits).

With ``saved(i) = sum_{j<=i} retained[j][keep] - retained[j][d_j]`` the
predicted peak is the largest of

* ``fwd_start[i] - saved(i-1) + fwd_excess[i][d_i]``   (block ``i``'s forward)
* ``bwd_start[i] - saved(i) + bwd_excess[i][d_i]``     (block ``i``'s backward)
* ``top - saved(n)``

Every term is linear in one-hot decision variables ``x[i][d]``, so "minimise
``sum cost[i][d] x[i][d]`` subject to every term ``<= budget``" is a small
mixed-integer linear program, solved exactly by HiGHS through
``scipy.optimize.milp`` (extra ``remat[plan]``). :func:`solve_dp` solves the
same problem exactly without scipy: a dynamic program over blocks whose state
is ``saved(i)``, keeping only the Pareto front of (bytes saved, cost); it is
the cross-check in tests and the fallback when scipy is missing.

This is the chain formulation of Chen et al. 2016 ("Training Deep Nets with
Sublinear Memory Cost", arXiv:1604.06174) with per-block heterogeneous costs
as in Beaumont et al. (Rotor: "Optimal checkpointing for heterogeneous
chains", arXiv:1911.13214), solved as an integer program in the spirit of
Jain et al. 2020 (Checkmate, arXiv:1910.02653) at block rather than operator
granularity, with selective checkpointing and host offload as extra
per-block choices.

Not covered: nested checkpointing of groups of blocks (each block is decided
alone), blocks that are not a chain (skip connections across blocks other
than the residual stream), data-dependent shapes (the profile is valid for
the input shapes it was measured with), and allocator fragmentation on GPUs
(the model counts tensor bytes, as :mod:`remat.memory` does).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from ._errors import PlanError

DECISIONS = ("keep", "recompute", "selective", "offload")


@dataclasses.dataclass
class BlockCosts:
    """Measured costs of one candidate block (see the module docstring for the terms)."""

    name: str
    retained: dict[str, int]
    fwd_excess: dict[str, int]
    bwd_excess: dict[str, int]
    cost: dict[str, float]
    fwd_start: int
    bwd_start: int
    input_bytes: int = 0
    param_bytes: int = 0


def predicted_peak(blocks: Sequence[BlockCosts], top: int, decisions: Sequence[str]) -> int:
    """Peak bytes the model predicts for one decision per block."""
    saved = 0
    peak = 0
    for b, d in zip(blocks, decisions):
        peak = max(peak, b.fwd_start - saved + b.fwd_excess[d])
        saved += b.retained["keep"] - b.retained[d]
        peak = max(peak, b.bwd_start - saved + b.bwd_excess[d])
    return max(peak, top - saved)


def predicted_cost(blocks: Sequence[BlockCosts], decisions: Sequence[str]) -> float:
    """Added time (or FLOPs) the model predicts for one decision per block."""
    return float(sum(b.cost[d] for b, d in zip(blocks, decisions)))


def parse_budget(budget: int | float | str, reference: int) -> int:
    """Bytes from ``budget``: bytes (an int, or ``"1.5GiB"``), or a string ``"60%"`` of ``reference``.

    A percentage must be above ``0%`` (which can never be met); ``100%`` or
    more is met by keeping every block.

    Example:
        >>> parse_budget("50%", 1000), parse_budget(2048, 1000), parse_budget("1.5KiB", 1000)
        (500, 2048, 1536)
    """
    hint = (
        "Pass bytes (a positive int such as 2**30), a size such as '1.5GiB', or a percentage "
        "of the unchecked activation peak above 0% such as '60%'."
    )
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(f"remat.plan: budget must be bytes or a string, got {budget!r}. {hint}")
    if isinstance(budget, (int, float)):
        if not math.isfinite(budget) or budget < 1:
            raise ValueError(f"remat.plan: budget must be >= 1 byte, got {budget!r}. {hint}")
        return int(budget)
    m = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*%\s*", budget)
    if m:
        pct = float(m.group(1))
        if not pct > 0:
            raise ValueError(
                f"remat.plan: budget percentage must be above 0%, got {budget!r}. {hint}"
            )
        out = int(reference * pct / 100)
        if out < 1:
            raise ValueError(
                f"remat.plan: budget {budget!r} of the unchecked peak ({reference} bytes) is "
                f"0 bytes. {hint}"
            )
        return out
    m = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", budget, re.IGNORECASE)
    if m:
        unit = (m.group(2) or "B").upper().replace("I", "")
        scale = {"B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}[unit]
        out = int(float(m.group(1)) * scale)
        if out < 1:
            raise ValueError(f"remat.plan: budget must be >= 1 byte, got {budget!r}. {hint}")
        return out
    raise ValueError(f"remat.plan: cannot read budget {budget!r}. {hint}")


def _choices(blocks: Sequence[BlockCosts], allowed: Sequence[str]) -> list[list[str]]:
    return [[d for d in allowed if d in b.retained and d in b.cost] for b in blocks]


def solve_dp(
    blocks: Sequence[BlockCosts], top: int, budget: int, allowed: Sequence[str]
) -> list[str] | None:
    """Exact optimum by dynamic programming over the Pareto front of (saved bytes, cost).

    Returns the decisions, or ``None`` when no plan fits ``budget``.
    """
    # state: saved bytes -> (cost, decisions); only non-dominated states are kept
    front: list[tuple[int, float, tuple[str, ...]]] = [(0, 0.0, ())]
    for b, opts in zip(blocks, _choices(blocks, allowed)):
        nxt: dict[int, tuple[float, tuple[str, ...]]] = {}
        for saved, cost, ds in front:
            for d in opts:
                if b.fwd_start - saved + b.fwd_excess[d] > budget:
                    continue
                s2 = saved + b.retained["keep"] - b.retained[d]
                if b.bwd_start - s2 + b.bwd_excess[d] > budget:
                    continue
                c2 = cost + b.cost[d]
                old = nxt.get(s2)
                if old is None or c2 < old[0]:
                    nxt[s2] = (c2, (*ds, d))
        front = []
        best = float("inf")
        for s2 in sorted(nxt, reverse=True):  # more saved first; keep if strictly cheaper
            c2, ds = nxt[s2]
            if c2 < best:
                front.append((s2, c2, ds))
                best = c2
    feasible = [(c, ds) for s, c, ds in front if top - s <= budget]
    if not feasible:
        return None
    return list(min(feasible, key=lambda t: t[0])[1])


def solve_milp(
    blocks: Sequence[BlockCosts], top: int, budget: int, allowed: Sequence[str]
) -> list[str] | None:
    """Exact optimum with HiGHS (``scipy.optimize.milp``); ``None`` when infeasible."""
    try:
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "remat.plan with solver='milp' needs scipy: pip install 'remat[plan]' "
            "(or pass solver='dp')."
        ) from e
    opts = _choices(blocks, allowed)
    index = [(i, d) for i, ds in enumerate(opts) for d in ds]
    col = {k: j for j, k in enumerate(index)}
    n = len(index)
    c = np.array([blocks[i].cost[d] for i, d in index], dtype=float)
    rows: list[Any] = []
    lo: list[float] = []
    hi: list[float] = []
    for i, ds in enumerate(opts):  # one decision per block
        r = np.zeros(n)
        for d in ds:
            r[col[(i, d)]] = 1
        rows.append(r)
        lo.append(1)
        hi.append(1)

    def saved_row(upto: int) -> Any:
        r = np.zeros(n)
        for j in range(upto):
            for d in opts[j]:
                r[col[(j, d)]] = blocks[j].retained["keep"] - blocks[j].retained[d]
        return r

    for i, b in enumerate(blocks):
        # fwd_start - saved(i-1) + fwd_excess[d_i] <= budget
        r = -saved_row(i)
        for d in opts[i]:
            r[col[(i, d)]] += b.fwd_excess[d]
        rows.append(r)
        lo.append(-np.inf)
        hi.append(budget - b.fwd_start)
        # bwd_start - saved(i) + bwd_excess[d_i] <= budget
        r = -saved_row(i + 1)
        for d in opts[i]:
            r[col[(i, d)]] += b.bwd_excess[d]
        rows.append(r)
        lo.append(-np.inf)
        hi.append(budget - b.bwd_start)
    rows.append(-saved_row(len(blocks)))
    lo.append(-np.inf)
    hi.append(budget - top)
    res = milp(
        c,
        constraints=LinearConstraint(np.array(rows), np.array(lo), np.array(hi)),
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
    )
    if res.status != 0 or res.x is None:
        return None
    out = ["keep"] * len(blocks)
    for (i, d), v in zip(index, res.x):
        if v > 0.5:
            out[i] = d
    return out


def smallest_peak(blocks: Sequence[BlockCosts], top: int, allowed: Sequence[str]) -> int:
    """The smallest predicted peak any plan reaches (exact, by the same DP with no budget)."""
    front: dict[int, int] = {0: 0}  # saved -> smallest peak so far
    for b, opts in zip(blocks, _choices(blocks, allowed)):
        nxt: dict[int, int] = {}
        for saved, peak in front.items():
            for d in opts:
                p = max(peak, b.fwd_start - saved + b.fwd_excess[d])
                s2 = saved + b.retained["keep"] - b.retained[d]
                p = max(p, b.bwd_start - s2 + b.bwd_excess[d])
                if s2 not in nxt or p < nxt[s2]:
                    nxt[s2] = p
        front = nxt
    return min(max(p, top - s) for s, p in front.items())


def brute_force(
    blocks: Sequence[BlockCosts], top: int, budget: int, allowed: Sequence[str]
) -> list[str] | None:
    """Every plan, for tests on small chains."""
    best: tuple[float, list[str]] | None = None
    for ds in itertools.product(*_choices(blocks, allowed)):
        if predicted_peak(blocks, top, ds) <= budget:
            c = predicted_cost(blocks, ds)
            if best is None or c < best[0]:
                best = (c, list(ds))
    return None if best is None else best[1]


@dataclasses.dataclass
class Plan:
    """One decision per candidate block, with what the model predicts for it.

    Attributes:
        decisions: block name -> ``keep`` / ``recompute`` / ``selective`` / ``offload``.
        predicted_peak_bytes: predicted peak of a step under this plan.
        predicted_overhead_s: predicted added time per step (FLOPs when the
            profile was made with ``timer="flops"``; see ``cost_unit``).
        unchecked_peak_bytes: measured peak with every block kept.
        budget_bytes: the budget the plan was made for.
        saved_bytes: block name -> bytes the decision saves at the peak.
        added_cost: block name -> time (or FLOPs) the decision adds.
        cost_unit: ``"s"`` or ``"flop"``.
    """

    decisions: dict[str, str]
    predicted_peak_bytes: int
    predicted_overhead_s: float
    unchecked_peak_bytes: int
    budget_bytes: int
    saved_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    added_cost: dict[str, float] = dataclasses.field(default_factory=dict)
    cost_unit: str = "s"

    def to_json(self) -> str:
        """Plain JSON (no pickle)."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json`."""
        data = json.loads(text)
        bad = sorted(set(data.get("decisions", {}).values()) - set(DECISIONS))
        if bad:
            raise PlanError(f"Plan.from_json: unknown decisions {bad}; expected {list(DECISIONS)}.")
        return cls(**data)

    def apply(self, model: Any) -> Any:
        """Checkpoint ``model``'s blocks in place as decided; returns the model."""
        from ._apply import apply_plan

        return apply_plan(self, model)

    def __str__(self) -> str:
        unit = "s" if self.cost_unit == "s" else "FLOP"
        w = max([len("module")] + [len(n) for n in self.decisions])
        lines = [f"{'module':<{w}}  {'decision':<10}{'saves':>12}{'adds':>14}"]
        for name, d in self.decisions.items():
            add = self.added_cost.get(name, 0.0)
            add_s = f"{add * 1e3:.2f} ms" if unit == "s" else f"{add:.3g} FLOP"
            lines.append(
                f"{name:<{w}}  {d:<10}{_fmt(self.saved_bytes.get(name, 0)):>12}{add_s:>14}"
            )
        total = sum(self.added_cost.values())
        total_s = f"{total * 1e3:.2f} ms" if unit == "s" else f"{total:.3g} FLOP"
        lines.append(
            f"{'total':<{w}}  {'':<10}{_fmt(sum(self.saved_bytes.values())):>12}{total_s:>14}"
        )
        lines.append(
            f"predicted peak {_fmt(self.predicted_peak_bytes)} vs unchecked "
            f"{_fmt(self.unchecked_peak_bytes)} (budget {_fmt(self.budget_bytes)})"
        )
        return "\n".join(lines)


def _fmt(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


_SIMPLER = ("keep", "selective", "recompute", "offload")


def _prefer_simple(
    blocks: Sequence[BlockCosts], top: int, budget: int, decisions: list[str]
) -> list[str]:
    """Among equal-cost choices keep the simplest (keep, then selective, ...) that still fits."""
    out = list(decisions)
    for i, b in enumerate(blocks):
        for d in _SIMPLER:
            if d == out[i]:
                break
            if d in b.cost and d in b.retained and b.cost[d] <= b.cost[out[i]]:
                trial = [*out[:i], d, *out[i + 1 :]]
                if predicted_peak(blocks, top, trial) <= budget:
                    out = trial
                    break
    return out


def plan(profile: Any, budget: int | float | str, *, solver: str = "auto") -> Plan:
    """Choose one decision per block: least predicted added time with predicted peak <= budget.

    Args:
        profile: a :class:`~remat.Profile` from :func:`remat.profile`.
        budget: bytes of activation memory (an int, or ``"18GiB"``), or a
            percentage above ``0%`` of the profile's unchecked activation peak
            (``"60%"``). Anything else raises ``ValueError``/``TypeError`` naming it.
        solver: ``"milp"`` (HiGHS via scipy, the ``remat[plan]`` extra),
            ``"dp"`` (exact dynamic program, no dependency) or ``"auto"``
            (milp when scipy is installed, else dp). Both are exact.

    Returns:
        A :class:`Plan`.

    Raises:
        PlanError: when no plan reaches the budget; the message gives the
            smallest reachable peak.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
        >>> prof = remat.profile(model, torch.randn(8, 16), timer="flops")
        >>> p = remat.plan(prof, "100%")
        >>> set(p.decisions.values())
        {'keep'}
    """
    blocks = profile.blocks
    allowed = list(profile.decisions)
    budget_bytes = parse_budget(budget, profile.unchecked_peak_bytes)
    if solver not in ("auto", "milp", "dp"):
        raise ValueError(f"remat.plan: solver must be 'auto', 'milp' or 'dp', got {solver!r}.")
    if solver == "auto":
        try:
            import scipy.optimize  # noqa: F401

            solver = "milp"
        except ImportError:
            solver = "dp"
    solve = solve_milp if solver == "milp" else solve_dp
    decisions = solve(blocks, profile.top, budget_bytes, allowed)
    if decisions is None:
        lo = smallest_peak(blocks, profile.top, allowed)
        raise PlanError(
            f"remat.plan: no plan keeps the predicted peak within {_fmt(budget_bytes)}; the smallest "
            f"reachable peak is {_fmt(lo)} ({lo} bytes, "
            f"{100 * lo / max(profile.unchecked_peak_bytes, 1):.0f}% of the unchecked "
            f"{_fmt(profile.unchecked_peak_bytes)}). Raise the budget, use a smaller batch, or "
            "profile finer-grained blocks (check_fn=...)."
        )
    decisions = _prefer_simple(blocks, profile.top, budget_bytes, decisions)
    return Plan(
        decisions={b.name: d for b, d in zip(blocks, decisions)},
        predicted_peak_bytes=predicted_peak(blocks, profile.top, decisions),
        predicted_overhead_s=predicted_cost(blocks, decisions),
        unchecked_peak_bytes=profile.unchecked_peak_bytes,
        budget_bytes=budget_bytes,
        saved_bytes={b.name: b.retained["keep"] - b.retained[d] for b, d in zip(blocks, decisions)},
        added_cost={b.name: float(b.cost[d]) for b, d in zip(blocks, decisions)},
        cost_unit=profile.cost_unit,
    )
