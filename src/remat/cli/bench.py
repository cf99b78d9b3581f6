"""``remat bench``: the memory/time trade-off of each strategy on a built-in model."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
from typing import Any

import torch

from ..bench.models import MODELS, ModelConfig, build, estimate_step_bytes, param_bytes
from ..bench.runner import WARMUP, environment, format_table, run
from ..bench.strategies import DEFAULT, registry
from ._usage import RunError, UsageError, check_output_path, write_text

PLOT_FORMATS = (".png", ".pdf", ".svg")
"""What ``--plot`` writes (chosen by the file's suffix); matplotlib's Agg backend draws them all."""


def add_parser(sub: Any) -> None:
    """Register ``bench`` on the subparsers object of ``remat``'s parser."""
    p = sub.add_parser(
        "bench",
        help="benchmark checkpointing strategies on a built-in model",
        description=(
            "Run every strategy on a built-in model and print peak memory, activation memory, "
            "step time and their ratios to no checkpointing."
        ),
    )
    p.add_argument(
        "--model", default="gpt", help=f"built-in model: {', '.join(MODELS)} (default gpt)"
    )
    p.add_argument("--layers", type=int, default=None, help="number of blocks (default 6)")
    p.add_argument(
        "--d-model",
        type=int,
        default=None,
        help="width (default 384); gpt keeps 6 heads (4 with --quick) when they divide it, "
        "else the first of 8, 6, 4, 2, 1 that does",
    )
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 256)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 4)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per strategy (default 5)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (1 to the CPU count)"
    )
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies (default: all that apply to the device); see --list",
    )
    p.add_argument("--list", action="store_true", help="list the strategies and exit")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small model and few steps (< 1 minute): 4 layers, d-model 128, seq 64, batch 2, "
        "3 steps; an explicit --layers, --d-model, --seq, --batch or --steps wins over it",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the results as JSON")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw memory vs time to a .png, .pdf or .svg file (needs remat[plot])",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=main)


def _config(args: argparse.Namespace) -> tuple[ModelConfig, int]:
    if args.model not in MODELS:
        raise UsageError(
            f"--model: unknown model {args.model!r}; choose one of: {', '.join(MODELS)}."
        )
    if args.quick:
        cfg = ModelConfig(
            model=args.model, layers=4, d_model=128, seq=64, batch=2, heads=4, vocab=256
        )
        steps = 3
    else:
        cfg = ModelConfig(model=args.model)
        steps = 5
    for field, value in (
        ("layers", args.layers),
        ("d_model", args.d_model),
        ("seq", args.seq),
        ("batch", args.batch),
    ):
        if value is not None:
            if value < 1:
                raise UsageError(f"--{field.replace('_', '-')} must be >= 1, got {value}.")
            setattr(cfg, field, value)
    if cfg.model == "gpt" and cfg.d_model % cfg.heads:
        heads = next(h for h in (8, 6, 4, 2, 1) if cfg.d_model % h == 0)
        cfg.heads = heads
    if args.steps is not None:
        if args.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {args.steps}.")
        steps = args.steps
    return cfg, steps


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: unknown device {name!r}; use cpu or cuda.") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: only cpu and cuda are supported by the benchmark.")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"--device {name} was asked for, but this torch build sees no CUDA device "
                f"(torch {torch.__version__}). Use --device cpu."
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise UsageError(
                f"--device {name}: there {'is' if count == 1 else 'are'} {count} CUDA "
                f"device{'' if count == 1 else 's'}; pass cuda:0 to cuda:{count - 1}, or cuda."
            )
    return dev


def _threads(n: int) -> int:
    cpus = os.cpu_count() or 1
    if not 1 <= n <= cpus:
        # far too many threads can crash torch's thread pool (a segfault at 10000)
        raise UsageError(
            f"--threads must be between 1 and this machine's {cpus} CPUs, got {n}; "
            f"pass 1 to {cpus}, or leave it out for torch's default."
        )
    return n


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _strategies(arg: str | None, device: torch.device) -> tuple[list[Any], list[str]]:
    """The strategies to run, and the default ones skipped because they need a device."""
    reg = registry()
    skipped: list[str] = []
    if arg is None:
        names = [n for n in DEFAULT if n in reg]
        names += [n for n in reg if n not in DEFAULT]
        skipped = [n for n in names if reg[n].device_only and device.type == "cpu"]
        chosen = [reg[n] for n in names if n not in skipped]
    else:
        # spaces and empty items are ignored; a repeated name runs once (each strategy
        # needs its own model: a repeat would share one and double its gradients)
        wanted = list(dict.fromkeys(n.strip() for n in arg.split(",") if n.strip()))
        if not wanted:
            raise UsageError(
                f"--strategies {arg!r} names no strategy; pass comma-separated names such as "
                "full,selective (see --list)."
            )
        unknown = [n for n in wanted if n not in reg]
        if unknown:
            raise UsageError(
                f"--strategies: unknown strategy {', '.join(map(repr, unknown))}; "
                f"choose from: {', '.join(reg)}."
            )
        cpu_only = [n for n in wanted if reg[n].device_only and device.type == "cpu"]
        if cpu_only:
            raise UsageError(
                f"strategy {', '.join(cpu_only)} needs a device (on a CPU-only setup tensors already "
                "live in host memory); drop it or use --device cuda."
            )
        chosen = [reg[n] for n in wanted]
    if "none" not in [s.name for s in chosen]:
        chosen.insert(0, reg["none"])  # the reference for the ratios
    return chosen, skipped


