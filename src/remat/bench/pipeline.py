"""A GPT split into pipeline stages, run by ``torch.distributed.pipelining`` on one rank per
stage: what the pipeline benchmark, its tests and ``examples/pipeline_plan.py`` run.

Every rank calls :func:`run_rank` under an initialized process group (gloo on CPU): it
builds its :class:`~remat.bench.models.GPTStage` inside a :mod:`remat.memory` tracker (so
the rank's peak is absolute: parameters, gradients, optimizer state, the schedule's buffers,
the batch and the activations), checkpoints it as ``strategy`` says, and runs a few steps of
``optimizer.zero_grad(); schedule.step(...); optimizer.step()``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import memory
from ..planner.pipeline import StagePlan, StageShapePlans, plan_pipeline_stage
from ..planner.shapes import Shapes
from ..planner.types import Decision, Timer
from .models import GPT, GPTStage, ModelConfig, build, lm_loss

STRATEGIES = ("remat", "every_layer", "none")
"""remat's plan for the rank's budget, every block checkpointed, none checkpointed."""


@dataclasses.dataclass
class RankResult:
    """What one rank measured.

    Attributes:
        rank: the rank (its stage's index).
        peak_bytes: the largest peak of the measured steps (absolute).
        predicted_bytes: the plan's prediction (``remat``; else ``None``).
        budget_bytes: the rank's budget (``None`` without one).
        decisions: block name -> decision.
        spans: ``[first, last]`` block names of each span of the plan (one checkpoint over
            them; their blocks run as their decision says inside it).
        step_times: wall time of each step after the first.
        step_cpu_times: the process's CPU time of each of them.
        grads: the stage's gradients of the step after the measured ones (when asked).
        plan: the plan's JSON (``remat``).
    """

    rank: int
    peak_bytes: int
    predicted_bytes: int | None
    budget_bytes: int | None
    decisions: dict[str, str]
    step_times: list[float]
    step_cpu_times: list[float] = dataclasses.field(default_factory=list)
    spans: list[list[str]] = dataclasses.field(default_factory=list)
    grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    plan: str = ""


def _schedule_class(name: str) -> Any:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]


def _meta(shape: tuple[int, ...], dtype: torch.dtype, grad: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def microbatch(cfg: ModelConfig, stage: int, stages: int, microbatches: int) -> tuple[Any, Any]:
    """One microbatch's example input of ``stage`` (tokens, or a received activation) and
    target (the last stage's; else ``None``)."""
    mb = cfg.batch // microbatches
    x: torch.Tensor = (
        torch.zeros(mb, cfg.seq, dtype=torch.long)
        if stage == 0
        else torch.zeros(mb, cfg.seq, cfg.d_model)
    )
    y = torch.zeros(mb, cfg.seq, dtype=torch.long) if stage == stages - 1 else None
    return x, y


def _step(
    sched: Any,
    opt: torch.optim.Optimizer,
    i: int,
    x: Any,
    y: Any,
    *,
    before: Callable[[], None] | None = None,
    optimizer_step: bool = True,
    return_outputs: bool = True,
) -> None:
    """``zero_grad()``, ``before()`` (the tracker's peak reset), the schedule's step
    (dropout seeded by ``i``), ``optimizer.step()``."""
    opt.zero_grad()
    torch.manual_seed(100 + i)
    if before is not None:
        before()
    if x is not None:
        sched.step(x, return_outputs=return_outputs)
    elif y is not None:
        sched.step(target=y, return_outputs=return_outputs)
    else:
        sched.step(return_outputs=return_outputs)
    if optimizer_step:
        opt.step()


def needs_every_layer_below(
    cfg: ModelConfig,
    *,
    rank: int,
    stages: int,
    schedule: str,
    microbatches: int,
    seed: int = 0,
    return_outputs: bool = True,
    timer: Timer = "time",
) -> tuple[int, int]:
    """Stage ``rank``'s predicted peak with every block recomputed, and the smallest budget
    at which its plan (:func:`~remat.planner.pipeline.solve.solve_stage`, priced by
    ``timer`` as :func:`run_rank`'s plans are) costs less than that: below it, this stage
    needs every layer. Nothing runs but the stage's profile.

    Example:
        >>> cfg = ModelConfig(layers=2, d_model=16, seq=128, batch=4, heads=2, vocab=32)
        >>> every, less = needs_every_layer_below(cfg, rank=0, stages=2, schedule="1f1b",
        ...     microbatches=2, timer="flops")
        >>> every < less
        True
    """
    from ..planner.pipeline.measure import profile_stage
    from ..planner.pipeline.solve import solve_stage
    from ..planner.stepmodel import predicted_cost
    from ..planner.stepmodel.stage import stage_peak

    example, target = microbatch(cfg, rank, stages, microbatches)
    gpt = build(cfg, seed=seed)
    assert isinstance(gpt, GPT)
    module = GPTStage(gpt, rank, stages)
    del gpt
    sp = profile_stage(
        module,
        (example,),
        schedule=schedule,
        stage=rank,
        stages=stages,
        microbatches=microbatches,
        loss_fn=lm_loss if target is not None else None,
        target=target,
        optimizer=torch.optim.AdamW(module.parameters()),
        return_outputs=return_outputs,
        timer=timer,
    )
    blocks = sp.freed.blocks

    def peak(d: Decision) -> int:
        return stage_peak(sp.freed, sp.kept, sp.sizes, sp.events, [d] * len(blocks)).bytes

    every = predicted_cost(blocks, [Decision.RECOMPUTE] * len(blocks), [])
    # bisect: the plans' costs do not rise with the budget
    low, high = peak(Decision.RECOMPUTE), peak(Decision.KEEP)
    while low < high:
        mid = (low + high) // 2
        plan = solve_stage(sp, mid)
        if predicted_cost(blocks, list(plan.decisions.values()), plan.block_spans) < every:
            high = mid
        else:
            low = mid + 1
    return peak(Decision.RECOMPUTE), high


def _run_steps(
    module: nn.Module,
    opt: torch.optim.Optimizer,
    tracker: Any,
    cfg: ModelConfig,
    seq: int,
    *,
    rank: int,
    stages: int,
    schedule: str,
    microbatches: int,
    steps: int,
    grads: bool,
    return_outputs: bool,
) -> tuple[int, list[float], list[float], dict[str, torch.Tensor]]:
    """Build the ``PipelineStage`` and schedule of ``module`` for microbatches of ``seq``
    tokens and run ``steps`` steps of a batch of ``cfg.batch`` sequences under ``tracker``:
    the largest peak, each step's wall and CPU time after the first, and (``grads``) the
    gradients of one more step, unmeasured, its optimizer step not taken."""
    from torch.distributed.pipelining import PipelineStage

    first, last = rank == 0, rank == stages - 1
    mb = cfg.batch // microbatches
    example = microbatch(dataclasses.replace(cfg, seq=seq), rank, stages, microbatches)[0]
    out_dim = cfg.vocab if last else cfg.d_model
    stage = PipelineStage(
        module,
        rank,
        stages,
        torch.device("cpu"),
        input_args=_meta(tuple(example.shape), example.dtype, not first),
        output_args=_meta((mb, seq, out_dim), torch.float32, True),
    )
    del example
    sched = _schedule_class(schedule)(stage, microbatches, loss_fn=lm_loss)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, seq + 1), generator=g)
    x = tokens[:, :-1].contiguous() if first else None
    y = tokens[:, 1:].contiguous() if last else None
    del tokens
    peak, times, cpu = 0, [], []
    for i in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        _step(sched, opt, i, x, y, before=tracker.reset_peak, return_outputs=return_outputs)
        if i:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        peak = max(peak, tracker.peak_bytes)
    found: dict[str, torch.Tensor] = {}
    if grads:
        _step(sched, opt, steps, x, y, optimizer_step=False, return_outputs=return_outputs)
        found = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return peak, times, cpu, found


