"""``remat.plan`` and :class:`Plan`: decisions chosen by the solver, with the model's prediction."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .._errors import PlanError
from .apply import apply_plan
from .model import DECISIONS, fmt_bytes, parse_budget, predicted_cost, predicted_peak
from .solve import prefer_simple, smallest_peak, solve_dp, solve_milp


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
        return apply_plan(self, model)

    def __str__(self) -> str:
        unit = "s" if self.cost_unit == "s" else "FLOP"
        w = max([len("module")] + [len(n) for n in self.decisions])
        lines = [f"{'module':<{w}}  {'decision':<10}{'saves':>12}{'adds':>14}"]
        for name, d in self.decisions.items():
            add = self.added_cost.get(name, 0.0)
            add_s = f"{add * 1e3:.2f} ms" if unit == "s" else f"{add:.3g} FLOP"
            lines.append(
                f"{name:<{w}}  {d:<10}{fmt_bytes(self.saved_bytes.get(name, 0)):>12}{add_s:>14}"
            )
        total = sum(self.added_cost.values())
        total_s = f"{total * 1e3:.2f} ms" if unit == "s" else f"{total:.3g} FLOP"
        lines.append(
            f"{'total':<{w}}  {'':<10}{fmt_bytes(sum(self.saved_bytes.values())):>12}{total_s:>14}"
        )
        lines.append(
            f"predicted peak {fmt_bytes(self.predicted_peak_bytes)} vs unchecked "
            f"{fmt_bytes(self.unchecked_peak_bytes)} (budget {fmt_bytes(self.budget_bytes)})"
        )
        return "\n".join(lines)



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
            f"remat.plan: no plan keeps the predicted peak within {fmt_bytes(budget_bytes)}; the smallest "
            f"reachable peak is {fmt_bytes(lo)} ({lo} bytes, "
            f"{100 * lo / max(profile.unchecked_peak_bytes, 1):.0f}% of the unchecked "
            f"{fmt_bytes(profile.unchecked_peak_bytes)}). Raise the budget, use a smaller batch, or "
            "profile finer-grained blocks (check_fn=...)."
        )
    decisions = prefer_simple(blocks, profile.top, budget_bytes, decisions)
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
