"""Variable-length batches: plans switched per batch size vs one plan for the longest batch.

The built-in GPT (``remat.bench.models``, default size, ``seq=1024``) trains with AdamW in
the default loop (``zero_grad()``, forward, loss, backward, ``step()``) on 48 batches whose
sequence lengths are log-normal (median 192, sigma 0.7, seed 0) clipped to [32, 1024]: a
fine-tuning mix, mostly short with a long tail. A batch of length ``L`` is ``(batch, L + 1)``
tokens (the model reads ``L`` positions). The budget is ``"40%"`` of the step at length 1024
(:func:`remat.plan`'s percentage, of what that unchecked step allocates above its static
bytes). Three runs from the same weights, on the same batches:

* ``adaptive``: ``remat.auto_checkpoint(..., shapes=remat.Shapes(dims=1, multiple=32))``: the
  plan for each batch's length switched in before its forward;
* ``longest``: ``remat.auto_checkpoint`` on the workload's longest batch, for the same budget
  in bytes: one plan for all;
* ``torch_every_block``: ``torch.utils.checkpoint`` (non-reentrant) on every block.

Each step's peak is :func:`remat.measure_peak`'s (absolute bytes, the budget's units), taken
before the step (it puts everything back); ``time_s`` is the wall time of the step itself
(forward, backward, optimizer step), taken apart from the peak. Plans are made before the
timed steps (planning time is reported apart: ``plan_time_s``). Every step's gradients are
compared bitwise with those of an unchecked copy of the model on the same batch, weights and
RNG state (``grads_bitwise``; the unchecked steps run once, their gradients' SHA-256 kept).
The adaptive run also records, per step, whether its plan checkpoints any block
(``checkpointed``).

Run: python benchmarks/varlen.py --json varlen.json [--quick]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat
from remat.bench.models import ModelConfig, build
from remat.bench.runner import load_average


@dataclasses.dataclass(frozen=True)
class Workload:
    """The model, the lengths and the budget of one benchmark."""

    cfg: ModelConfig
    steps: int
    median: float
    sigma: float
    low: int
    high: int
    budget: str
    timer: str
    multiple: int


FULL = Workload(ModelConfig(seq=1024), 48, 192.0, 0.7, 32, 1024, "40%", "time", 32)
QUICK = Workload(
    ModelConfig(layers=3, d_model=32, seq=64, batch=2, heads=2, vocab=64), 6, 16.0, 0.7, 8, 64,
    "40%", "flops", 4,
)  # fmt: skip


def lengths(w: Workload, seed: int = 0) -> list[int]:
    """The sequence lengths: log-normal (median, sigma), rounded, clipped to [low, high]."""
    rng = random.Random(seed)
    return [
        min(w.high, max(w.low, round(rng.lognormvariate(math.log(w.median), w.sigma))))
        for _ in range(w.steps)
    ]


def batches(w: Workload, seed: int = 1) -> list[torch.Tensor]:
    """One batch of ``(batch, length + 1)`` tokens per step."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, w.cfg.vocab, (w.cfg.batch, n + 1), generator=g) for n in lengths(w)]


