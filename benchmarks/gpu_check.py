"""Everything a GPU changes, checked in one command of at most 11 minutes on one H100-class GPU.

GPU time comes rarely and in short stretches, so its minutes go to measuring, not to
writing the measuring code. On a CUDA device the script runs these parts in order, each
under its own time limit (:data:`LIMITS_S`): an exception or an overrun in one part is
recorded in the summary and the next part runs.

1. ``environment``: device name, capability and memory; torch, CUDA, cuDNN and driver
   versions; the bytes cuBLAS and cuDNN keep after their first kernels (allocated here,
   before any part measures, so that no part counts them).
2. ``pytest``: the GPU-marked tests (``pytest -m gpu``) in a subprocess.
3. ``planner``: planner exactness on the device. For a small GPT, a small CNN and a small
   encoder-decoder whose stacks hand a bias along (tests/support/families.py), each with
   AdamW, in fp32 and under bf16 autocast: one ``remat.profile``, then every per-block plan
   (one decision per block, every combination) applied to a freshly built model. Its
   predicted peak (``Profile.peak``) is compared with remat's meter
   (``remat.measure_peak``) and with the CUDA caching allocator: two steps of the same
   loop (``zero_grad()``, forward, backward, ``optimizer.step()``) between
   ``reset_peak_memory_stats()`` and ``max_memory_allocated()``, counted from before the
   model was built; ``max_memory_reserved()`` beside it.
4. ``shapes``: the device's calibration saved into the repository
   (``src/remat/planner/calibrations/<gpu name slug>.json``, float32, bfloat16, float16:
   ``remat plan --calibration "<gpu name>"`` prices plans for this GPU from any machine),
   then a plan made from shapes (a meta copy of the GPT, ``device="cuda"``) applied to the
   real model: predicted against remat's meter (the tensors' bytes: exact) and against
   ``max_memory_allocated`` of real steps (which adds the scratch inside operators)
   (``benchmarks/gpucheck/shapes.py``).
5. ``bench``: ``remat bench``'s runner (:func:`remat.bench.runner.run`) on the device with
   every strategy, offload included, on a model large enough for the GPU, not Python, to
   set the pace of a step.
6. ``offload``: the offload engine (``remat.offload``) against
   ``torch.autograd.graph.save_on_cpu`` and against recompute: device and host bytes,
   step time, and the share of the copies' time hidden behind compute (the copies' time
   from the bytes moved and the measured pinned-copy bandwidth); gradients against no
   checkpointing with dropout on (CUDA RNG replay).
7. ``overhead``: per-call overhead of ``remat.checkpoint`` against
   ``torch.utils.checkpoint`` on the device (``benchmarks/overhead.py``).
8. ``suite``: the default test suite (``python -m pytest -q``, as CI and ``noxfile.py``
   run it; GPU tests included) under the machine's torch, in shards side by side, with
   that torch's version beside the counts (``benchmarks/gpucheck/suite.py``). The torch
   version heads ``summary.md``: a GPU run is a row of the README's compatibility table.
   Last, so that a session short of time has the GPU's own parts first
   (``--parts environment,pytest,...`` leaves it out).

After every part ``summary.json`` and ``summary.md`` are written under ``--out`` (default
``gpu-check/``): a run cut short keeps what it measured (a part still marked ``running``
was killed with the process). ``summary.md``, printed at the end, is laid out as the GPU
section of docs/BENCHMARKS.md.

The parts live in ``benchmarks/gpucheck/`` (one module each for the planner part and the
summary; this file is the command).

``--dry-run`` runs the same code on CPU with tiny sizes in under a minute, the device-only
paths (offload) on the simulated asynchronous device of ``tests/simdevice.py`` and the
allocator's numbers replaced by ``remat.memory.track`` over the same steps; it keeps the
script from rotting (``tests/test_gpu_check.py``). Its numbers mean nothing.

Run: python benchmarks/gpu_check.py [--out DIR] [--parts planner,bench] [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))  # check this checkout's remat, installed or not

import torch  # noqa: E402
from gpucheck.device import DRY_SIZES, GPU_SIZES, Check  # noqa: E402
from gpucheck.parts import PARTS  # noqa: E402
from gpucheck.run import LIMITS_S, TOTAL_S, run_part, save, succeeded  # noqa: E402
from gpucheck.summary import render  # noqa: E402

OUT_DIR = "gpu-check"
"""Where summary.md and summary.json go by default (``--out``)."""


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


if __name__ == "__main__":
    raise SystemExit(main())
