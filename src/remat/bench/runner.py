"""Run strategies on a benchmark model: peak memory, activation memory, step time, grad check.

Method
------
* One model per strategy, built from the same seed (identical weights), fed
  the same batch.
* Gradient check: each strategy runs one step from the same RNG seed; the
  largest absolute difference of any gradient to ``none`` is reported (0 on
  CPU: dropout is replayed exactly).
* Memory: gradients are allocated once beforehand (zeroed in place), so
  :func:`remat.memory.track` around a step counts activations and
  temporaries only: that peak is the *activation memory* (on a device, that
  device's own; host buffers of offload strategies are the separate
  ``host_bytes``). *Peak step memory* adds parameter and gradient bytes.
* Time: after warm-up (two rounds: on the 2-core CPU we measured, the first
  round after one warm-up step was still 10-25% slow for every strategy),
  steps of all strategies are interleaved one by one, so machine drift hits
  all alike, with the order rotated every round so that no strategy always
  runs first; the median per strategy is taken and every step's time kept.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import memory
from .models import ModelConfig, build, example_input, param_bytes
from .strategies import Strategy

WARMUP = 2
"""Warm-up rounds (one step of every strategy each) before the timed steps."""


@dataclasses.dataclass
class Row:
    """One strategy's measurements."""

    strategy: str
    description: str
    peak_bytes: int
    activation_bytes: int
    step_time_s: float
    memory_ratio: float = 1.0
    activation_ratio: float = 1.0
    time_ratio: float = 1.0
    max_grad_diff: float = 0.0
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    host_bytes: int = 0


def environment(device: torch.device, cfg: ModelConfig, n_params: int) -> dict[str, Any]:
    """What the numbers were measured on."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "model": dataclasses.asdict(cfg),
        "parameters": n_params,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: torch.nn.Module, batch: Any) -> None:
    model(batch).backward()


def run(
    cfg: ModelConfig,
    strategies: Sequence[Strategy],
    *,
    device: torch.device,
    steps: int,
    warmup: int = WARMUP,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Measure every strategy; ``progress(label)`` is called after each unit of work.

    Raises:
        ValueError: when two strategies share a name (their results are kept by name).
    """
    names = [s.name for s in strategies]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"run: strategy names must be unique, got {repeated} more than once.")
    tick = progress or (lambda label: None)
    batch = example_input(cfg, device)
    models = {}
    for s in strategies:
        m = build(cfg, device)
        m.train()
        s.configure(m, batch)
        models[s.name] = m
        tick(f"configure {s.name}")
    # gradient check, from the same RNG seed
    grads: dict[str, list[torch.Tensor]] = {}
    for s in strategies:
        m = models[s.name]
        torch.manual_seed(1234)
        if device.type == "cuda":
            torch.cuda.manual_seed_all(1234)
        _step(m, batch)
        grads[s.name] = [p.grad.detach().clone() for p in m.parameters() if p.grad is not None]
        tick(f"gradients {s.name}")
    # memory: grads exist now and are zeroed in place, so the tracker sees activations only
    mem: dict[str, int] = {}
    host: dict[str, int] = {}
    for s in strategies:
        m = models[s.name]
        m.zero_grad(set_to_none=False)
        _sync(device)
        with memory.track() as t:
            _step(m, batch)
            _sync(device)
        mem[s.name], host[s.name] = device_and_host_peaks(t, device)
        tick(f"memory {s.name}")
    times: dict[str, list[float]] = {s.name: [] for s in strategies}
    for i in range(warmup + steps):
        k = i % len(strategies)
        for s in [*strategies[k:], *strategies[:k]]:
            m = models[s.name]
            m.zero_grad(set_to_none=False)
            _sync(device)
            t0 = time.perf_counter()
            _step(m, batch)
            _sync(device)
            if i >= warmup:
                times[s.name].append(time.perf_counter() - t0)
            tick(f"step {s.name}")
    fixed = 2 * param_bytes(next(iter(models.values())))  # parameters + gradients
    rows = [
        Row(
            strategy=s.name,
            description=s.description,
            peak_bytes=fixed + mem[s.name],
            activation_bytes=mem[s.name],
            step_time_s=statistics.median(times[s.name]),
            step_times_s=times[s.name],
            host_bytes=host[s.name],
        )
        for s in strategies
    ]
    ref_name = "none" if "none" in models else strategies[0].name
    ref = next(r for r in rows if r.strategy == ref_name)
    for r in rows:
        r.memory_ratio = r.peak_bytes / ref.peak_bytes
        r.activation_ratio = r.activation_bytes / ref.activation_bytes
        r.time_ratio = r.step_time_s / ref.step_time_s
        r.max_grad_diff = max(
            (float((a - b).abs().max()) for a, b in zip(grads[r.strategy], grads[ref_name])),
            default=0.0,
        )
    return rows


def device_and_host_peaks(tracker: Any, device: torch.device) -> tuple[int, int]:
    """``(activation peak, host peak)`` of a tracked step.

    On CPU everything is host memory: the total peak and 0. On a device the
    activation peak is that device's own; pinned host buffers of an offload
    strategy are reported apart, as the host peak.
    """
    if device.type == "cpu":
        return tracker.peak_bytes, 0
    index = device.index
    if index is None:
        index = torch.get_device_module(device.type).current_device()
    by_device = tracker.peak_bytes_by_device
    return by_device.get(f"{device.type}:{index}", 0), by_device.get("cpu", 0)


def format_table(rows: Sequence[Row]) -> str:
    """The results as a fixed-width table."""
    w = max([16, *(len(r.strategy) + 2 for r in rows)])
    head = (
        f"{'strategy':<{w}}{'peak step':>12}{'activations':>13}{'step time':>11}"
        f"{'mem x':>8}{'act x':>8}{'time x':>8}{'max |dgrad|':>13}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.strategy:<{w}}{_mib(r.peak_bytes):>12}{_mib(r.activation_bytes):>13}"
            f"{r.step_time_s * 1e3:>8.0f} ms{r.memory_ratio:>8.2f}{r.activation_ratio:>8.2f}"
            f"{r.time_ratio:>8.2f}{r.max_grad_diff:>13.2e}"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