def grads_digest(model: torch.nn.Module) -> str:
    """A SHA-256 of every parameter's gradient, bytes as they are (bitwise equality)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(b"none" if p.grad is None else p.grad.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _torch_every_block(model: Any) -> None:
    def run(i: int, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint(block, x, use_reentrant=False)  # type: ignore[no-any-return]

    model.run_block = run


def run(
    name: str,
    w: Workload,
    data: list[torch.Tensor],
    setup: Callable[[torch.nn.Module, torch.optim.Optimizer, torch.Tensor], Any],
    digests: list[str],
) -> dict[str, Any]:
    """One run: fresh model and AdamW, ``setup`` (planning), then every step measured.

    ``digests``: per step, the unchecked model's gradients (:func:`grads_digest`); empty, they
    are computed here (an unchecked copy of the model on the same batch, weights and RNG
    state) and appended: the runs' weights stay equal as long as their gradients are.
    """
    model = build(w.cfg)
    reference = copy.deepcopy(model) if not digests else None
    opt = torch.optim.AdamW(model.parameters())
    longest = max(data, key=lambda b: b.shape[1])
    t0 = time.perf_counter()
    plans = setup(model, opt, longest)
    if isinstance(plans, remat.ShapePlans):  # every plan made (and bucket profiled) now
        for b in data:
            plans.plan_for(b.shape[1])
    plan_time = time.perf_counter() - t0
    steps = []
    bitwise = True
    for i, batch in enumerate(data):
        peak = remat.measure_peak(model, batch, optimizer=opt)
        if reference is not None:
            reference.load_state_dict(model.state_dict())
            reference.zero_grad(set_to_none=True)
            torch.manual_seed(i)
            reference(batch).backward()
            digests.append(grads_digest(reference))
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        t = time.perf_counter()
        loss = model(batch)
        loss.backward()
        elapsed = time.perf_counter() - t
        bitwise &= grads_digest(model) == digests[i]
        t = time.perf_counter()
        opt.step()
        elapsed += time.perf_counter() - t
        row: dict[str, Any] = {"tokens": batch.shape[1] - 1, "peak_bytes": peak, "time_s": elapsed}
        if isinstance(plans, remat.ShapePlans):
            chosen = plans.plan_for(batch.shape[1])
            row["checkpointed"] = any(d != "keep" for d in chosen.decisions.values())
        steps.append(row)
        print(f"{name:>18} step {i:2d}: {row['tokens']:5d} tokens, peak {peak / 2**20:8.1f} MiB, "
              f"{elapsed:6.3f} s", flush=True)  # fmt: skip
    out = {
        "steps": steps,
        "total_time_s": sum(s["time_s"] for s in steps),
        "plan_time_s": plan_time,
        "grads_bitwise": bitwise,
    }
    if isinstance(plans, remat.ShapePlans):
        out["plans"] = {str(k): dict(p.decisions) for k, p in plans.plans.items()}
        out["profiled_sizes"] = plans.fit.knots
        out["fit_misses"] = {str(k): len(v) for k, v in plans.fit.misfits.items()}
        plans.remove()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, 6 steps (a smoke test)")
    args = parser.parse_args(argv)
    w = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    data = batches(w)
    top = w.high + 1  # the declared largest batch: length ``high``

    budget: list[int] = []

    def adaptive(model: torch.nn.Module, opt: torch.optim.Optimizer, longest: torch.Tensor) -> Any:
        example = torch.randint(0, w.cfg.vocab, (w.cfg.batch, top), generator=torch.Generator())
        plans = remat.auto_checkpoint(
            model, example, budget=w.budget, optimizer=opt, timer=w.timer,
            shapes=remat.Shapes(dims=1, multiple=w.multiple),
        )  # fmt: skip
        budget.append(plans.budget_bytes)  # "40%" of the step at the largest length, in bytes
        return plans

    def one_plan(model: torch.nn.Module, opt: torch.optim.Optimizer, longest: torch.Tensor) -> Any:
        return remat.auto_checkpoint(model, longest, budget=budget[0], optimizer=opt, timer=w.timer)

    def every(model: torch.nn.Module, opt: torch.optim.Optimizer, longest: torch.Tensor) -> Any:
        _torch_every_block(model)

    load_before = load_average()
    digests: list[str] = []
    runs = {"adaptive": run("adaptive", w, data, adaptive, digests)}
    runs["longest"] = run("longest", w, data, one_plan, digests)
    runs["torch_every_block"] = run("torch_every_block", w, data, every, digests)
    budget_bytes = budget[0]
    a, b = runs["adaptive"], runs["longest"]
    ratios = [x["time_s"] / y["time_s"] for x, y in zip(a["steps"], b["steps"])]
    free = sum(s["time_s"] for s in a["steps"] if not s["checkpointed"])
    result = {
        "budget_bytes": budget_bytes,
        "budget": w.budget,
        "workload": {
            "model": dataclasses.asdict(w.cfg),
            "steps": w.steps,
            "lengths": lengths(w),
            "lognormal_median": w.median,
            "lognormal_sigma": w.sigma,
            "clip": [w.low, w.high],
            "seed": 0,
            "multiple": w.multiple,
            "timer": w.timer,
        },
        **runs,
        "summary": {
            "adaptive_over_longest_total_time": a["total_time_s"] / b["total_time_s"],
            "per_step_ratio_median": statistics.median(ratios),
            "per_step_ratio_min_max": [min(ratios), max(ratios)],
            "adaptive_share_of_time_without_checkpointing": free / a["total_time_s"],
            "steps_over_budget": {
                k: sum(s["peak_bytes"] > budget_bytes for s in r["steps"]) for k, r in runs.items()
            },
            "grads_bitwise": {k: r["grads_bitwise"] for k, r in runs.items()},
        },
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
            "load_average_before": load_before,
            "load_average_after": load_average(),
        },
    }
    print(json.dumps(result["summary"], indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
