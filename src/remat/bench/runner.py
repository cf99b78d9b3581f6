"""Run strategies on a benchmark model: peak memory, activation memory, step time, grad check.

Method
------
* One model per strategy, built from the same seed (identical weights), fed
  the same batch.
* Calibration: the reference model runs one cold step and one timed step
  first; that step time, with the relative costs in :data:`WEIGHTS`, gives the
  run's time estimate and the progress bar's units before the long work starts.
* Gradient check: each strategy runs one step from the same RNG seed; the
  largest absolute difference of any gradient to ``none`` is reported (0 on
  CPU: dropout is replayed exactly).
* Memory: gradients are allocated once beforehand (zeroed in place), so
  :func:`remat.memory.track` around a step counts activations and
  temporaries only: that peak is the *activation memory* (on a device, that
  device's own; host buffers of offload strategies are the separate
  ``host_bytes``). *Peak step memory* adds parameter and gradient bytes.
* Time: after ``warmup`` rounds, ``rounds`` rounds in each of which every
  strategy runs one step, the order rotated every round so that no strategy
  always runs first. Ratios are paired by round and their median and spread
  taken (:mod:`remat.bench.stats`): a slow patch of a shared machine that hits
  a round hits every strategy of it and cancels out of the ratios.
* Clock: wall time (``"wall"``), or the thread's CPU time (``"cpu"``, on CPU
  with one thread only: with one thread the forward and the backward both run
  on the calling thread, so its CPU time is the step's work, and time the
  scheduler gave to other processes is not counted).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import memory
from . import stats
from .models import ModelConfig, build, example_input, param_bytes
from .strategies import Strategy

WARMUP = 1
"""Warm-up rounds (one step of every strategy each) before the timed rounds. The gradient
and memory steps before them warm each model up too; a round that is still slow is slow
for every strategy in it and cancels out of the paired ratios."""

WEIGHTS = {
    "build": 0.1,  # build one model and configure it (no planning)
    "profile": 30.0,  # remat.profile of the first auto-N% strategy (one thread, 3 repeats)
    "plan": 4.0,  # remat.auto_checkpoint with that profile: plan, measured steps, fallback
    "grad": 1.2,  # the gradient-check step (cold for its model)
    "memory": 1.6,  # a step under remat.memory.track
    "step": 1.07,  # one timed step, averaged over the default strategies
}
"""Cost of each unit of work in reference steps (one step of ``none``), measured on the
project's 2-core CPU machine with the default model at one thread (CPU time); used for
the estimate and the progress bar only."""

CLOCKS = ("wall", "cpu")


@dataclasses.dataclass
class Row:
    """One strategy's measurements.

    ``step_time_s`` is the median over rounds, ``step_time_low_s``/``_high_s`` the
    spread (:func:`remat.bench.stats.spread`); ``time_ratio`` is the median of the
    per-round ratios to the reference (``time_ratios``), ``time_ratio_low``/``_high``
    their spread; ``ties`` the letters of :func:`remat.bench.stats.tie_letters`.
    ``details`` is what the strategy reported when it was configured (the plan of an
    ``auto-N%`` strategy, a note when it fell back).
    """

    strategy: str
    description: str
    peak_bytes: int
    activation_bytes: int
    step_time_s: float
    step_time_low_s: float = 0.0
    step_time_high_s: float = 0.0
    memory_ratio: float = 1.0
    activation_ratio: float = 1.0
    time_ratio: float = 1.0
    time_ratio_low: float = 1.0
    time_ratio_high: float = 1.0
    ties: str = ""
    max_grad_diff: float = 0.0
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    time_ratios: list[float] = dataclasses.field(default_factory=list)
    host_bytes: int = 0
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def note(self) -> str | None:
        """A footnote for the table (a fallback of the strategy), or None."""
        note = self.details.get("note")
        return None if note is None else str(note)


@dataclasses.dataclass
class Result:
    """A run: the rows, its timing noise, and how it was timed."""

    rows: list[Row]
    noise: stats.Noise
    reference: str
    rounds: int
    clock: str
    threads: int
    reference_step_s: float
    load_average: tuple[float | None, float | None]

    def recommended(self) -> list[Row]:
        """The row that stands for each recommended memory level, least memory first."""
        return [self.rows[c.row] for c in self.choices()]

    def choices(self) -> list[stats.Choice]:
        """:func:`remat.bench.stats.recommend` of the rows: memory levels as the table shows
        them (two decimals of the activation ratio: plans a few KiB apart are one level)."""
        return stats.recommend(
            [round(100 * r.activation_ratio) for r in self.rows],
            [stats.Spread(r.time_ratio, r.time_ratio_low, r.time_ratio_high) for r in self.rows],
        )


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def environment(device: torch.device, cfg: ModelConfig, n_params: int) -> dict[str, Any]:
    """What the numbers were measured on."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "device": str(device),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "model": dataclasses.asdict(cfg),
        "parameters": n_params,
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def work(strategies: Sequence[Strategy], rounds: int, warmup: int = WARMUP) -> float:
    """The run's work in reference steps (see :data:`WEIGHTS`), after calibration."""
    n = len(strategies)
    plans = sum(1 for s in strategies if s.plans)
    steps = WEIGHTS["grad"] + WEIGHTS["memory"] + (warmup + rounds) * WEIGHTS["step"]
    profiling = WEIGHTS["profile"] if plans else 0.0  # one profile serves every auto-N%
    return n * (WEIGHTS["build"] + steps) + plans * WEIGHTS["plan"] + profiling


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model: torch.nn.Module, batch: Any) -> None:
    model(batch).backward()


