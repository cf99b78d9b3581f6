"""Per-device constants that turn counted work into seconds, timed once and kept.

The cost model (:func:`remat.planner.timing.modelled_costs`) prices one operator call
(:class:`~remat.planner.counting.OpCount`) as::

    flops / flop_rate[kind] + bytes / byte_rate + per_op

and a checkpointed block adds one region's overhead. The constants (:class:`Constants`)
come from micro-benchmarks on the device, with the profile's threads and clock (thread CPU
time on CPU with one thread, else wall time around synchronisations):

* ``host_rate`` (on a GPU): bytes per second of a copy into pinned host memory;
* ``mm_rate`` / ``conv_rate``: FLOPs per second of a 256x256 matmul chain and a 3x3
  convolution, ``byte_rate``: bytes per second of a mix of pointwise operators (add, mul,
  GELU, softmax, layer norm) on 2**18 elements, ``norm_rate`` of a training-mode batch norm
  (its statistics: about 4x dearer per byte than pointwise on a 2-core AMD EPYC) on as many
  (0 in calibrations made before it: the byte rate), ``random_rate`` of dropout's mask
  (``bernoulli_``) on as many, counted by the same counting mode that
  counts the model (:func:`~remat.planner.counting.count_call`);
* ``per_op``: what one tiny operator adds when its block is recomputed (dispatch,
  autograd, saved-tensor hooks), ``saved_op`` / ``recomputed_op``: what one tiny operator
  adds under the ``selective`` decision when its cache saves it (a matmul) or recomputes
  it (a pointwise op), and ``region`` / ``selective_region``: a checkpoint's fixed cost.
  Each is the slope (per operator) or intercept (per region) of a chain's extra step time
  at two lengths, 8 and 64 operators, against the same chain kept.

Each timing is the smallest of several runs (the least disturbed by other work on the
machine), each constant rounded to the nearest step of a grid of ``2**(1/4)`` (about 19 %),
and the result is cached on disk per device (its name), dtype, torch version and thread
count: ``$REMAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/remat``, else ``~/.cache/remat``. The
first process that calibrates writes the file atomically and only if it is not there yet
(a hard link from a temporary file: two processes that calibrate at once both read the one
that won), so every later profile on that machine, in any process, prices work with the
very same constants: with counted work, the same model, inputs and budget give the same
plan by construction, however busy the machine is. Where the cache cannot be written, each
process calibrates once for itself; the grid makes equal constants likely, not certain.
Delete the file to calibrate again (after a driver or hardware change).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .apply import apply_decision
from .counting import OpKind, count_call
from .types import RECOMPUTE, SELECTIVE, Decision

#: Version of the micro-benchmarks: a change that moves the constants bumps it, so that old
#: cache files are not read.
VERSION = 3

#: Steps per octave of the grid the constants are rounded to.
GRID = 4


@dataclasses.dataclass(frozen=True)
class Constants:
    """The calibrated constants of one device, dtype and thread count (see the module
    docstring): rates per second, overheads in seconds."""

    mm_rate: float
    conv_rate: float
    byte_rate: float
    random_rate: float
    per_op: float
    saved_op: float
    recomputed_op: float
    region: float
    selective_region: float
    host_rate: float
    norm_rate: float = 0.0

    def op_seconds(self, kind: OpKind, flops: float, moved: int) -> float:
        """The compute time of one operator call, without its per-call overhead."""
        rate = self.conv_rate if kind == "conv" else self.mm_rate
        per_byte = self.byte_rate
        if kind == "random":
            per_byte = self.random_rate
        elif kind == "norm" and self.norm_rate:  # calibrations before it: the byte rate
            per_byte = self.norm_rate
        return (flops / rate if flops else 0.0) + moved / per_byte


def cache_dir() -> pathlib.Path:
    """Where calibrations are kept (see the module docstring)."""
    env = os.environ.get("REMAT_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg) if xdg else pathlib.Path.home() / ".cache"
    return base / "remat"


def device_key(device: torch.device, dtype: torch.dtype, threads: int | None) -> str:
    """What a calibration holds for: the device's name, the dtype, torch, the threads."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = _cpu_name()
    n = torch.get_num_threads() if threads is None else threads
    return f"v{VERSION}|{device.type}|{name}|{dtype}|torch {torch.__version__}|threads {n}"


