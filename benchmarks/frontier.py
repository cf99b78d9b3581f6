"""The memory/time frontier below the per-block floor, planned by ``remat.auto_checkpoint``.

On a deep long-sequence GPT trained with AdamW (the default loop: ``zero_grad()``,
forward, backward, ``optimizer.step()``), measured in one run:

* ``none``: no checkpointing;
* ``torch-every`` / ``torch-2nd``: ``torch.utils.checkpoint`` (non-reentrant) on every /
  every 2nd block - the per-block floor and the usual compromise;
* ``plan-F``: ``remat.auto_checkpoint(model, x, budget=B, optimizer=opt)`` with
  ``B = static + F * (activations of checkpointing every block)``, in the planner's units
  (the predicted step peak of ``recompute`` on every block); F < 1 is below the floor and
  needs regions that span blocks and split them. One profile serves every budget
  (``profile=``).

Peaks are ``remat.measure_peak(model, x, optimizer=opt)``: the absolute step peak (the
larger of the first and a later step) of tensor bytes on the model's device; ``alloc`` is
the same two steps on an independent meter, ``torch.profiler``'s raw CPU allocator events
(scratch memory inside operators included): bytes alive at the step's start plus the
events' peak. Step times are
the process's CPU time of whole steps, interleaved round by round, median per strategy,
as ratios to ``none`` (steady on a shared machine; one thread). Gradients of every strategy
are compared bitwise with ``none``'s (same seed, dropout on).

Run: python benchmarks/frontier.py [--layers 32 --d 128 --seq 1024 --batch 2]
     [--fractions 1,0.9,0.8,0.7,0.6] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.bench.strategies import floor_budget


def _torch_every(model: torch.nn.Module, every: int) -> None:
    def run_block(i: int, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if i % every == 0:
            return torch_checkpoint(block, x, use_reentrant=False)  # type: ignore[no-any-return]
        return block(x)  # type: ignore[no-any-return]

    model.run_block = run_block  # type: ignore[assignment]


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(tokens).backward()
    opt.step()


def _alive(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> int:
    """Bytes of the tensors a step starts with: parameters, buffers, gradients, state, input."""
    tensors = [*model.parameters(), *model.buffers(), tokens]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


def _allocator_peak(
    model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor
) -> int:
    """The larger absolute peak of the first and a later step on the CPU allocator's events."""
    from torch.profiler import ProfilerActivity, profile

    peaks = []
    for _ in range(2):
        start = _alive(model, opt, tokens)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _step(model, opt, tokens)
        assert prof.profiler is not None
        events = prof.profiler.kineto_results.events()
        allocs = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        cur = top = 0
        for _, n in allocs:
            cur += n
            top = max(top, cur)
        peaks.append(start + top)
    return max(peaks)