def main(args: argparse.Namespace) -> int:
    """Run ``remat bench``; a usage mistake prints one line to stderr and returns 2.

    An output that cannot be written after the run prints one line and returns 1.
    ``--threads`` holds for the run only: torch's thread count is put back after it.
    """
    threads = torch.get_num_threads()
    try:
        return _main(args)
    except UsageError as e:
        print(f"remat bench: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"remat bench: error: {e}", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(threads)


def _main(args: argparse.Namespace) -> int:
    if args.list:
        for s in registry().values():
            extra = " (device only)" if s.device_only else ""
            print(f"{s.name:<20}{s.description}{extra}")
        return 0
    cfg, steps = _config(args)
    device = _device(args.device)
    threads = None if args.threads is None else _threads(args.threads)
    strategies, skipped = _strategies(args.strategies, device)
    if args.json is not None:
        check_output_path("--json", args.json)
    if args.plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            raise UsageError("--plot needs matplotlib: pip install 'remat[plot]'")
        if os.path.splitext(args.plot)[1].lower() not in PLOT_FORMATS:
            raise UsageError(
                f"--plot {args.plot}: the file name must end in {', '.join(PLOT_FORMATS)} "
                "(it picks the format); pass for example bench.png."
            )
        check_output_path("--plot", args.plot)
    if threads is not None:
        torch.set_num_threads(threads)
    need = estimate_step_bytes(cfg) * 2  # one model per strategy is alive: be generous
    avail = _available_bytes(device)
    if avail is not None and need > avail:
        raise UsageError(
            f"this size needs roughly {need / 2**30:.1f} GiB on {device} but about "
            f"{avail / 2**30:.1f} GiB is free; use a smaller --batch, --seq, --d-model or --layers."
        )
    n_params = _count(cfg)
    env = environment(device, cfg, n_params)
    heads = f", {cfg.heads} heads" if cfg.model == "gpt" else ""
    print(
        f"remat bench: torch {env['torch']}, device {device}, threads {env['threads']}, "
        f"model {cfg.model} ({cfg.layers} layers, d={cfg.d_model}{heads}, seq {cfg.seq}, "
        f"batch {cfg.batch}, {n_params / 1e6:.1f}M parameters), {steps} timed steps"
    )
    units = len(strategies) * (3 + WARMUP + steps)  # configure, grads, memory, steps
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=units, desc="remat bench", file=sys.stderr, leave=False)
    try:
        rows = run(
            cfg,
            strategies,
            device=device,
            steps=steps,
            progress=(lambda label: bar.update(1)) if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    print(format_table(rows))
    if skipped:
        print(
            f"\nskipped on {device.type}: {', '.join(skipped)} (needs a device; on a CPU-only "
            "setup tensors already live in host memory)"
        )
    w = max(len(s.name) for s in strategies) + 2
    print("\n" + "\n".join(f"  {s.name:<{w}}{s.description}" for s in strategies))
    if args.json is not None:
        data = {"environment": env, "rows": [dataclasses.asdict(r) for r in rows]}
        write_text("--json", args.json, json.dumps(data, indent=2))
    if args.plot is not None:
        from ..bench.plot import plot

        frontier = None
        if any(r.strategy.startswith("auto-") for r in rows):
            frontier = _frontier(cfg, device, rows)
        try:
            plot(rows, args.plot, title=f"remat bench: {cfg.model}, {device}", frontier=frontier)
        except ImportError as e:
            raise UsageError(str(e)) from None
        except OSError as e:
            raise RunError(f"--plot {args.plot}: cannot write it: {e.strerror or e}.") from None
        print(f"plot written to {args.plot}")
    return 0


def _count(cfg: ModelConfig) -> int:
    """Parameters of the model, counted on the meta device (no memory used)."""
    with torch.device("meta"):
        model = build(cfg, "meta")
    return param_bytes(model) // 4


def _frontier(cfg: ModelConfig, device: torch.device, rows: Any) -> tuple[list[float], list[float]]:
    """The planner's predicted (time ratio, activation ratio) for budgets from its floor to 100%.

    Time ratios use the profile's own clock: its keep step and its per-block costs.
    """
    from .._errors import PlanError
    from ..bench.models import example_input
    from ..planner.measure import profile
    from ..planner.plan import plan

    model = build(cfg, device)
    prof = profile(model, example_input(cfg, device))
    lo = prof.floor_bytes
    xs: list[float] = []
    ys: list[float] = []
    for k in range(21):
        budget = lo + (prof.unchecked_peak_bytes - lo) * k // 20
        try:
            p = plan(prof, budget)
        except PlanError:
            continue
        xs.append(1.0 + p.predicted_overhead_s / prof.step_cost)
        ys.append(p.predicted_peak_bytes / prof.unchecked_peak_bytes)
    return xs, ys
