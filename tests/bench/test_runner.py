"""Running strategies (remat.bench.runner): the CPU clock, calibration and progress, device bytes."""

from __future__ import annotations

import pytest
import torch

from remat.bench.runner import run, work
from remat.bench.strategies import registry
from tests.support.models import TINY_GPT

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cpu_clock_times_one_thread_only():
    result = run(TINY_GPT, [registry()["none"]], device=torch.device("cpu"), steps=2, clock="cpu")
    assert result.clock == "cpu" and result.threads == 1 and result.rounds == 2
    torch.set_num_threads(2)
    try:
        with pytest.raises(ValueError, match="one thread"):
            run(TINY_GPT, [registry()["none"]], device=torch.device("cpu"), steps=1, clock="cpu")
    finally:
        torch.set_num_threads(1)  # the module's one_thread fixture puts the count back after it


def test_run_reports_its_calibration_and_progress_adds_up_to_the_work():
    strategies = [registry()[n] for n in ("none", "full", "auto-50%")]
    seen: list[tuple[str, float]] = []
    calibrations: list[tuple[float, float]] = []
    run(
        TINY_GPT,
        strategies,
        device=torch.device("cpu"),
        steps=2,
        progress=lambda label, weight: seen.append((label, weight)),
        calibrated=lambda step, wall: calibrations.append((step, wall)),
    )
    assert len(calibrations) == 1 and all(t > 0 for t in calibrations[0])
    assert sum(w for _, w in seen) == pytest.approx(work(strategies, 2))
    assert seen[0][0] == "configure none"  # calibration comes before any other work


def test_device_runs_report_device_activation_bytes_and_host_bytes_apart():
    from types import SimpleNamespace

    from remat.bench.runner import device_and_host_peaks

    t = SimpleNamespace(peak_bytes=700, peak_bytes_by_device={"cuda:1": 500, "cpu": 200})
    assert device_and_host_peaks(t, torch.device("cuda", 1)) == (500, 200)
    assert device_and_host_peaks(t, torch.device("cpu")) == (700, 0)
