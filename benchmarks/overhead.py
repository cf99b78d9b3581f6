"""Per-call overhead of checkpoint around a tiny op: remat vs torch, plain call as the floor.

Each case runs forward + backward of one op on 16 elements (recompute included).
Cases are interleaved round by round so machine drift hits all of them alike;
the reported time is the median over rounds of the mean per call in a round.

On a device (``--device cuda``) each round is timed between two synchronizations, so
the time per call is what the calling thread spends launching the call's kernels (the
per-call overhead) unless the kernels themselves take longer.

Run: python benchmarks/overhead.py [--rounds 30] [--calls 200] [--device cpu] [--json out.json]
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
import torch.utils.checkpoint as tuc

import remat


def _sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()  # saves its input: needs recompute


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # saves nothing: no recompute


def _mm_sin(x: torch.Tensor) -> torch.Tensor:
    return (x.view(4, 4) @ x.view(4, 4)).sin()  # one op to save, one to recompute


def cases() -> dict[str, Callable[[Callable[..., torch.Tensor], torch.Tensor], torch.Tensor]]:
    torch_sac = functools.partial(
        tuc.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )
    remat_sac = functools.partial(
        remat.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
    )
    return {
        "plain": lambda f, x: f(x),
        "torch non-reentrant": lambda f, x: tuc.checkpoint(f, x, use_reentrant=False),
        "remat non-reentrant": lambda f, x: remat.checkpoint(f, x),
        "torch reentrant": lambda f, x: tuc.checkpoint(f, x, use_reentrant=True),
        "remat reentrant": lambda f, x: remat.checkpoint(f, x, use_reentrant=True),
        "torch selective": lambda f, x: tuc.checkpoint(
            f, x, use_reentrant=False, context_fn=torch_sac
        ),
        "remat selective": lambda f, x: remat.checkpoint(f, x, context_fn=remat_sac),
    }


class _Sin(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sin()


def module_cases() -> dict[str, torch.nn.Module]:
    """A tiny module: plain, under torch's checkpoint_wrapper, under remat's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    return {
        "plain": _Sin(),
        "torch checkpoint_wrapper": checkpoint_wrapper(
            _Sin(), checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        "remat checkpoint_wrapper": remat.checkpoint_wrapper(_Sin()),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_modules(rounds: int, calls: int, device: str = "cpu") -> dict[str, float]:
    dev = torch.device(device)
    x = torch.randn(16, device=dev, requires_grad=True)
    mods = {k: m.to(dev) for k, m in module_cases().items()}
    samples: dict[str, list[float]] = {k: [] for k in mods}
    for _ in range(3):
        for m in mods.values():
            m(x).sum().backward()
    for _ in range(rounds):
        for k, m in mods.items():
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(calls):
                m(x).sum().backward()
            _sync(dev)
            samples[k].append((time.perf_counter() - t0) / calls)
    return {k: statistics.median(v) for k, v in samples.items()}


def measure(rounds: int, calls: int, device: str = "cpu") -> dict[str, dict[str, float]]:
    dev = torch.device(device)
    x = torch.randn(16, device=dev, requires_grad=True)
    ops = {"sin": _sin, "x*2": _double, "mm+sin": _mm_sin}
    table = cases()
    samples: dict[tuple[str, str], list[float]] = {(o, c): [] for o in ops for c in table}
    for _ in range(3):  # warm-up (first-call imports, caches)
        for o, c in samples:
            table[c](ops[o], x).sum().backward()
    for _ in range(rounds):
        for o, c in samples:
            f, run = ops[o], table[c]
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(calls):
                run(f, x).sum().backward()
            _sync(dev)
            samples[(o, c)].append((time.perf_counter() - t0) / calls)
    out: dict[str, dict[str, float]] = {}
    for o in ops:
        out[o] = {c: statistics.median(samples[(o, c)]) for c in table}
    return out


VARIANTS = ("non-reentrant", "reentrant", "selective")
"""The checkpoint variants compared, remat's against torch's, in :func:`measure`'s cases."""


def overhead_ratio(row: dict[str, float], ours: str, theirs: str) -> float:
    """remat's overhead above the plain call over torch's: ``(ours - plain) / (theirs - plain)``.

    Example:
        >>> overhead_ratio({"plain": 1.0, "remat x": 2.0, "torch x": 3.0}, "remat x", "torch x")
        0.5
    """
    floor = row["plain"]
    return (row[ours] - floor) / (row[theirs] - floor)


def overhead_ratios(res: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """For each op of :func:`measure`'s result, :func:`overhead_ratio` of each variant."""
    return {
        op: {v: overhead_ratio(row, f"remat {v}", f"torch {v}") for v in VARIANTS}
        for op, row in res.items()
    }


def report(res: dict[str, dict[str, float]]) -> str:
    lines = []
    for op, row in res.items():
        floor = row["plain"]
        lines.append(f"\n## op: {op}   (plain call {floor * 1e6:.1f} us, forward+backward)")
        lines.append(f"{'case':<22}{'time/call':>12}{'overhead':>12}")
        for case, t in row.items():
            lines.append(f"{case:<22}{t * 1e6:>10.1f}us{(t - floor) * 1e6:>10.1f}us")
        for variant, ratio in overhead_ratios({op: row})[op].items():
            lines.append(f"overhead ratio remat/torch ({variant}): {ratio:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--json", default=None, help="write results to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "threads": torch.get_num_threads(),
        "device": args.device,
    }
    if torch.device(args.device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(args.device)
    print("environment:", env)
    res = measure(args.rounds, args.calls, args.device)
    print(report(res))
    mods = measure_modules(args.rounds, args.calls, args.device)
    floor = mods["plain"]
    print(f"\n## module wrapper around sin (plain module {floor * 1e6:.1f} us)")
    for k, t in mods.items():
        print(f"{k:<28}{t * 1e6:>10.1f}us{(t - floor) * 1e6:>10.1f}us")
    ratio = overhead_ratio(mods, "remat checkpoint_wrapper", "torch checkpoint_wrapper")
    print(f"overhead ratio remat/torch (wrapper): {ratio:.2f}")
    res["module wrapper"] = mods
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "seconds_per_call": res}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
