"""Sizes of a GPU run and of a dry run, and what every part needs of the device: the
simulated device of a dry run, synchronization, and the allocator's window."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import remat
from remat.bench.models import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root."""

PRECISIONS = ("fp32", "bf16-autocast")
"""The forward's precisions the planner part checks (:func:`autocast`)."""


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    """Size of the planner part's CNN: residual conv blocks on square images."""

    blocks: int
    channels: int
    image: int
    batch: int


@dataclasses.dataclass(frozen=True)
class EncDecConfig:
    """Size of the planner part's encoder-decoder (tests/support/families.py's
    ``EncoderDecoder``: two stacks whose first block makes a bias the others receive)."""

    depth: int  # blocks per stack
    d: int
    seq: int
    batch: int


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Model sizes and repetitions of a run (:data:`GPU_SIZES` or :data:`DRY_SIZES`)."""

    gpt: ModelConfig  # planner part
    cnn: CNNConfig  # planner part
    encdec: EncDecConfig  # planner part
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
    encdec=EncDecConfig(depth=3, d=256, seq=256, batch=8),
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
    encdec=EncDecConfig(depth=2, d=8, seq=8, batch=2),
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
        return sibling("simdevice", ROOT / "tests" / "support" / "simdevice.py").simulated_device(0)


def release(device: torch.device) -> None:
    """Free what a part left: garbage, and on a device the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timings and allocator counters read after it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sibling(name: str, path: Path) -> ModuleType:
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


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    """The forward's precision: fp32, or bf16 autocast on the device's type."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
