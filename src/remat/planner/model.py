"""The planner: one decision per block so the predicted peak fits a budget at least cost.

Model
-----
The candidates are a chain of blocks run in order in forward and in reverse
order in backward (a transformer's layers). For block ``i`` and decision
``d`` in ``keep``, ``recompute``, ``selective``, ``offload`` the profile
(:mod:`remat.planner.measure`) measures

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
import math
import re
from collections.abc import Sequence

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



def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