def run_rank(
    cfg: ModelConfig,
    *,
    rank: int,
    stages: int,
    schedule: str,
    microbatches: int,
    strategy: str,
    budget: int | None = None,
    steps: int = 3,
    grads: bool = False,
    timer: Timer = "time",
    seed: int = 0,
    return_outputs: bool = True,
    plan: StagePlan | None = None,
) -> RankResult:
    """Run ``steps`` training steps of stage ``rank`` of ``stages`` (one rank each).

    Args:
        cfg: the GPT (``batch`` is the whole batch of a step, split in ``microbatches``).
        rank: this rank, the stage it runs.
        stages: ranks in the pipeline.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        microbatches: per step.
        strategy: ``"remat"`` (planned for ``budget``), ``"every_layer"``, ``"none"``.
        budget: the rank's budget (``remat``).
        steps: steps measured (the first creates the optimizer's state).
        grads: return the gradients of one more step after them (unmeasured; its optimizer
            step not taken).
        timer: the planner's cost measure.
        seed: the weights' seed (the dropout's is fixed per step).
        return_outputs: ``schedule.step(return_outputs=...)``.
        plan: ``remat``: this plan (of an earlier run of the same stage) applied, none made.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if strategy != "remat":
        plan = None
    example, example_target = microbatch(cfg, rank, stages, microbatches)
    with memory.track() as tracker:
        gpt = build(cfg, seed=seed)
        assert isinstance(gpt, GPT)
        module = GPTStage(gpt, rank, stages)
        del gpt  # the other stages' modules are freed
        opt = torch.optim.AdamW(module.parameters())
        if strategy == "remat" and plan is not None:
            plan.apply(module)
        elif strategy == "remat":
            if budget is None:
                raise ValueError("strategy 'remat' needs a budget.")
            plan = plan_pipeline_stage(
                module,
                example,
                stage_index=rank,
                num_stages=stages,
                schedule=schedule,
                microbatches=microbatches,
                budget=budget,
                loss_fn=lm_loss,
                target=example_target,
                optimizer=opt,
                timer=timer,
                return_outputs=return_outputs,
            )
            plan.apply(module)
        elif strategy == "every_layer":
            from ..planner.apply import apply_decision

            for block in module.blocks:
                apply_decision(block, Decision.RECOMPUTE)
        del example, example_target
        ran = _run_steps(
            module, opt, tracker, cfg, cfg.seq, rank=rank, stages=stages, schedule=schedule,
            microbatches=microbatches, steps=steps, grads=grads, return_outputs=return_outputs,
        )  # fmt: skip
    peak, times, cpu, first_grads = ran
    decisions = (
        {n: str(d) for n, d in plan.decisions.items()}
        if plan
        else {
            f"blocks.{i}": "recompute" if strategy == "every_layer" else "keep"
            for i in range(len(module.blocks))
        }
    )
    return RankResult(
        rank=rank,
        peak_bytes=peak,
        predicted_bytes=plan.predicted_peak_bytes if plan else None,
        budget_bytes=budget,
        decisions=decisions,
        step_times=times,
        step_cpu_times=cpu,
        spans=[list(sp) for sp in plan.spans] if plan else [],
        grads=first_grads,
        plan=plan.to_json() if plan else "",
    )


def run_rank_shapes(
    cfg: ModelConfig,
    *,
    rank: int,
    stages: int,
    schedule: str,
    microbatches: int,
    seqs: Sequence[int],
    shapes: Shapes | None,
    budget: int | None = None,
    steps: int = 3,
    grads: bool = False,
    timer: Timer = "time",
    seed: int = 0,
) -> dict[int, RankResult]:
    """Stage ``rank`` planned for microbatches of several lengths (``cfg.seq`` the largest:
    ``plan_pipeline_stage(..., shapes=shapes)``; ``shapes=None``: no checkpointing), then, for
    each length of ``seqs`` in turn, its schedule built for that length and ``steps`` steps
    run (as :func:`run_rank` does), all on one stage module and optimizer: each length's
    result, its prediction the plan that length runs (``StageShapePlans.plan_for``)."""
    out: dict[int, RankResult] = {}
    with memory.track() as tracker:
        gpt = build(cfg, seed=seed)
        assert isinstance(gpt, GPT)
        module = GPTStage(gpt, rank, stages)
        del gpt
        opt = torch.optim.AdamW(module.parameters())
        plans: StageShapePlans | None = None
        if shapes is not None:
            if budget is None:
                raise ValueError("run_rank_shapes: shapes needs a budget.")
            example, target = microbatch(cfg, rank, stages, microbatches)
            plans = plan_pipeline_stage(
                module, example, stage_index=rank, num_stages=stages, schedule=schedule,
                microbatches=microbatches, budget=budget, loss_fn=lm_loss, target=target,
                optimizer=opt, timer=timer, shapes=shapes,
            )  # fmt: skip
            del example, target
            plans.apply(module)
        for seq in seqs:
            peak, times, cpu, _ = _run_steps(
                module, opt, tracker, cfg, seq, rank=rank, stages=stages, schedule=schedule,
                microbatches=microbatches, steps=steps, grads=False, return_outputs=True,
            )  # fmt: skip
            plan = plans.plan_for(seq) if plans is not None else None
            out[seq] = RankResult(
                rank=rank,
                peak_bytes=peak,
                predicted_bytes=plan.predicted_peak_bytes if plan else None,
                budget_bytes=budget,
                decisions={n: str(d) for n, d in plan.decisions.items()} if plan else {},
                step_times=times,
                step_cpu_times=cpu,
                spans=[list(sp) for sp in plan.spans] if plan else [],
                plan=plan.to_json() if plan else "",
            )
        # the gradients after every length was measured (their copies, kept for the
        # caller, would be counted in the later lengths' peaks)
        for seq in seqs if grads else ():
            out[seq].grads = _run_steps(
                module, opt, tracker, cfg, seq, rank=rank, stages=stages, schedule=schedule,
                microbatches=microbatches, steps=0, grads=True, return_outputs=True,
            )[3]  # fmt: skip
        if plans is not None:
            plans.remove()
    return out