def constants(
    device: torch.device,
    dtype: torch.dtype,
    threads: int | None,
    calibration: str | os.PathLike[str] | None = None,
) -> Constants:
    """The device's constants for ``dtype``: from the cache, else calibrated now and cached;
    with ``calibration``, those of a saved calibration (:func:`named`)."""
    if calibration is not None:
        return named(calibration, dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "remat: pricing a plan for a CUDA device needs that device's calibration, and "
            "this machine has no CUDA device: pass calibration= a GPU's name (one saved by "
            f"benchmarks/gpu_check.py: {sorted(saved_names()) or 'none yet'}) or a file "
            "written by remat.planner.calibration.save on the GPU, or timer='flops'."
        )
    key = device_key(device, dtype, threads)
    return _cached(str(cache_file(key)), key, str(device), str(dtype), threads)


#: Calibrations that ship with remat (GPUs measured by ``benchmarks/gpu_check.py``).
SHIPPED = pathlib.Path(__file__).parent / "calibrations"


def save(
    path: str | os.PathLike[str],
    device: torch.device | str | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
    threads: int | None = 1,
) -> pathlib.Path:
    """Calibrate ``device`` (default: the current CUDA device, else the CPU) for each of
    ``dtypes`` (the cache's if there) and write them to one JSON file, which
    ``remat.profile(..., calibration=path)`` reads on any machine: plans for a GPU priced
    from a CPU machine.

    Example:
        >>> import tempfile, os, torch
        >>> from remat.planner import calibration
        >>> f = calibration.save(os.path.join(tempfile.mkdtemp(), "cpu.json"), "cpu",
        ...                      dtypes=(torch.float32,))
        >>> named(f, torch.float32) == constants(torch.device("cpu"), torch.float32, 1)
        True
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    entries = {}
    for dtype in dtypes:
        key = device_key(dev, dtype, threads)
        entries[str(dtype)] = {
            "key": key,
            "constants": dataclasses.asdict(constants(dev, dtype, threads)),
        }
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    name = key.split("|")[2]
    out.write_text(json.dumps({"device": name, "entries": entries}, indent=1) + "\n")
    return out


def saved_names() -> dict[str, pathlib.Path]:
    """The devices whose calibration ships with remat, by name."""
    found = {}
    for f in sorted(SHIPPED.glob("*.json")):
        try:
            found[json.loads(f.read_text())["device"]] = f
        except (OSError, ValueError, KeyError):
            continue
    return found


def named(calibration: str | os.PathLike[str], dtype: torch.dtype) -> Constants:
    """The constants for ``dtype`` of a saved calibration: a file written by :func:`save`, or
    the name (any part of it, any case) of a device whose calibration ships with remat.
    Another dtype than those saved is priced as float32, as :func:`constants` does."""
    path = pathlib.Path(calibration)
    if not path.is_file():
        wanted = str(calibration).lower()
        hits = [f for n, f in saved_names().items() if wanted in n.lower()]
        if len(hits) != 1:
            raise ValueError(
                f"remat: calibration must be a file written by "
                f"remat.planner.calibration.save or the name of one saved device "
                f"({sorted(saved_names()) or 'none saved yet'}), got {str(calibration)!r}"
                f"{' (more than one matches)' if hits else ''}."
            )
        path = hits[0]
    entries = json.loads(path.read_text())["entries"]
    entry = entries.get(str(dtype)) or entries.get(str(torch.float32))
    if entry is None:
        raise ValueError(f"remat: calibration {str(path)!r} holds no float32 constants.")
    return Constants(**entry["constants"])


def cache_file(key: str) -> pathlib.Path:
    """The file that holds the calibration of ``key`` (:func:`device_key`)."""
    return cache_dir() / f"calibration-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def store(key: str, made: Constants) -> Constants:
    """Keep ``made`` as the calibration of ``key`` unless one is kept already; the kept one.
    Atomic and first-writer-wins (see the module docstring)."""
    return _write(cache_file(key), key, made)


@functools.lru_cache(maxsize=64)
def _cached(file: str, key: str, device: str, dtype: str, threads: int | None) -> Constants:
    path = pathlib.Path(file)
    found = _read(path, key)
    if found is not None:
        return found
    made = calibrate(torch.device(device), getattr(torch, dtype.removeprefix("torch.")), threads)
    return _write(path, key, made)


def _read(path: pathlib.Path, key: str) -> Constants | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    try:
        return Constants(**data["constants"])
    except (TypeError, KeyError):
        return None


def _write(path: pathlib.Path, key: str, made: Constants) -> Constants:
    """Keep ``made`` at ``path`` unless another process got there first; the kept one."""
    text = json.dumps({"key": key, "constants": dataclasses.asdict(made)}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calibration-")
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            try:
                os.link(tmp, path)  # atomic, and fails where the file exists
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    except OSError:
        return made  # no writable cache: this process's own calibration
    return _read(path, key) or made


def on_grid(value: float) -> float:
    """``value`` rounded to the nearest power of ``2**(1/GRID)`` (0 stays 0).

    Example:
        >>> from remat.planner.calibration import on_grid
        >>> on_grid(1.05), on_grid(1.2) == 2 ** 0.25, on_grid(on_grid(3e-5)) == on_grid(3e-5)
        (1.0, True, True)
    """
    if value <= 0:
        return 0.0
    return float(2.0 ** (round(math.log2(value) * GRID) / GRID))


def calibrate(device: torch.device, dtype: torch.dtype, threads: int | None) -> Constants:
    """Time the micro-benchmarks of the module docstring on ``device`` (no cache)."""
    clock = make_clock(device, threads)
    with num_threads(device, threads), torch.autocast(device.type, enabled=False):
        with torch.enable_grad():
            mm_rate = _rate(_matmuls(device, dtype), clock)
            conv_rate = _rate(_convolutions(device, dtype), clock)
            byte_rate = _rate(_pointwise(device, dtype), clock, flops=False)
            random_rate = _rate(_random(device, dtype), clock, flops=False)
            norm_rate = _rate(_batch_norm(device, dtype), clock, flops=False)
            per_op, region = _overheads(device, dtype, clock, RECOMPUTE, pointwise=True)
            recomputed_op, sel_region = _overheads(device, dtype, clock, SELECTIVE, True)
            saved_op, _ = _overheads(device, dtype, clock, SELECTIVE, pointwise=False)
            host_rate = (
                _rate(_to_host(device), clock, flops=False) if device.type == "cuda" else byte_rate
            )
    return Constants(
        mm_rate=on_grid(mm_rate),
        conv_rate=on_grid(conv_rate),
        byte_rate=on_grid(byte_rate),
        random_rate=on_grid(random_rate),
        per_op=on_grid(per_op),
        saved_op=on_grid(saved_op),
        recomputed_op=on_grid(recomputed_op),
        region=on_grid(region),
        selective_region=on_grid(sel_region),
        host_rate=on_grid(host_rate),
        norm_rate=on_grid(norm_rate),
    )


@contextlib.contextmanager
def num_threads(device: torch.device, threads: int | None) -> Iterator[None]:
    """torch's CPU threads set to ``threads`` (``None``: as they are), put back on exit."""
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
    """Thread CPU time on CPU with one thread (the steadiest clock on a shared machine), else
    wall time (after synchronising a CUDA device)."""
    if device.type == "cuda":

        def clock() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return clock
    return time.thread_time if threads == 1 else time.perf_counter


