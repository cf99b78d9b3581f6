"""ResNet- and U-Net-shaped models in a ``remat bench``-style table (issue #22).

Three strategies on each model (the test suite's ``ResNet`` and ``UNet`` of
``tests/support/vision_models.py``, random weights, a random batch):

* ``none``: no checkpointing (the reference);
* ``torch-every-block``: every default block (the blocks ``remat.profile`` plans:
  ``remat.apply_activation_checkpointing``'s default, the repeated blocks of every stage)
  checkpointed by hand with ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``;
* ``auto-50%``: ``remat.auto_checkpoint(model, x, budget="50%", set_to_none=False)``
  (the loop of ``remat bench``: forward and backward, gradients kept and zeroed).

Measured as ``remat bench`` measures (:mod:`remat.bench.runner`): one model per strategy
from the same seed; a gradient check against ``none`` from the same RNG seed (largest
absolute difference); the *activation memory*, the peak of :func:`remat.memory.track`
around a step with the gradients allocated (zeroed in place), and the *peak step memory*,
that plus the parameters' and gradients' bytes; the time of ``rounds`` interleaved rounds
(one step of every strategy each, the order rotated, after ``warmup`` rounds), as ratios to
``none`` paired by round: median and spread (:mod:`remat.bench.stats`). Everything comes
from one run; the table gives ratios, not seconds.

Run from the repository root::

    python benchmarks/vision_bench.py            # the table for docs/BENCHMARKS.md
    python benchmarks/vision_bench.py --json out.json --rounds 15
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the test suite's models (tests/support)

import remat  # noqa: E402
from remat.bench import stats  # noqa: E402
from remat.bench.strategies import smallest_reachable_percent  # noqa: E402

STRATEGIES = ("none", "torch-every-block", "auto-50%")


def models() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]:
    """Name -> (a model factory, its input shape)."""
    from tests.support.vision_models import ResNet, UNet

    return {"ResNet": (ResNet, (8, 3, 96, 96)), "U-Net": (UNet, (8, 3, 64, 64))}


def _loss(out: Any) -> torch.Tensor:
    return out.float().sum()


def checkpoint_by_hand(model: nn.Module) -> list[str]:
    """Checkpoint every default block of ``model`` with ``torch.utils.checkpoint`` (its
    ``forward`` replaced by one that runs the original inside a non-reentrant checkpoint);
    the blocks' names."""
    names = remat.apply_activation_checkpointing(copy.deepcopy(model))  # the names only
    for name in names:
        block = model.get_submodule(name)
        inner = block.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            return torch_checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward  # type: ignore[method-assign]
    return names


def configure(name: str, model: nn.Module, x: torch.Tensor, timer: str) -> dict[str, Any]:
    """Apply strategy ``name`` to ``model`` in place; what it chose."""
    if name == "none":
        return {}
    if name == "torch-every-block":
        return {"blocks": len(checkpoint_by_hand(model))}
    assert name == "auto-50%"
    prof = remat.profile(model, x, loss_fn=_loss, timer=timer, set_to_none=False)
    note = None
    try:
        p = remat.auto_checkpoint(
            model, x, budget="50%", loss_fn=_loss, set_to_none=False, quiet=True, profile=prof
        )
    except remat.PlanError:  # as remat bench does: the smallest reachable budget instead
        reach = smallest_reachable_percent(prof, lambda b: remat.plan(prof, b))
        p = remat.plan(prof, f"{reach}%")
        p.apply(model)
        note = f"50% not reachable; planned at {reach}%"
    chosen = [d for d in p.decisions.values() if d != "keep"]
    return {
        "blocks": len(p.decisions),
        "checkpointed": len(chosen),
        "spans": len(p.spans),
        "note": note,
    }


def _step(model: nn.Module, x: torch.Tensor) -> None:
    _loss(model(x)).backward()


def bench(
    make: Callable[[], nn.Module],
    shape: tuple[int, ...],
    *,
    rounds: int,
    warmup: int = 1,
    timer: str = "time",
    strategies: tuple[str, ...] = STRATEGIES,
) -> list[dict[str, Any]]:
    """One row per strategy: activation and peak step bytes, the time ratio to ``none``
    (median, spread), the largest gradient difference to ``none``, what was chosen."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    built: dict[str, tuple[nn.Module, dict[str, Any]]] = {}
    for s in strategies:
        torch.manual_seed(0)
        m = make()
        m.train()
        built[s] = (m, configure(s, m, x, timer))
    grads: dict[str, list[torch.Tensor]] = {}
    for s, (m, _) in built.items():
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        _loss(m(x)).backward()
        grads[s] = [p.grad.detach().clone() for p in m.parameters() if p.grad is not None]
    activations: dict[str, int] = {}
    for s, (m, _) in built.items():
        m.zero_grad(set_to_none=False)
        with remat.memory.track() as t:
            _step(m, x)
        activations[s] = t.peak_bytes
    times: dict[str, list[float]] = {s: [] for s in strategies}
    order = list(strategies)
    for i in range(warmup + rounds):
        k = i % len(order)
        for s in [*order[k:], *order[:k]]:
            m, _ = built[s]
            m.zero_grad(set_to_none=False)
            t0 = time.perf_counter()
            _step(m, x)
            if i >= warmup:
                times[s].append(time.perf_counter() - t0)
    ref = strategies[0]
    rows = []
    for s in strategies:
        m, chosen = built[s]
        params = sum(p.nbytes for p in m.parameters())
        ratio = stats.spread(stats.paired_ratios(times[s], times[ref]))
        diff = max(
            (float((a - b).abs().max()) for a, b in zip(grads[s], grads[ref])), default=0.0
        )
        rows.append(
            {
                "strategy": s,
                "activation_bytes": activations[s],
                "peak_step_bytes": activations[s] + 2 * params,
                "time_ratio": ratio.median,
                "time_ratio_low": ratio.low,
                "time_ratio_high": ratio.high,
                "max_grad_diff": diff,
                **chosen,
            }
        )
    return rows


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """The markdown table of :func:`bench`'s rows per model."""
    lines = [
        "| model | strategy | peak step | activations | time x (spread) | max grad diff |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model, rows in results.items():
        ref = rows[0]
        for r in rows:
            act = r["activation_bytes"] / 2**20
            share = r["activation_bytes"] / ref["activation_bytes"]
            lines.append(
                f"| {model} | {r['strategy']} | {r['peak_step_bytes'] / 2**20:.2f} MiB "
                f"| {act:.2f} MiB ({share:.0%}) | {r['time_ratio']:.2f}x "
                f"({r['time_ratio_low']:.2f}-{r['time_ratio_high']:.2f}) "
                f"| {r['max_grad_diff']:.1e} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--timer", choices=("time", "flops"), default="time",
                        help="the profile's timer for auto-50%% (default: time)")  # fmt: skip
    parser.add_argument("--json", help="write the rows and the environment here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {
        name: bench(make, shape, rounds=args.rounds, warmup=args.warmup, timer=args.timer)
        for name, (make, shape) in models().items()
    }
    out = {
        "rows": results,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
            "rounds": args.rounds,
        },
    }
    print(table(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
