"""The parts other than the planner's: environment, ``pytest -m gpu``, ``remat bench``,
offload against ``save_on_cpu`` and recompute, per-call overhead; and :data:`PARTS`."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.bench import report
from remat.bench import stats as bench_stats
from remat.bench.models import build, example_input
from remat.bench.runner import device_and_host_peaks, environment, run
from remat.bench.strategies import registry

from .device import PRECISIONS, ROOT, Check, allocator_window, autocast, release, sibling, sync
from .planner import part_planner
from .run import Deadline, Part, PartTimeout
from .shapes import part_shapes
from .suite import part_suite

# -- part 1: environment -------------------------------------------------------------------------


def part_environment(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """Versions, the device, and the library workspaces (warmed up before anything measures)."""
    dev = check.device
    found.update(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        dry_run=check.dry_run,
        device=str(dev),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        python=sys.version.split()[0],
        platform=platform.platform(),
        cpus=os.cpu_count(),
        threads=torch.get_num_threads(),
        remat=remat.__version__,
        remat_path=str(Path(remat.__file__).parent),
        commit=_command(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        dirty=bool(
            _command(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"])
        ),
    )
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        found.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_bytes=props.total_memory,
            multiprocessors=props.multi_processor_count,
            driver=_command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            tf32_cudnn=torch.backends.cudnn.allow_tf32,
            cudnn_benchmark=torch.backends.cudnn.benchmark,
        )
    found["workspace_bytes"] = warm_up_libraries(dev)
    if dev.type == "cuda":  # whether emptying the cache gives the workspaces back (then
        # every allocator window would count them again)
        before = torch.cuda.memory_allocated(dev)
        release(dev)
        found["workspace_bytes_freed_by_empty_cache"] = before - torch.cuda.memory_allocated(dev)


def _command(cmd: Sequence[str]) -> str | None:
    """A short command's stripped output, or None when it fails or is missing."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def warm_up_libraries(device: torch.device) -> int | None:
    """Run each kind of kernel the parts use once (matmul, convolution, attention; fp32
    and bf16; forward and backward) and return the bytes still allocated after: the
    workspaces cuBLAS and cuDNN keep for the process. None on CPU (nothing is kept)."""
    release(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    torch.manual_seed(0)
    lin = nn.Linear(64, 64).to(device)
    conv = nn.Conv2d(4, 4, 3, padding=1).to(device)
    for precision in PRECISIONS:
        with autocast(device, precision):
            x = torch.randn(32, 64, device=device, requires_grad=True)
            q = torch.randn(2, 2, 16, 32, device=device, requires_grad=True)
            img = torch.randn(2, 4, 8, 8, device=device, requires_grad=True)
            loss = lin(x).sum() + conv(img).sum()
            loss = loss + F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()
        loss.backward()
    del lin, conv, x, q, img, loss
    sync(device)
    gc.collect()
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_allocated(device) - before)


# -- part 2: pytest -m gpu -----------------------------------------------------------------------


