"""Planner exactness on the device: every per-block plan of a small GPT and a CNN, the
prediction against remat's meter and the CUDA caching allocator."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.bench.models import build, example_input

from .device import (
    PRECISIONS,
    ROOT,
    Check,
    CNNConfig,
    allocator_window,
    autocast,
    release,
    sibling,
)
from .run import Deadline


class ConvBlock(nn.Module):
    """Residual block: conv, BatchNorm, ReLU, conv, BatchNorm, skip, ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))  # type: ignore[no-any-return]


class CNN(nn.Module):
    """A stem, ``blocks`` residual conv blocks (the planner's candidates), pooling, a linear
    head; ``forward(images)`` returns a scalar loss."""

    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, cfg.channels, 3, padding=1)
        self.blocks = nn.Sequential(*(ConvBlock(cfg.channels) for _ in range(cfg.blocks)))
        self.head = nn.Linear(cfg.channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.stem(x)))
        return self.head(h.mean((2, 3))).square().mean()  # type: ignore[no-any-return]


PLANNER_MODELS = ("gpt", "cnn", "encdec")
"""The planner part's models; ``encdec``: a bias handed along each stack
(``Profile.shared.inputs``), under every decision the device offers, offload included."""


def planner_model(check: Check, name: str) -> tuple[nn.Module, torch.Tensor]:
    """A freshly built model of the planner part and its input, the same every call."""
    if name == "gpt":
        cfg = check.sizes.gpt
        return build(cfg, check.device), example_input(cfg, check.device)
    if name == "encdec":
        e = check.sizes.encdec
        families = sibling("families", ROOT / "tests" / "support" / "families.py")
        torch.manual_seed(0)
        model = families.EncoderDecoder(depth=e.depth, d=e.d, seq=e.seq).to(check.device)
        g = torch.Generator().manual_seed(1)
        return model, torch.randn(e.batch, e.seq, e.d, generator=g).to(check.device)
    c = check.sizes.cnn
    torch.manual_seed(0)
    model = CNN(c).to(check.device)
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(c.batch, 3, c.image, c.image, generator=g).to(check.device)


def plan_of(prof: remat.Profile, decisions: Sequence[str]) -> remat.Plan:
    """A :class:`remat.Plan` of one given decision per block, its peak and budget the
    profile's prediction (public API only: ``Profile.peak``, the ``Plan`` fields)."""
    names = [b.name for b in prof.blocks]
    predicted = prof.peak(list(decisions)).bytes
    return remat.Plan(
        decisions=dict(zip(names, decisions)),
        predicted_peak_bytes=predicted,
        predicted_overhead_s=0.0,
        unchecked_peak_bytes=prof.unchecked_peak_bytes,
        budget_bytes=predicted,
        scratch_bytes=prof.scratch.bytes,
    )


def train_steps(
    model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, precision: str, steps: int = 2
) -> None:
    """``steps`` steps of the default loop (the first creates the optimizer state); under
    autocast, forward and loss inside the region, backward and step after it."""
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with autocast(x.device, precision):
            loss = model(x)
        loss.backward()
        opt.step()
        del loss


def measure_plan(
    check: Check, name: str, precision: str, prof: remat.Profile, decisions: Sequence[str]
) -> dict[str, Any]:
    """One per-block plan on a fresh model: predicted, remat's meter, the allocator."""
    plan = plan_of(prof, decisions)
    with allocator_window(check.device) as w:
        model, x = planner_model(check, name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        plan.apply(model)
        train_steps(model, x, opt, precision)
    opt.zero_grad(set_to_none=True)
    opt.state.clear()  # measure_peak starts from no optimizer state, as the loop above did
    with autocast(check.device, precision):
        tracked = remat.measure_peak(model, x, optimizer=opt)
    return {
        "decisions": list(decisions),
        "predicted": plan.predicted_peak_bytes,
        "tracker": tracked,
        "allocated": w.allocated,
        "reserved": w.reserved,
    }


def planner_stats(row: dict[str, Any]) -> dict[str, Any]:
    """What a model and precision's plans show: how many the tracker measured as predicted,
    and how far the tracker and the allocator are from the prediction (min, max)."""
    plans = row["plans"]
    if not plans:
        return {"measured": 0}
    track = [p["tracker"] - p["predicted"] for p in plans]
    alloc = [p["allocated"] - p["predicted"] for p in plans]
    scratch = row["scratch_bytes"]
    out: dict[str, Any] = {
        "measured": len(plans),
        "tracker_exact": sum(d == 0 for d in track),
        "tracker_minus_predicted": [min(track), max(track)],
        "allocated_minus_predicted": [min(alloc), max(alloc)],
        "allocated_within_scratch": sum(0 <= d <= scratch for d in alloc),
    }
    reserved = [p["reserved"] - p["allocated"] for p in plans if p["reserved"] is not None]
    if reserved:
        out["reserved_minus_allocated"] = [min(reserved), max(reserved)]
    return out


def part_planner(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """Every per-block plan of each model and precision, predicted against measured.

    Each model and precision gets an equal share of the time left; plans are measured in
    a fixed shuffled order, so a share that runs out leaves a sample of all of them.
    """
    configs = list(itertools.product(PLANNER_MODELS, PRECISIONS))
    found["configs"] = rows = []
    for k, (name, precision) in enumerate(configs):
        share = Deadline(deadline.left() / (len(configs) - k))
        row: dict[str, Any] = {"model": name, "precision": precision, "plans": []}
        rows.append(row)
        with check.on_device():
            model, x = planner_model(check, name)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            with autocast(check.device, precision):
                prof = remat.profile(model, x, optimizer=opt, timer="flops")
            del model, x, opt
            every = list(itertools.product(prof.decisions, repeat=len(prof.blocks)))
            random.Random(0).shuffle(every)
            chosen = every if check.sizes.max_plans is None else every[: check.sizes.max_plans]
            row.update(
                blocks=[b.name for b in prof.blocks],
                decisions=list(prof.decisions),
                per_block_plans=len(every),
                scratch_bytes=prof.scratch.bytes,
                static_bytes=prof.static_step_bytes,
                unchecked_peak_bytes=prof.unchecked_peak_bytes,
            )
            for ds in chosen:
                if share.passed():
                    row["cut_short"] = f"time share used up after {len(row['plans'])} plans"
                    found["cut_short"] = "a model's time share ran out"
                    break
                row["plans"].append(measure_plan(check, name, precision, prof, ds))
                row["stats"] = planner_stats(row)
            release(check.device)
