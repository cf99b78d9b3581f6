"""What each decision costs a block: modelled seconds, measured seconds, or FLOPs.

* ``timer="time"`` (the default), :func:`modelled_costs`: the block's counted work
  (:mod:`remat.planner.counting`) priced by the device's calibrated constants
  (:mod:`remat.planner.calibration`). Why a model rather than a stopwatch: two decisions
  of a block often cost within a few per cent of each other (``recompute`` against
  ``selective``), while timing a block on a shared machine moves by 5-20 % from one
  process to the next, so timed costs flip plans between runs (issue 22 measured 5 of
  23 plannings flipping). Counts do not move, and the constants are timed once and
  cached, so the plan is a function of the model, the inputs, the budget and the cache
  file. The noise of these costs is 0: near-ties are exact ties, broken toward the
  simpler plan by :mod:`remat.planner.solve`.
* ``timer="measured"``, :func:`time_blocks`: each block's forward+backward timed in
  ``repeats`` steps (thread CPU time on CPU with one thread, else wall time around
  synchronised boundaries), its cost the median and its noise half the range; the
  planner breaks near-ties within that noise toward the simpler plan.
* ``timer="flops"``, :func:`flop_costs`: FLOPs recomputed, machine-independent.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..engine.tree import tensors_in
from .calibration import Constants, constants, num_threads
from .counting import OpCount, count_blocks
from .types import Decision


class BlockTimer:
    """Per-block forward and backward time from module and gradient hooks."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.fwd: dict[str, float] = {}
        self.bwd: dict[str, float] = {}
        self.handles: list[Any] = []

    def attach(self, name: str, module: nn.Module) -> None:
        starts: dict[str, float] = {}

        def pre(mod: Any, args: Any) -> None:
            starts["fwd"] = self.clock()

        def post(mod: Any, args: Any, out: Any) -> None:
            self.fwd[name] = self.clock() - starts["fwd"]
            outs: list[torch.Tensor] = []
            ins: list[torch.Tensor] = []
            tensors_in(out, outs)
            tensors_in(args, ins)
            outs = [t for t in outs if t.requires_grad]
            ends = [t for t in ins if t.requires_grad] or [
                p for p in mod.parameters() if p.requires_grad
            ]
            if outs and ends:

                def b_start(_: Any) -> None:
                    starts.setdefault("bwd", self.clock())

                def b_end(_: Any) -> None:
                    self.bwd[name] = self.clock() - starts.pop("bwd", self.clock())

                torch.autograd.graph.register_multi_grad_hook(outs, b_start, mode="any")
                torch.autograd.graph.register_multi_grad_hook(ends, b_end, mode="all")

        self.handles.append(module.register_forward_pre_hook(pre))
        self.handles.append(module.register_forward_hook(post))

    def totals(self) -> dict[str, float]:
        """Forward plus backward time of each block in the last step."""
        return {n: self.fwd.get(n, 0.0) + self.bwd.get(n, 0.0) for n in self.fwd}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def time_blocks(
    blocks: dict[str, nn.Module],
    step: Callable[[], None],
    device: torch.device,
    repeats: int,
    clock: Callable[[], float],
    threads: int | None,
) -> tuple[dict[str, float], dict[str, float]]:
    """Each block's forward+backward time over ``repeats`` steps: (median, half the range)."""
    samples: dict[str, list[float]] = {}
    timer = BlockTimer(clock)
    for n, m in blocks.items():
        timer.attach(n, m)
    try:
        with num_threads(device, threads):
            for _ in range(repeats):
                timer.fwd.clear()
                timer.bwd.clear()
                step()
                for n, t in timer.totals().items():
                    samples.setdefault(n, []).append(t)
    finally:
        timer.remove()
    median = {n: statistics.median(v) for n, v in samples.items()}
    noise = {n: (max(v) - min(v)) / 2 for n, v in samples.items()}
    return median, noise


def flop_costs(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    args: Any,
    kwargs: Any,
    loss_fn: Any,
    decisions: Sequence[Decision],
) -> dict[Decision, dict[str, float]]:
    """FLOPs each decision recomputes: the block's forward FLOPs (``recompute``), twice that
    (``split``), and those of the operators the planner's selective policy does not serve
    from its cache (``selective``: counted under the policy itself, so a matmul output it
    recomputes because the block changes it in place, as ``nn.GRU`` does, counts)."""
    _, counts = count_blocks(model, blocks, args, kwargs)
    out: dict[Decision, dict[str, float]] = {d: {} for d in decisions}
    for n, calls in counts.items():
        total = float(sum(c.flops for c in calls))
        unsaved = float(sum(c.flops for c in calls if not c.saved))
        costs = decision_costs(recompute=total, selective=unsaved, offload=0.0)
        for d in decisions:
            out[d][n] = costs[d]
    return out