def _grads(model: torch.nn.Module, tokens: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    model(tokens).backward()
    out = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return out


def _summary(plan: remat.Plan) -> str:
    counts: dict[str, int] = {}
    for d in plan.decisions.values():
        counts[d] = counts.get(d, 0) + 1
    spans = getattr(plan, "spans", None) or []
    text = ", ".join(f"{n} {d}" for d, n in sorted(counts.items()))
    return f"{len(spans)} spans; {text}" if spans else text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.1, help="residual-branch dropout")
    ap.add_argument(
        "--attn-dropout", type=float, default=0.0, help="attention dropout (0: fused kernel)"
    )
    ap.add_argument("--fractions", default="1,0.9,0.8,0.7,0.6")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None, help="write results to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = ModelConfig(
        model="gpt",
        layers=args.layers,
        d_model=args.d,
        seq=args.seq,
        batch=args.batch,
        heads=args.heads,
        vocab=256,
        dropout=args.dropout,
        attn_dropout=args.attn_dropout,
    )
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "config": vars(args),
    }
    print(env, flush=True)
    tokens = example_input(cfg)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = build(cfg)
        model.train()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    started = time.perf_counter()
    probe, probe_opt = fresh()
    prof = remat.profile(probe, tokens, optimizer=probe_opt)
    profile_s = time.perf_counter() - started
    static = prof.static_step_bytes
    every_act = floor_budget(prof, 100) - static - prof.scratch.bytes
    print(
        f"profiled in {profile_s:.0f} s; static {static / 1e6:.1f} MB, predicted unchecked "
        f"{prof.unchecked_peak_bytes / 1e6:.1f} MB, every-block {(static + every_act) / 1e6:.1f} "
        f"MB, smallest {prof.floor_bytes / 1e6:.1f} MB",
        flush=True,
    )
    setups: dict[str, Callable[[torch.nn.Module, torch.optim.Optimizer], dict[str, Any]]] = {
        "none": lambda m, o: {},
        "torch-every": lambda m, o: (_torch_every(m, 1), {})[1],
        "torch-2nd": lambda m, o: (_torch_every(m, 2), {})[1],
    }
    for f in (float(v) for v in args.fractions.split(",")):

        def planned(m: torch.nn.Module, o: torch.optim.Optimizer, f: float = f) -> dict[str, Any]:
            budget = floor_budget(prof, 100 * f)
            t0 = time.perf_counter()
            p = remat.auto_checkpoint(m, tokens, budget=budget, optimizer=o, profile=prof)
            return {
                "budget": budget,
                "plan": _summary(p),
                "predicted": p.predicted_peak_bytes,
                "auto_s": time.perf_counter() - t0,
            }

        setups[f"plan-{f:g}"] = planned
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    rows: dict[str, dict[str, Any]] = {}
    ref: list[torch.Tensor] | None = None
    for name, setup in setups.items():
        model, opt = fresh()
        try:
            info = setup(model, opt)
        except remat.PlanError as e:
            print(f"  {name}: {e}", flush=True)
            rows[name] = {"strategy": name, "error": str(e)}
            continue
        grads = _grads(model, tokens)
        ref = grads if ref is None else ref
        same = len(grads) == len(ref) and all(torch.equal(a, b) for a, b in zip(ref, grads))
        peak = remat.measure_peak(model, tokens, optimizer=opt)
        alloc = _allocator_peak(model, opt, tokens)
        rows[name] = {
            "strategy": name,
            "peak_bytes": peak,
            "allocator_peak_bytes": alloc,
            "grads_bitwise": same,
            **info,
        }
        models[name] = (model, opt)
        print(
            f"  {name}: peak {peak / 1e6:.1f} MB, allocator {alloc / 1e6:.1f} MB, grads bitwise "
            f"{same}, {info}",
            flush=True,
        )
    cpu: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(args.rounds):
        for name, (model, opt) in models.items():
            start = time.process_time()
            _step(model, opt, tokens)
            cpu[name].append(time.process_time() - start)
    base = statistics.median(cpu["none"])
    print(
        f"\n{'strategy':<14}{'budget MB':>10}{'peak MB':>9}{'alloc MB':>9}{'met':>5}"
        f"{'act / every':>12}{'time x':>8}{'bitwise':>8}  plan"
    )
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:<14}  no plan: {row['error'][:90]}")
            continue
        row["time_ratio"] = statistics.median(cpu[name]) / base
        row["act_ratio"] = (row["peak_bytes"] - static) / every_act
        budget = row.get("budget")
        worst = max(row["peak_bytes"], row["allocator_peak_bytes"])
        met = "" if budget is None else ("yes" if worst <= budget else "NO")
        shown = "" if budget is None else f"{budget / 1e6:.1f}"
        print(
            f"{name:<14}{shown:>10}{row['peak_bytes'] / 1e6:>9.1f}"
            f"{row['allocator_peak_bytes'] / 1e6:>9.1f}{met:>5}"
            f"{row['act_ratio']:>12.2f}{row['time_ratio']:>8.2f}{str(row['grads_bitwise']):>8}"
            f"  {row.get('plan', '')}"
        )
    print(
        f"\nstatic {static / 1e6:.1f} MB, scratch inside operators {prof.scratch.bytes} B; "
        "act / every: (peak - static) / (every-block - static); met: peak and alloc <= budget"
    )
    if args.json:
        with open(args.json, "w") as fh:
            out = {"environment": env, "profile_s": profile_s, "static_bytes": static}
            json.dump({**out, "results": list(rows.values())}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
