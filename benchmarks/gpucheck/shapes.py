"""The GPU's calibration saved into the repository, and plans from shapes against the GPU.

1. The device's calibration (:func:`remat.planner.calibration.save`, float32, bfloat16 and
   float16) is written to ``src/remat/planner/calibrations/<gpu name slug>.json``, where
   ``remat.profile(..., calibration="<gpu name>")`` and ``remat plan --calibration`` find it
   on any machine. A dry run saves the CPU's (float32) under ``--out`` instead, leaving the
   repository as it is.
2. For the planner part's GPT, in float32 and in bfloat16 (the model's dtype: autocast does
   not apply to meta tensors), a meta copy (:func:`remat.planner.meta.twin`) is profiled
   from shapes for the device (``device=``, priced with the calibration just saved), planned
   at a budget between its floor and the unchecked step (one decision per block), and the
   plan is applied to the real model: its predicted peak is compared with remat's meter
   (``remat.measure_peak``: the tensors' bytes, expected exact) and with the CUDA caching
   allocator over two real steps (``max_memory_allocated``: the tensors' bytes plus the
   scratch inside operators, which a plan from shapes does not count); a profile on the
   device gives the same plan's prediction with that scratch beside it. A dry run measures
   on CPU, ``remat.memory.track`` standing in for the allocator.
3. The same GPT in float32 under bfloat16 autocast (``"amp"``: torch's recipe, forward in
   the region, backward and the optimizer step after it): a *fake* copy
   (:func:`remat.planner.fake.fake_twin`, tensors of the device that autocast casts) is
   profiled inside the region and planned; the plan is measured as above, the meter's peak
   also inside the region. On CUDA this checks what no CPU run can: the fake tensors'
   kernels (SDPA's choice among them) against the GPU's.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import remat
from remat.bench.models import build, example_input
from remat.planner import calibration, measure
from remat.planner.fake import fake_twin, on_fake
from remat.planner.inputs import Inputs
from remat.planner.loop import Loop
from remat.planner.meta import twin

from .device import ROOT, Check, allocator_window, release

if TYPE_CHECKING:
    from .run import Deadline

#: The dtypes whose constants are saved for the GPU.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: The planned models' dtypes.
SHAPE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def slug(name: str) -> str:
    """A file name for a device's name: ``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def save_calibration(check: Check) -> Path:
    """The device's calibration, saved where remat finds it (a dry run: under ``--out``)."""
    if check.dry_run:
        return calibration.save(check.out / "calibration-cpu.json", "cpu", dtypes=(torch.float32,))
    name = torch.cuda.get_device_name(check.device)
    return calibration.save(calibration.SHIPPED / f"{slug(name)}.json", check.device, dtypes=DTYPES)


def _profile_from_shapes(
    check: Check, model: torch.nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer,
    amp: bool, saved: Path,
) -> remat.Profile:
    """The model's profile from shapes for the device: a meta copy, or under autocast
    (``amp``, inside the caller's region) a fake one, which autocast casts."""
    if amp:
        fake, fake_opt, mode = fake_twin(model, opt)
        (fake_x,), _ = on_fake(mode, ((x,), {}))
        return measure.profile_loop(fake, Inputs(fake_x), Loop(fake_opt), calibration=str(saved))
    meta_model, (meta_x,), _, meta_opt = twin(model, (x,), {}, opt)
    return remat.profile(
        meta_model, meta_x, optimizer=meta_opt, device=check.device.type, calibration=str(saved)
    )


def shapes_row(check: Check, precision: str, saved: Path) -> dict[str, Any]:
    """One model's plan from shapes (``precision`` a key of :data:`SHAPE_DTYPES`, or
    ``"amp"``: float32 under bfloat16 autocast), predicted against the meter and the
    allocator."""
    cfg, amp = check.sizes.gpt, precision == "amp"
    dtype = torch.float32 if amp else SHAPE_DTYPES[precision]

    def region() -> contextlib.AbstractContextManager[object]:
        if amp:
            return torch.autocast(check.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    model = build(cfg, check.device).to(dtype)
    x = example_input(cfg, check.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with region():
        shaped = _profile_from_shapes(check, model, x, opt, amp, saved)
        on_device = remat.profile(model, x, optimizer=opt, timer="flops")
    del model, x, opt
    budget = (
        shaped.unchecked_peak_bytes + shaped.peak(["recompute"] * len(shaped.blocks)).bytes
    ) // 2
    plan = remat.plan(shaped, budget, spans=False)
    decisions = [getattr(d, "value", d) for d in (plan.decisions[b.name] for b in shaped.blocks)]
    with allocator_window(check.device) as w:
        torch.manual_seed(0)
        model = build(cfg, check.device).to(dtype)
        x = example_input(cfg, check.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        plan.apply(model)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            with region():  # torch's recipe: forward in the region, backward after it
                loss = model(x)
            loss.backward()
            opt.step()
    opt.zero_grad(set_to_none=True)
    opt.state.clear()  # measure_peak starts from no optimizer state, as the steps above did
    with region():
        tracked = remat.measure_peak(model, x, optimizer=opt)
    release(check.device)
    return {
        "precision": precision,
        "decisions": decisions,
        "budget": budget,
        "predicted": plan.predicted_peak_bytes,
        "on_device_predicted": on_device.peak(decisions).bytes,
        "on_device_scratch": on_device.scratch.bytes,
        "tracker": tracked,
        "allocated": w.allocated,
        "reserved": w.reserved,
    }


def part_shapes(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """Save the device's calibration, then check plans from shapes against the device."""
    saved = save_calibration(check)
    found["calibration"] = str(saved.relative_to(ROOT) if saved.is_relative_to(ROOT) else saved)
    found["rows"] = rows = []
    for precision in SHAPE_DTYPES:
        if deadline.passed():
            found["cut_short"] = "time limit"
            break
        rows.append(shapes_row(check, precision, saved))
    if not deadline.passed():
        rows.append(shapes_row(check, "amp", saved))
