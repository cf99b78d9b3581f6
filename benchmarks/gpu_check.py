"""Everything a GPU changes, checked in one command of at most 8 minutes on one H100-class GPU.

GPU time comes rarely and in short stretches, so its minutes go to measuring, not to
writing the measuring code. On a CUDA device the script runs these parts in order, each
under its own time limit (:data:`LIMITS_S`): an exception or an overrun in one part is
recorded in the summary and the next part runs.

1. ``environment``: device name, capability and memory; torch, CUDA, cuDNN and driver
   versions; the bytes cuBLAS and cuDNN keep after their first kernels (allocated here,
   before any part measures, so that no part counts them).
2. ``pytest``: the GPU-marked tests (``pytest -m gpu``) in a subprocess.
3. ``planner``: planner exactness on the device. For a small GPT and a small CNN, each with
   AdamW, in fp32 and under bf16 autocast: one ``remat.profile``, then every per-block plan
   (one decision per block, every combination) applied to a freshly built model. Its
   predicted peak (``Profile.peak``) is compared with remat's meter
   (``remat.measure_peak``) and with the CUDA caching allocator: two steps of the same
   loop (``zero_grad()``, forward, backward, ``optimizer.step()``) between
   ``reset_peak_memory_stats()`` and ``max_memory_allocated()``, counted from before the
   model was built; ``max_memory_reserved()`` beside it.
4. ``bench``: ``remat bench``'s runner (:func:`remat.bench.runner.run`) on the device with
   every strategy, offload included, on a model large enough for the GPU, not Python, to
   set the pace of a step.
5. ``offload``: the offload engine (``remat.offload``) against
   ``torch.autograd.graph.save_on_cpu`` and against recompute: device and host bytes,
   step time, and the share of the copies' time hidden behind compute (the copies' time
   from the bytes moved and the measured pinned-copy bandwidth); gradients against no
   checkpointing with dropout on (CUDA RNG replay).
6. ``overhead``: per-call overhead of ``remat.checkpoint`` against
   ``torch.utils.checkpoint`` on the device (``benchmarks/overhead.py``).

After every part ``summary.json`` and ``summary.md`` are written under ``--out`` (default
``gpu-check/``): a run cut short keeps what it measured (a part still marked ``running``
was killed with the process). ``summary.md``, printed at the end, is laid out as the GPU
section of docs/BENCHMARKS.md.

``--dry-run`` runs the same code on CPU with tiny sizes in under a minute, the device-only
paths (offload) on the simulated asynchronous device of ``tests/simdevice.py`` and the
allocator's numbers replaced by ``remat.memory.track`` over the same steps; it keeps the
script from rotting (``tests/test_gpu_check.py``). Its numbers mean nothing.

Run: python benchmarks/gpu_check.py [--out DIR] [--parts planner,bench] [--dry-run]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.util
import itertools
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))  # check this checkout's remat, installed or not

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import remat  # noqa: E402
from remat.bench import report  # noqa: E402
from remat.bench import stats as bench_stats  # noqa: E402
from remat.bench.models import ModelConfig, build, example_input  # noqa: E402
from remat.bench.runner import device_and_host_peaks, environment, run  # noqa: E402
from remat.bench.strategies import registry  # noqa: E402

LIMITS_S = {
    "environment": 30.0,
    "pytest": 90.0,
    "planner": 100.0,
    "bench": 100.0,
    "offload": 60.0,
    "overhead": 40.0,
}
"""Each part's time limit in seconds. A part checks it between units of work (a plan, a
round) and stops there; a unit that overruns is interrupted :data:`GRACE_S` later. With the
grace, the parts add up to 8 minutes."""

GRACE_S = 10.0
"""How long past its limit a part runs before it is interrupted (SIGALRM)."""

TOTAL_S = sum(LIMITS_S.values()) + len(LIMITS_S) * GRACE_S

OUT_DIR = "gpu-check"


# -- sizes -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    """Size of the planner part's CNN: residual conv blocks on square images."""

    blocks: int
    channels: int
    image: int
    batch: int


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model sizes and repetitions of a run (:data:`GPU_SIZES` or :data:`DRY_SIZES`)."""

    gpt: ModelConfig  # planner part
    cnn: CNNConfig  # planner part
    max_plans: int | None  # per model and precision; None: every per-block plan
    bench: ModelConfig
    bench_rounds: int
    bench_strategies: tuple[str, ...] | None  # None: every strategy of the registry
    offload: ModelConfig
    offload_rounds: int
    overhead_rounds: int
    overhead_calls: int
    copy_bytes: int  # the pinned-copy bandwidth probe


GPU_SIZES = Sizes(
    gpt=ModelConfig(layers=3, d_model=256, seq=256, batch=8, heads=4, vocab=1024),
    cnn=CNNConfig(blocks=3, channels=64, image=32, batch=32),
    max_plans=None,
    # ~92M parameters, ~3 GB of activations a step, matmuls of 4096 x 1024 and up: about
    # a TFLOP a step, tens of milliseconds of GPU time against a few of Python
    bench=ModelConfig(layers=6, d_model=1024, seq=1024, batch=4, heads=16, vocab=8192),
    bench_rounds=5,
    bench_strategies=None,
    offload=ModelConfig(layers=6, d_model=1024, seq=1024, batch=4, heads=16, vocab=8192),
    offload_rounds=3,
    overhead_rounds=10,
    overhead_calls=100,
    copy_bytes=256 * 2**20,
)

DRY_SIZES = Sizes(
    gpt=ModelConfig(layers=2, d_model=16, seq=8, batch=2, heads=2, vocab=32),
    cnn=CNNConfig(blocks=2, channels=4, image=8, batch=2),
    max_plans=3,
    bench=ModelConfig(layers=2, d_model=16, seq=8, batch=2, heads=2, vocab=32),
    bench_rounds=1,
    # one strategy of each kind: plain, remat, selective, offload (both), torch, wrapper, planner
    bench_strategies=(
        "none",
        "full",
        "selective",
        "offload",
        "offload-blocks",
        "torch-full",
        "wrapper",
        "auto-50%",
    ),
    offload=ModelConfig(layers=2, d_model=16, seq=8, batch=2, heads=2, vocab=32),
    offload_rounds=1,
    overhead_rounds=1,
    overhead_calls=3,
    copy_bytes=2**16,
)


# -- the run: its settings, time limits, parts ---------------------------------------------------


@dataclasses.dataclass
class Check:
    """What every part needs: where it runs, at which sizes, where results go."""

    device: torch.device
    dry_run: bool
    sizes: Sizes
    out: Path

    def on_device(self) -> contextlib.AbstractContextManager[Any]:
        """The device the offload engine sees: the simulated one in a dry run, else the real one."""
        if not self.dry_run:
            return contextlib.nullcontext()
        return _sibling("simdevice", ROOT / "tests" / "simdevice.py").simulated_device(0)


class PartTimeout(BaseException):
    """A part ran past its hard limit. A ``BaseException``, as ``KeyboardInterrupt``: no
    ``except Exception`` on the way out (remat's steps restore state with those) swallows it."""


class Deadline:
    """A part's time limit, checked between units of work."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (negative once passed)."""
        return self.end - time.monotonic()

    def passed(self) -> bool:
        """True once the limit is reached."""
        return self.left() <= 0


@contextlib.contextmanager
def hard_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`PartTimeout` in the block after ``seconds`` (SIGALRM; the main thread of
    a POSIX process only, elsewhere the block just runs). The previous handler is put back."""
    if (
        not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise PartTimeout(f"interrupted {seconds:.0f} s after it started (its hard limit)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


Part = Callable[[Check, dict[str, Any], Deadline], None]
"""``part(check, found, deadline)`` fills ``found`` as it measures (what it has stays when it
fails) and sets ``found["cut_short"]`` when it stopped at ``deadline``."""


def run_part(
    name: str,
    part: Part,
    check: Check,
    summary: dict[str, Any],
    limit_s: float,
    grace_s: float = GRACE_S,
) -> dict[str, Any]:
    """Run one part under its limits, record its status, time and results, save the summary.

    The status is ``ok``, ``partial`` (stopped at ``limit_s`` between units of work),
    ``timeout`` (interrupted ``grace_s`` past it), or ``error`` (an exception, recorded
    with its traceback); the next part runs in every case.
    """
    found: dict[str, Any] = {}
    entry: dict[str, Any] = {"status": "running", "seconds": None, "limit_s": limit_s}
    entry["results"] = found
    summary["parts"][name] = entry
    save(summary, check.out)  # a part left "running" was killed with the process
    start = time.monotonic()
    try:
        with hard_limit(limit_s + grace_s):
            part(check, found, Deadline(limit_s))
        entry["status"] = "partial" if found.get("cut_short") else "ok"
    except PartTimeout as e:
        entry["status"], entry["error"] = "timeout", str(e)
    except Exception as e:  # recorded; the other parts still run
        entry["status"], entry["error"] = "error", f"{type(e).__name__}: {e}"
        entry["traceback"] = traceback.format_exc()
    finally:
        entry["seconds"] = round(time.monotonic() - start, 1)
        release(check.device)
        save(summary, check.out)
    return entry


def release(device: torch.device) -> None:
    """Free what a part left: garbage, and on a device the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sibling(name: str, path: Path) -> ModuleType:
    """A module of this checkout loaded from its file (benchmarks/ and tests/ are not packages)."""
    key = f"_gpu_check_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"gpu_check: cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[key]


@dataclasses.dataclass
class Window:
    """Peak bytes of one allocator window (:func:`allocator_window`)."""

    allocated: int = 0
    reserved: int | None = None


@contextlib.contextmanager
def allocator_window(device: torch.device) -> Iterator[Window]:
    """The allocator's peak over the block, counted from the block's start.

    On CUDA: ``max_memory_allocated()`` and ``max_memory_reserved()`` after
    ``reset_peak_memory_stats()``, less what was allocated / reserved when the block
    started (the cache emptied first, so reserved bytes are the block's own). On CPU (a dry
    run) there is no allocator counter: ``remat.memory.track`` over the block stands in.
    """
    w = Window()
    if device.type != "cuda":
        with remat.memory.track() as t:
            yield w
        w.allocated = t.peak_bytes
        return
    release(device)
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield w
    torch.cuda.synchronize(device)
    w.allocated = torch.cuda.max_memory_allocated(device) - allocated
    w.reserved = torch.cuda.max_memory_reserved(device) - reserved


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
    _sync(device)
    gc.collect()
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_allocated(device) - before)