def _clock(clock: str, device: torch.device) -> Callable[[], float]:
    if clock not in CLOCKS:
        raise ValueError(f"run: clock must be one of {CLOCKS}, got {clock!r}.")
    if clock == "cpu":
        if device.type != "cpu" or torch.get_num_threads() != 1:
            raise ValueError(
                "run: clock='cpu' times the calling thread, which is the whole step only on CPU "
                f"with one thread (device {device}, {torch.get_num_threads()} threads); use "
                "clock='wall'."
            )
        return time.thread_time
    return time.perf_counter


def run(
    cfg: ModelConfig,
    strategies: Sequence[Strategy],
    *,
    device: torch.device,
    steps: int,
    warmup: int = WARMUP,
    clock: str = "wall",
    progress: Callable[[str, float], None] | None = None,
    calibrated: Callable[[float, float], None] | None = None,
) -> Result:
    """Measure every strategy over ``steps`` interleaved timed rounds.

    Args:
        cfg: the model.
        strategies: the first one named ``none``, else the first one, is the reference.
        device: where to run.
        steps: timed rounds (one step of every strategy each).
        warmup: untimed rounds before them.
        clock: ``"wall"`` or ``"cpu"`` (see the module docstring).
        progress: ``progress(label, weight)`` after each unit of work, ``weight`` its
            share of :func:`work` in reference steps.
        calibrated: called once with the reference's step time, on ``clock`` and in wall
            time (seconds), before any other work.

    Raises:
        ValueError: when two strategies share a name (their results are kept by name),
            or ``clock`` cannot time this setup.
    """
    names = [s.name for s in strategies]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"run: strategy names must be unique, got {repeated} more than once.")
    if steps < 1:
        raise ValueError(f"run: steps must be >= 1, got {steps}.")
    now = _clock(clock, device)
    tick = progress or (lambda label, weight: None)
    load_start = load_average()
    batch = example_input(cfg, device)
    ref_name = "none" if "none" in names else names[0]
    ordered = sorted(strategies, key=lambda s: s.name != ref_name)  # the reference first

    models: dict[str, torch.nn.Module] = {}
    details: dict[str, dict[str, Any]] = {}
    ref_step = 0.0
    profiled = False
    for s in ordered:
        m = build(cfg, device)
        m.train()
        details[s.name] = dict(s.configure(m, batch) or {})
        models[s.name] = m
        if s.name == ref_name:  # calibrate: a cold step, then a timed one
            _step(m, batch)
            _sync(device)
            t0, w0 = now(), time.perf_counter()
            _step(m, batch)
            _sync(device)
            ref_step = now() - t0
            if calibrated is not None:
                calibrated(ref_step, time.perf_counter() - w0)
        weight = WEIGHTS["build"]
        if s.plans:
            weight += WEIGHTS["plan"] + (0.0 if profiled else WEIGHTS["profile"])
            profiled = True
        tick(f"configure {s.name}", weight)
    # gradient check, from the same RNG seed
    grads: dict[str, list[torch.Tensor]] = {}
    for s in strategies:
        m = models[s.name]
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        if device.type == "cuda":
            torch.cuda.manual_seed_all(1234)
        _step(m, batch)
        grads[s.name] = [p.grad.detach().clone() for p in m.parameters() if p.grad is not None]
        tick(f"gradients {s.name}", WEIGHTS["grad"])
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
        tick(f"memory {s.name}", WEIGHTS["memory"])
    times: dict[str, list[float]] = {s.name: [] for s in strategies}
    for i in range(warmup + steps):
        k = i % len(strategies)
        for s in [*strategies[k:], *strategies[:k]]:
            m = models[s.name]
            m.zero_grad(set_to_none=False)
            _sync(device)
            t0 = now()
            _step(m, batch)
            _sync(device)
            if i >= warmup:
                times[s.name].append(now() - t0)
            tick(f"step {s.name}", WEIGHTS["step"])
    rows = _rows(strategies, ref_name, models, mem, host, times, grads, details)
    load_end = load_average()
    loads = [x for x in (load_start, load_end) if x is not None]
    ref_row = next(r for r in rows if r.strategy == ref_name)
    return Result(
        rows=rows,
        noise=stats.noise(
            ref_row.step_times_s,
            [
                stats.Spread(r.time_ratio, r.time_ratio_low, r.time_ratio_high)
                for r in rows
                if r is not ref_row
            ],
            load_average=max(loads) if loads else None,
            cpus=os.cpu_count() or 1,
            wall_clock=clock == "wall",
        ),
        reference=ref_name,
        rounds=steps,
        clock=clock,
        threads=torch.get_num_threads(),
        reference_step_s=ref_step,
        load_average=(load_start, load_end),
    )


