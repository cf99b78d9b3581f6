"""Run as a script: plan a model whose unchecked step does not fit this process's memory.

The address space is limited (``RLIMIT_AS``) to the process's size plus ``FRACTION`` of the
unchecked step's predicted peak (from shapes, before any step). The script checks that an
unchecked step fails under that limit, then plans with ``remat.auto_checkpoint`` and trains
``STEPS`` steps of the planned model within it, and prints one JSON line of what it saw.
With ``--amp``: the loop of torch's mixed-precision recipe (forward and loss in a CPU
bfloat16 autocast region, planned inside it; the unchecked peak from a fake twin). With
``--measured``: ``timer="measured"``, which shapes alone cannot serve, so the profile is
fitted from real steps at a quarter and a half of the batch (8 sequences of 256 tokens).
With ``--small-batch``: ``timer="measured"`` at a batch of 2 (of 512 tokens), too small to
fit from smaller batches: the profile's lines are assembled from pair steps
(:mod:`remat.planner.grouped`), and the plan is for 70 %, which the pair steps fit under.
"""

from __future__ import annotations

import contextlib
import json
import resource
import sys

import torch

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner import measure
from remat.planner.fake import fake_twin, on_fake
from remat.planner.inputs import Inputs
from remat.planner.loop import Loop
from remat.planner.meta import twin

FRACTION = 0.75
STEPS = 2


def vm_size() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main() -> None:
    torch.set_num_threads(1)
    amp = "--amp" in sys.argv[1:]
    small = "--small-batch" in sys.argv[1:]
    measured = "--measured" in sys.argv[1:] or small
    timer = "measured" if measured else "flops"
    batch, seq = (2, 512) if small else (8, 256) if measured else (4, 512)
    layers = 4 if small else 6
    cfg = ModelConfig(layers=layers, d_model=128, seq=seq, batch=batch, heads=4, vocab=256)

    def region() -> contextlib.AbstractContextManager[object]:
        return torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()

    model, x = build(cfg), example_input(cfg)
    opt = torch.optim.AdamW(model.parameters())
    if amp:
        f, fo, mode = fake_twin(model, opt)
        (fx,), _ = on_fake(mode, ((x,), {}))
        with region():
            prof = measure.profile_loop(f, Inputs(fx), Loop(fo, timer="flops"))
        unchecked = prof.unchecked_peak_bytes
        del f, fo, fx
    else:
        m, (mx,), _, mo = twin(model, (x,), {}, opt)
        unchecked = remat.profile(m, mx, optimizer=mo, timer="flops").unchecked_peak_bytes
        del m, mx, mo
    # the one-time set-up of everything the steps use (the profiler's threads and libraries,
    # autograd, the kernels) on a tiny model, outside the limit: the limit is the step's
    tiny_cfg = ModelConfig(layers=2, d_model=16, seq=64, batch=2, heads=2, vocab=16)
    tiny = build(tiny_cfg)
    tiny_opt = torch.optim.AdamW(tiny.parameters())
    with region():
        remat.auto_checkpoint(tiny, example_input(tiny_cfg), budget="100%", optimizer=tiny_opt,
                              timer="flops", quiet=True)  # fmt: skip
    limit = vm_size() + int(FRACTION * unchecked)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out: dict[str, object] = {"unchecked": unchecked, "limit_over_process": int(FRACTION * unchecked)}
    try:
        with region():
            loss = model(x).float().sum()
        loss.backward()
        out["unchecked_fits"] = True
    except (RuntimeError, MemoryError):
        out["unchecked_fits"] = False
    for p in model.parameters():
        p.grad = None
    with region():
        plan = remat.auto_checkpoint(model, x, budget="70%" if small else "50%", optimizer=opt,
                                     timer=timer, quiet=True)  # fmt: skip
    out["predicted"] = plan.predicted_peak_bytes
    out["budget"] = plan.budget_bytes
    for _ in range(STEPS):
        opt.zero_grad()
        with region():
            loss = model(x).float().sum()
        loss.backward()
        opt.step()
    out["trained"] = STEPS
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