# -- part 2: pytest -m gpu -----------------------------------------------------------------------


def gpu_test_files(tests: Path) -> list[Path]:
    """The test files that use the ``gpu`` marker (collecting only them is seconds faster
    than collecting the whole suite)."""
    return sorted(p for p in tests.rglob("test_*.py") if "pytest.mark.gpu" in p.read_text())


def part_pytest(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """``pytest -m gpu`` in a subprocess, outcomes read from its JUnit XML."""
    files = gpu_test_files(ROOT / "tests")
    xml = check.out / "pytest-gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={xml}", *(str(f.relative_to(ROOT)) for f in files)]
    found["command"] = " ".join(cmd[1:])
    found["files"] = [str(f.relative_to(ROOT)) for f in files]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
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


# -- part 3: planner exactness ---------------------------------------------------------------------


class ConvBlock(nn.Module):
    """Residual block: conv, BatchNorm, ReLU, conv, BatchNorm, skip, ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))  # type: ignore[no-any-return]


class CNN(nn.Module):
    """A stem, ``blocks`` residual conv blocks (the planner's candidates), pooling, a linear
    head; ``forward(images)`` returns a scalar loss."""

    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, cfg.channels, 3, padding=1)
        self.blocks = nn.Sequential(*(ConvBlock(cfg.channels) for _ in range(cfg.blocks)))
        self.head = nn.Linear(cfg.channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.stem(x)))
        return self.head(h.mean((2, 3))).square().mean()  # type: ignore[no-any-return]


PLANNER_MODELS = ("gpt", "cnn")
PRECISIONS = ("fp32", "bf16-autocast")


def planner_model(check: Check, name: str) -> tuple[nn.Module, torch.Tensor]:
    """A freshly built model of the planner part and its input, the same every call."""
    if name == "gpt":
        cfg = check.sizes.gpt
        return build(cfg, check.device), example_input(cfg, check.device)
    c = check.sizes.cnn
    torch.manual_seed(0)
    model = CNN(c).to(check.device)
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(c.batch, 3, c.image, c.image, generator=g).to(check.device)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The forward's precision: fp32, or bf16 autocast on the device's type."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def plan_of(prof: remat.Profile, decisions: Sequence[str]) -> remat.Plan:
    """A :class:`remat.Plan` of one given decision per block, its peak and budget the
    profile's prediction (public API only: ``Profile.peak``, the ``Plan`` fields)."""
    names = [b.name for b in prof.blocks]
    predicted = prof.peak(list(decisions)).bytes
    return remat.Plan(
        decisions=dict(zip(names, decisions)),
        predicted_peak_bytes=predicted,
        predicted_overhead_s=0.0,
        unchecked_peak_bytes=prof.unchecked_peak_bytes,
        budget_bytes=predicted,
        scratch_bytes=prof.scratch_bytes,
    )


def train_steps(
    model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer, precision: str, steps: int = 2
) -> None:
    """``steps`` steps of the default loop (the first creates the optimizer state); under
    autocast, forward and loss inside the region, backward and step after it."""
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with autocast(x.device, precision):
            loss = model(x)
        loss.backward()
        opt.step()
        del loss


def measure_plan(
    check: Check, name: str, precision: str, prof: remat.Profile, decisions: Sequence[str]
) -> dict[str, Any]:
    """One per-block plan on a fresh model: predicted, remat's meter, the allocator."""
    plan = plan_of(prof, decisions)
    with allocator_window(check.device) as w:
        model, x = planner_model(check, name)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        plan.apply(model)
        train_steps(model, x, opt, precision)
    opt.zero_grad(set_to_none=True)
    opt.state.clear()  # measure_peak starts from no optimizer state, as the loop above did
    with autocast(check.device, precision):
        tracked = remat.measure_peak(model, x, optimizer=opt)
    return {
        "decisions": list(decisions),
        "predicted": plan.predicted_peak_bytes,
        "tracker": tracked,
        "allocated": w.allocated,
        "reserved": w.reserved,
    }


def planner_stats(row: dict[str, Any]) -> dict[str, Any]:
    """What a model and precision's plans show: how many the tracker measured as predicted,
    and how far the tracker and the allocator are from the prediction (min, max)."""
    plans = row["plans"]
    if not plans:
        return {"measured": 0}
    track = [p["tracker"] - p["predicted"] for p in plans]
    alloc = [p["allocated"] - p["predicted"] for p in plans]
    scratch = row["scratch_bytes"]
    out: dict[str, Any] = {
        "measured": len(plans),
        "tracker_exact": sum(d == 0 for d in track),
        "tracker_minus_predicted": [min(track), max(track)],
        "allocated_minus_predicted": [min(alloc), max(alloc)],
        "allocated_within_scratch": sum(0 <= d <= scratch for d in alloc),
    }
    reserved = [p["reserved"] - p["allocated"] for p in plans if p["reserved"] is not None]
    if reserved:
        out["reserved_minus_allocated"] = [min(reserved), max(reserved)]
    return out


def part_planner(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """Every per-block plan of each model and precision, predicted against measured.

    Each model and precision gets an equal share of the time left; plans are measured in
    a fixed shuffled order, so a share that runs out leaves a sample of all of them.
    """
    configs = list(itertools.product(PLANNER_MODELS, PRECISIONS))
    found["configs"] = rows = []
    for k, (name, precision) in enumerate(configs):
        share = Deadline(deadline.left() / (len(configs) - k))
        row: dict[str, Any] = {"model": name, "precision": precision, "plans": []}
        rows.append(row)
        with check.on_device():
            model, x = planner_model(check, name)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            with autocast(check.device, precision):
                prof = remat.profile(model, x, optimizer=opt, timer="flops")
            del model, x, opt
            every = list(itertools.product(prof.decisions, repeat=len(prof.blocks)))
            random.Random(0).shuffle(every)
            chosen = every if check.sizes.max_plans is None else every[: check.sizes.max_plans]
            row.update(
                blocks=[b.name for b in prof.blocks],
                decisions=list(prof.decisions),
                per_block_plans=len(every),
                scratch_bytes=prof.scratch_bytes,
                static_bytes=prof.static_step_bytes,
                unchecked_peak_bytes=prof.unchecked_peak_bytes,
            )
            for ds in chosen:
                if share.passed():
                    row["cut_short"] = f"time share used up after {len(row['plans'])} plans"
                    found["cut_short"] = "a model's time share ran out"
                    break
                row["plans"].append(measure_plan(check, name, precision, prof, ds))
                row["stats"] = planner_stats(row)
            release(check.device)


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
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            _sync(device)
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
            _sync(dev)
            with remat.memory.track() as t:
                st = offload_step(m, x, case)
                _sync(dev)
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
                _sync(dev)
                t0 = time.perf_counter()
                offload_step(m, x, case)
                _sync(dev)
                if i:
                    rows[case]["step_times_s"].append(time.perf_counter() - t0)
    offload_timing(rows, bw)


def offload_timing(rows: dict[str, dict[str, Any]], bw: dict[str, float]) -> None:
    """Add each case's median step time, its time ratio to ``keep`` (median of the paired
    per-round ratios) and, for cases that copy, the copies' time at the measured bandwidth
    and the share of it hidden behind compute: ``1 - (step - keep's step) / copies' time``."""
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
            row["hidden_share"] = 1 - (row["step_s"] - keep) / copy_s


# -- part 6: per-call overhead -----------------------------------------------------------------------


def part_overhead(check: Check, found: dict[str, Any], deadline: Deadline) -> None:
    """benchmarks/overhead.py on the device: seconds per call and remat/torch overhead ratios."""
    overhead = _sibling("overhead", ROOT / "benchmarks" / "overhead.py")
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
    "bench": part_bench,
    "offload": part_offload,
    "overhead": part_overhead,
}


# -- the summary -------------------------------------------------------------------------------------


def save(summary: dict[str, Any], out: Path) -> None:
    """Write ``summary.json`` and ``summary.md`` under ``out`` (each replaced whole)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("summary.json", json.dumps(summary, indent=2, default=str)),
        ("summary.md", render(summary)),
    ):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**20:.1f} MiB"


def _range(lo_hi: Sequence[int] | None) -> str:
    if not lo_hi:
        return ""
    lo, hi = lo_hi
    return f"{lo}" if lo == hi else f"{lo} .. {hi}"


def part_line(name: str, found: dict[str, Any]) -> str:
    """One cell: what the part found, in a few words."""
    if name == "environment":
        return f"{found.get('gpu', found.get('device', ''))}, workspaces {_mib(found.get('workspace_bytes'))}"
    if name == "pytest":
        c = found.get("counts")
        return ", ".join(f"{v} {k}" for k, v in c.items()) if c else found.get("cut_short", "")
    if name == "planner":
        cells = []
        for row in found.get("configs", []):
            s = row.get("stats", {})
            cells.append(
                f"{row['model']} {row['precision']}: {s.get('tracker_exact', 0)}/"
                f"{s.get('measured', 0)} exact"
            )
        return "; ".join(cells)
    if name == "bench":
        return found.get("recommendation", "")
    if name == "offload":
        cases = found.get("cases", {})
        return "; ".join(
            f"{c} {r['time_ratio']:.2f}x" for c, r in cases.items() if "time_ratio" in r
        )
    if name == "overhead":
        r = found.get("ratios", {}).get("sin", {})
        return "remat/torch on sin: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()) if r else ""
    return ""


def render(summary: dict[str, Any]) -> str:
    """summary.md: docs/BENCHMARKS.md's GPU section, filled with this run's numbers."""
    parts = summary["parts"]
    env = parts.get("environment", {}).get("results", {})
    what = "dry run on CPU (numbers mean nothing)" if summary["dry_run"] else env.get("gpu", "?")
    lines = [
        f"### GPU check: {what} ({summary['started']})",
        "",
        f"`{summary['command']}`, {summary.get('seconds', '?')} s. torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}, driver {env.get('driver')}, "
        f"remat {env.get('remat')} at {env.get('commit')}{' (modified)' if env.get('dirty') else ''}; "
        f"capability {env.get('capability')}, {_mib(env.get('gpu_memory_bytes'))}; "
        f"cuBLAS/cuDNN workspaces {_mib(env.get('workspace_bytes'))}.",
        "",
        "| part | status | seconds | limit s | result |",
        "|---|---|---|---|---|",
    ]
    for name, entry in parts.items():
        result = part_line(name, entry["results"])
        if entry.get("error"):
            result = f"{entry['error'][:200]}; {result}"
        lines.append(
            f"| {name} | {entry['status']} | {entry['seconds']} | {entry['limit_s']:.0f} | "
            f"{result.replace('|', '/')} |"
        )
    for name, fn in (
        ("pytest", _render_pytest),
        ("planner", _render_planner),
        ("bench", _render_bench),
        ("offload", _render_offload),
        ("overhead", _render_overhead),
    ):
        if name in parts:
            lines += ["", *fn(parts[name]["results"])]
    return "\n".join(lines) + "\n"


def _render_pytest(found: dict[str, Any]) -> list[str]:
    lines = ["#### `pytest -m gpu`", ""]
    bad = [t for t in found.get("tests", []) if t["outcome"] != "passed"]
    if "counts" in found:
        lines.append(", ".join(f"{v} {k}" for k, v in found["counts"].items()) + ".")
    for t in bad:
        lines.append(f"- {t['outcome']}: `{t['test']}`: {t['message']}")
    return lines


def _render_planner(found: dict[str, Any]) -> list[str]:
    lines = [
        "#### Planner exactness (per-block plans, AdamW; bytes: measured - predicted)",
        "",
        "| model | precision | plans | tracker exact | tracker | allocator | allocator within scratch | scratch | reserved - allocated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    off = []
    for row in found.get("configs", []):
        s = row.get("stats", {})
        lines.append(
            f"| {row['model']} | {row['precision']} | {s.get('measured', 0)}/"
            f"{row.get('per_block_plans', '?')} | {s.get('tracker_exact', '')} | "
            f"{_range(s.get('tracker_minus_predicted'))} | "
            f"{_range(s.get('allocated_minus_predicted'))} | "
            f"{s.get('allocated_within_scratch', '')} | {row.get('scratch_bytes', '')} | "
            f"{_range(s.get('reserved_minus_allocated'))} |"
        )
        off += [(row, p) for p in row["plans"] if p["tracker"] != p["predicted"]]
    if off:
        lines += ["", "Plans the tracker did not measure as predicted (first 10):", ""]
        lines += ["| model | precision | decisions | predicted | tracker | allocator |"]
        lines += ["|---|---|---|---|---|---|"]
        for row, p in off[:10]:
            lines.append(
                f"| {row['model']} | {row['precision']} | {','.join(p['decisions'])} | "
                f"{p['predicted']} | {p['tracker']} | {p['allocated']} |"
            )
    return lines


def _render_bench(found: dict[str, Any]) -> list[str]:
    m = found.get("model", {})
    lines = [
        f"#### `remat bench` ({m.get('layers')} layers, d={m.get('d_model')}, seq {m.get('seq')}, "
        f"batch {m.get('batch')})",
        "",
    ]
    if "table" in found:
        lines += ["```text", found["table"], "```", "", found["how"], found["recommendation"]]
        lines.append(found["noise"])
    elif "last_done" in found:
        lines.append(f"Stopped after {found['last_done']}.")
    return lines


def _render_offload(found: dict[str, Any]) -> list[str]:
    bw = found.get("bandwidth", {})
    lines = [
        "#### Offload: remat.offload against save_on_cpu and recompute",
        "",
        f"Pinned copies: device to host {bw.get('d2h_bytes_per_s', 0) / 1e9:.1f} GB/s, "
        f"host to device {bw.get('h2d_bytes_per_s', 0) / 1e9:.1f} GB/s.",
        "",
        "| strategy | device peak | allocator peak | host bytes | step | time x | copies | hidden | max abs dgrad |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, r in found.get("cases", {}).items():
        step = f"{r['step_s'] * 1e3:.1f} ms" if "step_s" in r else ""
        ratio = f"{r['time_ratio']:.2f}" if "time_ratio" in r else ""
        copy = f"{r['copy_s'] * 1e3:.1f} ms" if "copy_s" in r else ""
        hidden = f"{r['hidden_share']:.2f}" if "hidden_share" in r else ""
        lines.append(
            f"| {case} | {_mib(r['device_peak'])} | {_mib(r['allocated_peak'])} | "
            f"{_mib(r['offloaded_bytes'])} | {step} | {ratio} | {copy} | {hidden} | "
            f"{r['max_grad_diff']:.2g} |"
        )
    return lines


def _render_overhead(found: dict[str, Any]) -> list[str]:
    lines = [
        "#### Per-call overhead (remat's over torch's, above the plain call)",
        "",
        "| op | plain call | non-reentrant | reentrant | selective |",
        "|---|---|---|---|---|",
    ]
    for op, ratios in found.get("ratios", {}).items():
        plain = found["seconds_per_call"][op]["plain"]
        cells = " | ".join(f"{ratios[v]:.2f}" for v in ("non-reentrant", "reentrant", "selective"))
        lines.append(f"| {op} | {plain * 1e6:.1f} us | {cells} |")
    if "wrapper_ratio" in found:
        lines += ["", f"Module wrapper: {found['wrapper_ratio']:.2f}."]
    return lines


# -- command line -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(
            f"Check everything a GPU changes: GPU tests, planner exactness against the CUDA "
            f"allocator, remat bench, offload, per-call overhead. Takes at most "
            f"{TOTAL_S / 60:.0f} minutes on one H100-class GPU (each part has a time limit); "
            "--dry-run: under a minute on CPU. Writes summary.md and summary.json after "
            "every part."
        )
    )
    ap.add_argument("--out", default=OUT_DIR, help=f"result folder (default {OUT_DIR}/)")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="the same code on CPU, tiny sizes, offload on the simulated device (tests/simdevice.py)",
    )
    ap.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated parts to run (default all: {','.join(PARTS)})",
    )
    ap.add_argument("--device", default=None, help="default cuda (cpu with --dry-run)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the parts; 0 when every part ran (``ok`` or ``partial``) and no GPU test failed."""
    args = parse_args(argv)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        print(
            f"gpu_check: --parts: unknown {unknown}; choose from {', '.join(PARTS)}.",
            file=sys.stderr,
        )
        return 2
    device = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device (torch {torch.__version__}); run with --dry-run to "
            "check the script on CPU.",
            file=sys.stderr,
        )
        return 2
    if device.type == "cuda" and args.dry_run:
        print("gpu_check: --dry-run runs on CPU; drop --device.", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if args.dry_run:
        torch.set_num_threads(1)
    check = Check(device, args.dry_run, DRY_SIZES if args.dry_run else GPU_SIZES, Path(args.out))
    summary: dict[str, Any] = {
        "script": "benchmarks/gpu_check.py",
        "command": " ".join(
            ["python benchmarks/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "dry_run": args.dry_run,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "parts": {},
    }
    start = time.monotonic()
    try:
        for name in names:
            print(f"gpu_check: {name} (limit {LIMITS_S[name]:.0f} s) ...", flush=True)
            entry = run_part(name, PARTS[name], check, summary, LIMITS_S[name])
            summary["seconds"] = round(time.monotonic() - start, 1)
            print(f"gpu_check: {name}: {entry['status']} in {entry['seconds']} s", flush=True)
    finally:
        torch.set_num_threads(threads)
        save(summary, check.out)
    print()
    print(render(summary))
    print(f"wrote {check.out / 'summary.md'} and {check.out / 'summary.json'}")
    return 0 if succeeded(summary) else 1


def succeeded(summary: dict[str, Any]) -> bool:
    """Every part ran (``ok`` or ``partial``) and no GPU test failed or errored."""
    parts = summary["parts"].values()
    if any(p["status"] not in ("ok", "partial") for p in parts):
        return False
    counts = summary["parts"].get("pytest", {}).get("results", {}).get("counts", {})
    return not counts.get("failed") and not counts.get("error")


if __name__ == "__main__":
    raise SystemExit(main())
