"""Timing a step's blocks: per-block forward+backward time, or FLOPs recomputed.

On CPU with one thread, thread CPU time (``time.thread_time``), the steadiest
clock on a shared machine; otherwise wall time around synchronised
boundaries. Each block's time is the median of ``repeats`` steps and its
noise half the range of those samples: the planner breaks near-ties within
that noise toward the simpler plan.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._selective import RECOMPUTE_ENTRY
from .._state import ForwardState
from .._tree import tensors_in


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


@contextlib.contextmanager
def num_threads(device: torch.device, threads: int | None) -> Iterator[None]:
    if device.type != "cpu" or threads is None:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def make_clock(device: torch.device, threads: int | None) -> Callable[[], float]:
    if device.type == "cuda" or threads != 1:

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock if device.type == "cuda" else time.perf_counter
    return time.thread_time


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
    decisions: Sequence[str],
) -> dict[str, dict[str, float]]:
    """FLOPs each decision recomputes: the block's forward FLOPs (``recompute``), twice that
    (``split``), and those of the operators the planner's selective policy does not serve
    from its cache (``selective``: counted under the policy itself, so a matmul output it
    recomputes because the block changes it in place, as ``nn.GRU`` does, counts)."""
    from torch.utils.flop_counter import flop_registry

    from .._selective import create_selective_checkpoint_contexts
    from ..policies import save_matmuls

    out: dict[str, dict[str, float]] = {d: {} for d in decisions}
    inputs: dict[str, Any] = {}
    handles = [
        m.register_forward_pre_hook(_InputGrab(n, inputs), with_kwargs=True)
        for n, m in blocks.items()
    ]
    try:
        with torch.no_grad(), _quiet():
            model(*args, **kwargs)  # one forward records every block's inputs
    finally:
        for h in handles:
            h.remove()
    for n, m in blocks.items():
        save_mode, _ = create_selective_checkpoint_contexts(save_matmuls(prefer=True))
        counter = _CallFlops(flop_registry)
        block_args, block_kwargs, state = inputs[n]
        token = state.enter()  # the autocast (dtype, device) state the model called it under
        try:
            with torch.no_grad(), _quiet(), save_mode, counter:  # the counter sees calls first
                m(*block_args, **block_kwargs)
        finally:
            state.exit(token)
        entries = save_mode.store.entries  # type: ignore[attr-defined]
        total = float(sum(f for _, _, f in counter.calls))
        unsaved = float(
            sum(f for func, i, f in counter.calls if _entry(entries, func, i) is RECOMPUTE_ENTRY)
        )
        for d in decisions:
            out[d][n] = {
                "keep": 0.0,
                "recompute": total,
                "selective": unsaved,
                "offload": 0.0,
                "split": 2 * total,  # the block again, then each child again for its backward
            }[d]
    return out


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Warnings silenced: a model that checkpoints inside with torch's reentrant variant warns
    that no input requires grad, true in these forwards without gradients and not the
    user's concern."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _entry(entries: dict[Any, list[Any]], func: Any, i: int) -> Any:
    calls = entries.get(func, [])
    return calls[i] if i < len(calls) else None


class _CallFlops(TorchDispatchMode):
    """Each operator call's FLOPs (torch's flop formulas), with its index among the calls of
    that operator: ``(op, index, flops)``."""

    def __init__(self, registry: dict[Any, Any]) -> None:
        super().__init__()
        self.registry = registry
        self.calls: list[tuple[Any, int, float]] = []
        self.counts: dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        i = self.counts.get(func, 0)
        self.counts[func] = i + 1
        count = self.registry.get(func.overloadpacket)
        if count is not None:
            self.calls.append((func, i, float(count(*args, **kwargs, out_val=out))))
        return out


class _InputGrab:
    """Forward pre-hook (``with_kwargs=True``) that keeps a block's first inputs, keywords too,
    and the state the model called it under (autocast inside the model's forward, default
    dtype and device: :class:`~remat._state.ForwardState`), to run the block alone as it ran."""

    def __init__(self, name: str, store: dict[str, Any]) -> None:
        self.name = name
        self.store = store

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        if self.name not in self.store:
            state = ForwardState([], preserve_rng_state=False)
            self.store[self.name] = (args, dict(kwargs), state)