def _rows(
    strategies: Sequence[Strategy],
    ref_name: str,
    models: dict[str, torch.nn.Module],
    mem: dict[str, int],
    host: dict[str, int],
    times: dict[str, list[float]],
    grads: dict[str, list[torch.Tensor]],
    details: dict[str, dict[str, Any]],
) -> list[Row]:
    fixed = 2 * param_bytes(next(iter(models.values())))  # parameters + gradients
    rows = []
    for s in strategies:
        t = stats.spread(times[s.name])
        ratios = stats.paired_ratios(times[s.name], times[ref_name])
        q = stats.spread(ratios)
        rows.append(
            Row(
                strategy=s.name,
                description=s.description,
                peak_bytes=fixed + mem[s.name],
                activation_bytes=mem[s.name],
                step_time_s=t.median,
                step_time_low_s=t.low,
                step_time_high_s=t.high,
                time_ratio=q.median,
                time_ratio_low=q.low,
                time_ratio_high=q.high,
                step_times_s=times[s.name],
                time_ratios=ratios,
                host_bytes=host[s.name],
                details=details[s.name],
            )
        )
    ref = next(r for r in rows if r.strategy == ref_name)
    letters = stats.tie_letters(
        [stats.Spread(r.time_ratio, r.time_ratio_low, r.time_ratio_high) for r in rows]
    )
    for r, tie in zip(rows, letters):
        r.memory_ratio = r.peak_bytes / ref.peak_bytes
        r.activation_ratio = r.activation_bytes / max(ref.activation_bytes, 1)
        r.ties = tie
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