RUNS = 7
"""Runs of each micro-benchmark; the smallest time counts."""


def _least(fn: Callable[[], Any], clock: Callable[[], float]) -> float:
    fn()  # warm-up
    out = []
    for _ in range(RUNS):
        t = clock()
        fn()
        out.append(clock() - t)
    return min(out)


def _rate(fn: Callable[[], Any], clock: Callable[[], float], flops: bool = True) -> float:
    """Counted FLOPs (or bytes) of ``fn`` per second of its least time."""
    counts = count_call(fn)
    work = sum(c.flops if flops else c.bytes for c in counts)
    return work / max(_least(fn, clock), 1e-9)


def _matmuls(device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    a = torch.full((256, 256), 0.01, device=device, dtype=dtype)

    def run() -> Any:
        with torch.no_grad():
            x = a
            for _ in range(8):
                x = x @ a
        return x

    return run


def _convolutions(device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    x = torch.full((8, 32, 32, 32), 0.01, device=device, dtype=dtype)
    w = torch.full((32, 32, 3, 3), 0.01, device=device, dtype=dtype)

    def run() -> Any:
        with torch.no_grad():
            return [torch.nn.functional.conv2d(x, w, padding=1) for _ in range(4)]

    return run


def _pointwise(device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    x = torch.full((256, 1024), 0.5, device=device, dtype=dtype)
    f = torch.nn.functional

    def run() -> Any:
        with torch.no_grad():
            y = x + x
            y = y * x
            y = f.gelu(y)
            y = f.softmax(y, dim=-1)
            return f.layer_norm(y, (1024,))

    return run


def _batch_norm(device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    x = torch.full((8, 32, 32, 32), 0.5, device=device, dtype=dtype)
    mean, var = torch.zeros(32, device=device, dtype=dtype), torch.ones(32, device=device, dtype=dtype)
    w, b = torch.ones(32, device=device, dtype=dtype), torch.zeros(32, device=device, dtype=dtype)

    def run() -> Any:
        with torch.no_grad():  # training mode: the batch's statistics, as a training step
            return torch.nn.functional.batch_norm(x, mean, var, w, b, training=True)

    return run


def _random(device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    x = torch.empty((256, 1024), device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)  # the global RNG is not touched

    def run() -> Any:
        return x.bernoulli_(0.9, generator=gen)

    return run


def _to_host(device: torch.device) -> Callable[[], Any]:
    x = torch.full((1 << 22,), 0.5, device=device)
    host = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=True)

    def run() -> Any:
        host.copy_(x)  # counted bytes: source and destination, half of them moved
        return host

    return run


class _Chain(nn.Module):
    """``ops`` tiny operators in a row: matmuls (which the selective cache saves) or
    pointwise ones (which it recomputes)."""

    def __init__(self, ops: int, pointwise: bool, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.ops, self.pointwise = ops, pointwise
        self.w = nn.Parameter(torch.full((4, 4), 0.5, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.ops):
            x = x * self.w if self.pointwise else x @ self.w
        return x


def _overheads(
    device: torch.device,
    dtype: torch.dtype,
    clock: Callable[[], float],
    decision: Decision,
    pointwise: bool,
) -> tuple[float, float]:
    """Per operator and per region: what ``decision`` adds to a chain's step against keep."""
    x = torch.full((4, 4), 0.5, device=device, dtype=dtype)
    extra = []
    for ops in (8, 64):
        chain = _Chain(ops, pointwise, device, dtype)

        def step(c: nn.Module = chain) -> None:
            c.w.grad = None
            c(x).sum().backward()

        times = {}
        for d in (Decision.KEEP, decision):
            apply_decision(chain, d)
            times[d] = _least(step, clock)
        extra.append(max(times[decision] - times[Decision.KEEP], 0.0))
    per = max(extra[1] - extra[0], 0.0) / (64 - 8)
    return per, max(extra[0] - 8 * per, 0.0)


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