def gpu_test_files(tests: Path) -> list[Path]:
    """The test files that use the ``gpu`` marker (collecting only them is seconds faster
    than collecting the whole suite)."""
    return sorted(p for p in tests.rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def pytest_env() -> dict[str, str]:
    """The environment of a pytest subprocess: ``src`` first on the path, and none of the
    variables of a pytest-xdist worker this check may run inside (a test's subprocess would
    otherwise read as a worker: pytest-benchmark then warns, an error here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.pop("PYTEST_CURRENT_TEST", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    return env


def part_pytest(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """``pytest -m gpu`` in a subprocess, outcomes read from its JUnit XML."""
    files = gpu_test_files(ROOT / "tests")
    xml = check.out / "pytest-gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={xml}", *(str(f.relative_to(ROOT)) for f in files)]
    found["command"] = " ".join(cmd[1:])
    found["files"] = [str(f.relative_to(ROOT)) for f in files]
    env = pytest_env()
    if xml.exists():
        xml.unlink()
    try:
        done = subprocess.run(
            cmd,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=max(deadline.left(), 1.0),
        )
    except subprocess.TimeoutExpired as e:
        found["cut_short"] = f"pytest killed at the part's limit ({e.timeout:.0f} s)"
        found["output_tail"] = _tail(e.stdout)
        return
    found["returncode"] = done.returncode
    found["output_tail"] = _tail(done.stdout + done.stderr)
    if not xml.exists():  # pytest missing, or it failed before running anything
        raise RuntimeError(
            f"pytest exited {done.returncode} without a report: {_tail(done.stderr, 3)}"
        )
    found.update(junit_outcomes(xml))


def _tail(text: str | bytes | None, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def junit_outcomes(path: Path) -> dict[str, Any]:
    """Counts and per-test outcomes (``passed``, ``failed``, ``error``, ``skipped``) of a
    JUnit XML file, with each non-pass's message."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = "failed" if tag == "failure" else tag
                text = (child.get("message") or child.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        tests.append({"test": name, "outcome": outcome, "message": message})
    counts = {
        k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")
    }
    return {"counts": counts, "tests": tests}


# -- part 4: remat bench ------------------------------------------------------------------------------


def part_bench(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """``remat bench``'s runner with every strategy on the device (offload included)."""
    cfg, sizes = check.sizes.bench, check.sizes
    reg = registry()
    names = list(sizes.bench_strategies or reg)
    found["model"] = dataclasses.asdict(cfg)
    found["command"] = (
        f"remat bench --device {check.device} --strategies {','.join(names)} "
        f"--layers {cfg.layers} --d-model {cfg.d_model} --seq {cfg.seq} --batch {cfg.batch} "
        f"--steps {sizes.bench_rounds}"
    )

    def tick(label: str, weight: float) -> None:
        found["last_done"] = label
        if deadline.passed():
            raise PartTimeout(f"time limit reached after {label!r}")

    with check.on_device():
        result = run(
            cfg,
            [reg[n] for n in names],
            device=check.device,
            steps=sizes.bench_rounds,
            clock="wall",
            progress=tick,
        )
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build(cfg, "meta").parameters())
    found["table"] = report.format_table(result)
    found["how"] = report.how_measured(result)
    found["recommendation"] = report.recommendation(result)
    found["plans_vs_uniform"] = report.against_uniform(result)
    found["noise"] = result.noise.describe()
    found["data"] = report.to_json(
        result, environment=environment(check.device, cfg, n_params), skipped=[]
    )


# -- part 5: offload against save_on_cpu and recompute ---------------------------------------------

OFFLOAD_CASES = ("keep", "recompute", "remat.offload", "save_on_cpu")
"""``keep``: no checkpointing; ``recompute``: ``remat.checkpoint`` on every block (the
bench's ``full``); ``remat.offload`` and ``save_on_cpu``: every tensor the forward saves in
pinned host memory, by remat's engine and by torch's hooks."""


def copy_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """Bytes per second of one device-to-host and one host-to-device copy of ``nbytes``
    through pinned memory (the best of three each; on CPU, host to host)."""
    pin = device.type == "cuda"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    out: dict[str, float] = {}
    for key, dst, src in (("d2h_bytes_per_s", host, dev), ("h2d_bytes_per_s", dev, host)):
        best = float("inf")
        for _ in range(3):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        out[key] = nbytes / max(best, 1e-9)
    return out


def _saving(case: str) -> contextlib.AbstractContextManager[Any]:
    if case == "remat.offload":
        return remat.offload()
    if case == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
    return contextlib.nullcontext()


def offload_step(model: nn.Module, x: torch.Tensor, case: str) -> remat.OffloadStats | None:
    """Forward under the case's saved-tensor hooks, backward after; remat's stats or None."""
    with _saving(case) as saved:
        loss = model(x)
    loss.backward()
    return saved if isinstance(saved, remat.OffloadStats) else None


def part_offload(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """Bytes, time and overlap of offloading against ``save_on_cpu`` and recompute."""
    cfg, dev = check.sizes.offload, check.device
    found["model"] = dataclasses.asdict(cfg)
    with check.on_device():
        found["bandwidth"] = bw = copy_bandwidth(dev, check.sizes.copy_bytes)
        x = example_input(cfg, dev)
        models = {c: build(cfg, dev) for c in OFFLOAD_CASES}
        registry()["full"].configure(models["recompute"], x)
        rows: dict[str, dict[str, Any]] = {}
        found["cases"] = rows
        reference: list[torch.Tensor] = []
        for case, m in models.items():  # gradients from one seed (dropout replayed), then bytes
            m.zero_grad(set_to_none=True)
            torch.manual_seed(1234)
            offload_step(m, x, case)
            grads = [p.grad.detach().clone() for p in m.parameters() if p.grad is not None]
            reference = reference or grads
            diff = max((float((a - b).abs().max()) for a, b in zip(grads, reference)), default=0.0)
            row = rows[case] = {"max_grad_diff": diff}
            m.zero_grad(set_to_none=False)  # gradients stay allocated: bytes are activations
            sync(dev)
            with remat.memory.track() as t:
                st = offload_step(m, x, case)
                sync(dev)
            row["device_peak"], row["host_peak"] = device_and_host_peaks(t, dev)
            row["offloaded_bytes"] = st.offloaded_bytes if st is not None else row["host_peak"]
            m.zero_grad(set_to_none=False)
            with allocator_window(dev) as w:
                offload_step(m, x, case)
            row["allocated_peak"], row["reserved_peak"] = w.allocated, w.reserved
            row["step_times_s"] = []
        for i in range(1 + check.sizes.offload_rounds):  # the first round warms up
            if deadline.passed():
                found["cut_short"] = f"time limit after {i} rounds"
                break
            k = i % len(OFFLOAD_CASES)  # rotated: no case always runs first
            order = OFFLOAD_CASES[k:] + OFFLOAD_CASES[:k]
            for case in order:
                m = models[case]
                m.zero_grad(set_to_none=False)
                sync(dev)
                t0 = time.perf_counter()
                offload_step(m, x, case)
                sync(dev)
                if i:
                    rows[case]["step_times_s"].append(time.perf_counter() - t0)
    offload_timing(rows, bw)


def offload_timing(rows: dict[str, dict[str, Any]], bw: dict[str, float]) -> None:
    """Add each case's median step time, its time ratio to ``keep`` (median of the paired
    per-round ratios) and, for cases that copy, the copies' time at the measured bandwidth
    and the share of it hidden behind compute: ``1 - (step - keep's step) / copies' time``
    (left out where the copies take under 1 % of the step)."""
    ref = rows["keep"]["step_times_s"]
    if not ref:
        return
    keep = statistics.median(ref)
    for row in rows.values():
        times = row["step_times_s"]
        row["step_s"] = statistics.median(times)
        row["time_ratio"] = bench_stats.spread(bench_stats.paired_ratios(times, ref)).median
        moved = row["offloaded_bytes"]
        if moved and row is not rows["keep"]:
            copy_s = moved / bw["d2h_bytes_per_s"] + moved / bw["h2d_bytes_per_s"]
            row["copy_s"] = copy_s
            if copy_s >= 0.01 * row["step_s"]:
                # a share of copies that take next to no time is noise over a tiny divisor
                # (the first GPU run printed -27661490 for recompute's few host bytes)
                row["hidden_share"] = 1 - (row["step_s"] - keep) / copy_s


# -- part 6: per-call overhead -----------------------------------------------------------------------


def part_overhead(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """benchmarks/overhead.py on the device: seconds per call and remat/torch overhead ratios."""
    overhead = sibling("overhead", ROOT / "benchmarks" / "overhead.py")
    rounds, calls = check.sizes.overhead_rounds, check.sizes.overhead_calls
    found["rounds"], found["calls"] = rounds, calls
    res = overhead.measure(rounds, calls, device=str(check.device))
    found["seconds_per_call"] = res
    found["ratios"] = overhead.overhead_ratios(res)
    if deadline.passed():
        found["cut_short"] = "time limit before the module wrapper"
        return
    mods = overhead.measure_modules(rounds, calls, device=str(check.device))
    found["module_wrapper"] = mods
    found["wrapper_ratio"] = overhead.overhead_ratio(
        mods, "remat checkpoint_wrapper", "torch checkpoint_wrapper"
    )


PARTS: dict[str, Part] = {
    "environment": part_environment,
    "pytest": part_pytest,
    "planner": part_planner,
    "shapes": part_shapes,
    "bench": part_bench,
    "offload": part_offload,
    "overhead": part_overhead,
    "suite": part_suite,
}
