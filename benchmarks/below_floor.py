"""Below the per-block floor: spans over several blocks and split blocks on a deep long-sequence GPT.

Strategies (remat.modules.spans, the mechanism the planner applies):

* ``none``: no checkpointing;
* ``every``: every block checkpointed (the per-block floor);
* ``every+split``: every block checkpointed, its attention its own region inside;
* ``span-k``: spans of k blocks, each block checkpointed inside (``inner="recompute"``);
* ``span-k+split``: the same with each block split (``inner="split"``);
* ``torch-nested-k``: torch.utils.checkpoint nested by hand (a checkpoint over each
  k blocks, each block checkpointed inside), the reference for ``span-k``.

The peak is the exact tensor bytes of one training step (forward + backward,
gradients included; parameters not) from ``remat.memory.track``; its ratio to
``every`` says how far below the per-block floor a strategy goes. Step times
are taken without the tracker, interleaved round by round, median per strategy,
as wall time and as the process's CPU time (steadier on a shared machine).
Gradients of every strategy are checked bitwise against ``none``.

Run: python benchmarks/below_floor.py [--layers 16 --d 128 --seq 1024 --batch 2]
     [--dropout 0.0] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.modules.spans import apply_span
from remat.modules.split import split_block


def _every(model: torch.nn.Module, split: bool) -> None:
    n = len(model.blocks)
    for i in range(n):
        if split:
            split_block(model, f"blocks.{i}")
        remat.checkpoint_wrapper(model.blocks[i])


def _spans(model: torch.nn.Module, k: int, inner: str) -> None:
    n = len(model.blocks)
    for i in range(0, n, k):
        apply_span(model, [f"blocks.{j}" for j in range(i, min(i + k, n))], inner=inner)


def _torch_nested(model: torch.nn.Module, k: int) -> None:
    """Checkpoint over each k blocks, each block checkpointed inside (the bench's run_block hook)."""
    blocks = list(model.blocks)
    state: dict[str, torch.Tensor] = {}

    def segment(x: torch.Tensor, seg: list[torch.nn.Module]) -> torch.Tensor:
        for b in seg:
            x = torch_checkpoint(b, x, use_reentrant=False)
        return x

    def run_block(i: int, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if i % k == 0:
            seg = blocks[i : i + k]
            state["out"] = torch_checkpoint(segment, x, seg, use_reentrant=False)
        if i % k == k - 1 or i == len(blocks) - 1:
            return state.pop("out")  # held no longer than the model holds it
        return x

    model.run_block = run_block  # type: ignore[assignment]


def strategies() -> dict[str, Callable[[torch.nn.Module], None]]:
    out: dict[str, Callable[[torch.nn.Module], None]] = {
        "none": lambda m: None,
        "every": functools.partial(_every, split=False),
        "every+split": functools.partial(_every, split=True),
    }
    for k in (2, 4, 8):
        out[f"span-{k}"] = functools.partial(_spans, k=k, inner="recompute")
        out[f"span-{k}+split"] = functools.partial(_spans, k=k, inner="split")
        out[f"torch-nested-{k}"] = functools.partial(_torch_nested, k=k)
    return out


def _step(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(tokens).backward()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--dropout", type=float, default=0.0, help="0: flash attention path")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated strategy names")
    ap.add_argument("--json", default=None, help="write results to this file")
    args = ap.parse_args(argv)
    cfg = ModelConfig(
        model="gpt",
        layers=args.layers,
        d_model=args.d,
        seq=args.seq,
        batch=args.batch,
        heads=args.heads,
        dropout=args.dropout,
    )
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "config": vars(args),
    }
    print(env)
    tokens = example_input(cfg)
    chosen = strategies()
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    models: dict[str, torch.nn.Module] = {}
    peaks: dict[str, int] = {}
    ref: list[torch.Tensor] | None = None
    for name, apply in chosen.items():
        model = build(cfg)
        apply(model)
        models[name] = model
        torch.manual_seed(0)
        with remat.memory.track() as t:
            _step(model, tokens)
        peaks[name] = t.peak_bytes
        grads = [p.grad for p in model.parameters()]
        if ref is None:
            ref = grads
        same = all(torch.equal(a, b) for a, b in zip(ref, grads))
        print(f"  measured {name}: peak {t.peak_bytes / 2**20:.1f} MiB, grads equal: {same}")
    times: dict[str, list[float]] = {k: [] for k in models}
    cpu: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            torch.manual_seed(0)
            start, start_cpu = time.perf_counter(), time.process_time()
            _step(model, tokens)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    floor = peaks.get("every")
    base = statistics.median(cpu["none"]) if "none" in cpu else None
    print(
        f"\n{'strategy':<18}{'peak MiB':>10}{'/ every':>9}{'wall s':>9}{'cpu s':>9}{'cpu / none':>11}"
    )
    rows = []
    for name in models:
        wall, used = statistics.median(times[name]), statistics.median(cpu[name])
        ratio = peaks[name] / floor if floor else float("nan")
        slow = used / base if base else float("nan")
        print(
            f"{name:<18}{peaks[name] / 2**20:>10.1f}{ratio:>9.3f}{wall:>9.2f}{used:>9.2f}"
            f"{slow:>11.2f}"
        )
        rows.append({"strategy": name, "peak_bytes": peaks[name], "step_s": wall, "cpu_s": used})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "results": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