def decision_costs(*, recompute: float, selective: float, offload: float) -> dict[Decision, float]:
    """What each decision adds to one block, from the cost of running its forward again
    (``recompute``), under the selective policy (``selective``) and of its copies to the
    host and back (``offload``): ``keep`` adds nothing, ``split`` runs the block again, then
    each child again for its backward (twice ``recompute``)."""
    return {
        Decision.KEEP: 0.0,
        Decision.RECOMPUTE: recompute,
        Decision.SELECTIVE: selective,
        Decision.OFFLOAD: offload,
        Decision.SPLIT: 2 * recompute,
    }


def modelled_costs(
    model: nn.Module,
    blocks: dict[str, nn.Module],
    args: Any,
    kwargs: Any,
    decisions: Sequence[Decision],
    device: torch.device,
    threads: int | None,
    offloaded: dict[str, int] | None = None,
    calibration: str | None = None,
) -> tuple[dict[Decision, dict[str, float]], float]:
    """Seconds each decision adds to each block, from counted work and the device's
    calibrated constants, and the predicted time of a whole step with every block kept.

    With the constants ``K`` of the operator's dtype (:mod:`remat.planner.calibration`),
    one call ``c`` computes for ``t(c) = c.flops / K.rate[c.kind] + c.bytes / K.byte_rate``;

    * ``recompute``: the block's forward again, ``sum(t(c) + K.per_op) + K.region``;
    * ``selective``: ``sum(K.saved_op)`` over the calls the policy's cache saves, plus
      ``sum(t(c) + K.recomputed_op)`` over those it recomputes, plus
      ``K.selective_region``: the cache's bookkeeping on every call, in forward and in
      recompute, is what makes ``selective`` slower than ``recompute`` on blocks of many
      small operators, and counted calls see it;
    * ``split``: twice ``recompute`` (the block again, then each child again);
    * ``offload``: the bytes it moves to the host (``offloaded``: what the block keeps
      under ``keep`` less what it keeps under ``offload``, measured) out and back, at the
      calibrated copy rate, an upper bound (copies overlap compute on their own stream);
    * the step: the whole forward's ``sum(t(c) + K.per_op)`` and its backward (twice each
      call's FLOPs, its bytes again, nothing for a random draw), for the predicted time
      ratio ``1 + overhead / step_cost``.

    Every term is a function of counts and of cached constants, so it is the same in every
    process that reads the same calibration (the design note of
    :mod:`remat.planner.calibration`).
    """
    whole, counts = count_blocks(model, blocks, args, kwargs)
    known: dict[torch.dtype | None, Constants] = {}

    def k(dtype: torch.dtype | None) -> Constants:
        key = dtype if dtype in CALIBRATED else torch.float32
        if key not in known:
            known[key] = constants(device, key, threads, calibration)
        return known[key]

    def run(c: OpCount) -> float:
        return k(c.dtype).op_seconds(c.kind, c.flops, c.bytes)

    base = k(torch.float32)
    out: dict[Decision, dict[str, float]] = {d: {} for d in decisions}
    for n, calls in counts.items():
        again = sum(run(c) + k(c.dtype).per_op for c in calls) + base.region
        sel = base.selective_region + sum(
            k(c.dtype).saved_op if c.saved else run(c) + k(c.dtype).recomputed_op
            for c in calls
        )
        # a copy counts its source and destination bytes (as the counter counts one, and as
        # host_rate was calibrated), out and back
        moved = 4 * (offloaded or {}).get(n, 0)
        costs = decision_costs(recompute=again, selective=sel, offload=moved / base.host_rate)
        for d in decisions:
            out[d][n] = costs[d]
    step = sum(run(c) + k(c.dtype).per_op + _backward(c, k(c.dtype)) for c in whole)
    return out, step


def _backward(c: OpCount, k: Constants) -> float:
    """An operator's share of backward: twice its FLOPs (the gradients of both operands),
    its bytes again (a pointwise gradient), nothing for a random draw (its mask is kept)."""
    if c.kind == "random":
        return 0.0
    return k.op_seconds(c.kind, 2 * c.flops, c.bytes) + k.per_op


#: The dtypes calibrated on their own; operators of other dtypes are priced as float32.
CALIBRATED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
