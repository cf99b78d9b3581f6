"""``remat bench``: the memory/time trade-off of each strategy on a built-in model.

The default run is sized to finish in about a minute on a quiet 2-core CPU
(``--quick``: a smoke test; ``--large``: the bigger model and every strategy;
``--deep``: a deep long-sequence model where plans go below checkpointing every block).
It prints a time estimate after timing one step, a table with the spread of every
row, ties and a recommendation, and writes the JSON and the picture to
``remat-bench/`` (``--out``), printing both paths.

Shared machines: on CPU the run uses one thread by default and times each
step by that thread's CPU time, so time the scheduler gives to other processes
is not counted. (On the project's 2-core machine, with other jobs running, a
two-thread step took 3.4 s instead of 0.22 s and rounds varied by 60%: torch's
threads wait for each other at every operator, so one descheduled thread
stalls the step.) ``--threads N`` uses N threads, timed by wall clock. Every
row's ratio is paired by round, and a run whose timing varied is called noisy
in the output.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any

import torch

from ..bench import report
from ..bench.models import MODELS, PRESETS, ModelConfig, build, estimate_step_bytes, param_bytes
from ..bench.runner import Result, environment, run, work
from ..bench.strategies import DEEP, DEFAULT, Strategy, registry
from ._usage import RunError, UsageError, check_output_path, write_text

PLOT_FORMATS = (".png", ".pdf", ".svg")
"""What ``--plot`` writes (chosen by the file's suffix); matplotlib's Agg backend draws them all."""

MACHINE = "2-core AMD EPYC CPU"
"""Where the durations of :data:`remat.bench.models.PRESETS` were measured (wall time, one
thread; a busy machine takes longer: the header's estimate is this machine's)."""

OUT_DIR = "remat-bench"
"""Where the JSON and the picture go by default (``--out``)."""


def add_parser(sub: Any) -> None:
    """Register ``bench`` on the subparsers object of ``remat``'s parser."""
    p = sub.add_parser(
        "bench",
        help=f"benchmark checkpointing strategies on a built-in model (about a minute on a quiet "
        f"{MACHINE})",
        description=(
            "Run checkpointing strategies on a built-in model and print peak memory, activation "
            "memory, step time, their ratios to no checkpointing with their spread, and which "
            f"strategy to pick. Writes {OUT_DIR}/bench.json and {OUT_DIR}/bench.png. The default "
            f"run takes {PRESETS['default'].about} on a quiet {MACHINE} (see --quick, --large, "
            "--deep for the others)."
        ),
    )
    large, deep = PRESETS["large"], PRESETS["deep"]
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke test: a small model and {PRESETS['quick'].rounds} rounds "
        f"({PRESETS['quick'].about}); an explicit --layers, --d-model, --seq, --batch or --steps "
        "wins over it",
    )
    size.add_argument(
        "--large",
        action="store_true",
        help=f"the bigger model ({large.layers} layers, d-model {large.d_model}, seq {large.seq}) "
        f"and every strategy ({large.about})",
    )
    size.add_argument(
        "--deep",
        action="store_true",
        help=f"a deep long-sequence gpt ({deep.layers} layers, d-model {deep.d_model}, seq "
        f"{deep.seq}, fused attention): plans below the floor of checkpointing every block, "
        f"beside every (2nd) block checkpointed by remat and by torch ({deep.about})",
    )
    p.add_argument(
        "--model", default="gpt", help=f"built-in model: {', '.join(MODELS)} (default gpt)"
    )
    d = PRESETS["default"]
    p.add_argument(
        "--layers", type=int, default=None, help=f"number of blocks (default {d.layers})"
    )
    p.add_argument(
        "--d-model",
        type=int,
        default=None,
        help=f"width (default {d.d_model}); gpt keeps its heads when they divide it, "
        "else the first of 8, 6, 4, 2, 1 that does",
    )
    p.add_argument("--seq", type=int, default=None, help=f"sequence length (default {d.seq})")
    p.add_argument("--batch", type=int, default=None, help=f"batch size (default {d.batch})")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"timed rounds, one step of every strategy each (default {d.rounds})",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (1 to the CPU count; default on CPU: 1, timed by its CPU "
        "time, which other processes on the machine do not disturb)",
    )
    p.add_argument(
        "--clock",
        choices=("auto", "wall", "cpu"),
        default="auto",
        help="wall time, or the thread's CPU time (CPU, one thread only); default: cpu at one "
        "thread on CPU, else wall",
    )
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated strategies, or 'all' (default: the main ones that apply to the "
        "device); see --list",
    )
    p.add_argument("--list", action="store_true", help="list the strategies and exit")
    p.add_argument(
        "--out",
        metavar="DIR",
        default=OUT_DIR,
        help=f"folder for bench.json and bench.png (default {OUT_DIR}, created if missing)",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="write the JSON here instead")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw the picture here instead: a .png, .pdf or .svg file (needs remat[plot])",
    )
    p.add_argument("--no-save", action="store_true", help="write no files, only print")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=main)


def _config(args: argparse.Namespace) -> tuple[ModelConfig, int, str]:
    if args.model not in MODELS:
        raise UsageError(
            f"--model: unknown model {args.model!r}; choose one of: {', '.join(MODELS)}."
        )
    size = "quick" if args.quick else "large" if args.large else "deep" if args.deep else "default"
    preset = PRESETS[size]
    cfg = preset.config(args.model)
    steps = preset.rounds
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
    return cfg, steps, size


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


def _available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _threads(n: int) -> int:
    cpus = os.cpu_count() or 1
    if not 1 <= n <= cpus:
        # far too many threads can crash torch's thread pool (a segfault at 10000)
        raise UsageError(
            f"--threads must be between 1 and this machine's {cpus} CPUs, got {n}; "
            f"pass 1 to {cpus}, or leave it out for torch's default."
        )
    return n


def _strategies(
    arg: str | None, device: torch.device, size: str
) -> tuple[list[Strategy], list[dict[str, str]]]:
    """The strategies to run, and the ones left out because they need a device."""
    reg = registry()
    reason = "needs a device (on a CPU-only setup tensors already live in host memory)"
    if arg is None or arg.strip() == "all":
        default = DEEP if size == "deep" else DEFAULT
        every = size == "large" or arg is not None
        names = list(reg) if every else [n for n in default if n in reg]
        skipped = [n for n in names if reg[n].device_only and device.type == "cpu"]
        chosen = [reg[n] for n in names if n not in skipped]
        return chosen, [{"strategy": n, "reason": reason} for n in skipped]
    # spaces and empty items are ignored; a repeated name runs once (each strategy
    # needs its own model: a repeat would share one and double its gradients)
    wanted = list(dict.fromkeys(n.strip() for n in arg.split(",") if n.strip()))
    if not wanted:
        raise UsageError(
            f"--strategies {arg!r} names no strategy; pass comma-separated names such as "
            "full,selective, or all (see --list)."
        )
    unknown = [n for n in wanted if n not in reg]
    if unknown:
        raise UsageError(
            f"--strategies: unknown strategy {', '.join(map(repr, unknown))}; "
            f"choose from: {', '.join(reg)}, or all."
        )
    cpu_only = [n for n in wanted if reg[n].device_only and device.type == "cpu"]
    if cpu_only:
        raise UsageError(
            f"strategy {', '.join(cpu_only)} needs a device (on a CPU-only setup tensors already "
            "live in host memory); drop it or use --device cuda."
        )
    chosen = [reg[n] for n in wanted]
    if "none" not in wanted:
        chosen.insert(0, reg["none"])  # the reference for the ratios
    return chosen, []


def _outputs(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(json path, picture path)``, checked before any work."""
    if args.no_save:
        if args.json is not None or args.plot is not None:
            raise UsageError("--no-save writes no files: drop it, or drop --json/--plot.")
        return None, None
    if args.json is None or args.plot is None:
        _check_out_dir(args.out)
    json_path = args.json if args.json is not None else os.path.join(args.out, "bench.json")
    plot_path = args.plot if args.plot is not None else os.path.join(args.out, "bench.png")
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
    return json_path, plot_path


def _check_out_dir(path: str) -> None:
    if not path:
        raise UsageError("--out '': empty folder name; pass a folder such as remat-bench.")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--out {path}: is a file; pass a folder (created if missing).")
    parent = os.path.dirname(os.path.abspath(path))
    target = path if os.path.isdir(path) else parent
    if not os.path.isdir(target):
        raise UsageError(
            f"--out {path}: the folder {parent} does not exist; create it or pass another path."
        )
    if not os.access(target, os.W_OK):
        raise UsageError(f"--out {path}: {target} is not writable; pass another folder.")


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
    started = time.perf_counter()
    if args.list:
        defaults = set(DEFAULT)
        for s in registry().values():
            extra = " (device only)" if s.device_only else ""
            mark = "*" if s.name in defaults else " "
            print(f"{mark} {s.name:<20}{s.description}{extra}")
        print("\n* run by default; --large or --strategies all runs every one.")
        return 0
    cfg, steps, size = _config(args)
    device = _device(args.device)
    threads = None if args.threads is None else _threads(args.threads)
    strategies, skipped = _strategies(args.strategies, device, size)
    json_path, plot_path = _outputs(args)
    if threads is None and device.type == "cpu":
        threads = 1
    if threads is not None:
        torch.set_num_threads(threads)
    clock = args.clock
    if clock == "auto":
        clock = "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
    elif clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise UsageError(
            f"--clock cpu times one thread: it needs --device cpu and --threads 1 (got device "
            f"{device}, {torch.get_num_threads()} threads); pass --clock wall."
        )
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
    note = (
        " (timed by its CPU time: other processes do not count; --threads N for more)"
        if clock == "cpu"
        else ""
    )
    print(
        f"remat bench: torch {env['torch']}, device {device}, threads {env['threads']}{note}, "
        f"model {cfg.model} ({cfg.layers} layers, d={cfg.d_model}{heads}, seq {cfg.seq}, "
        f"batch {cfg.batch}, {n_params / 1e6:.1f}M parameters), {len(strategies)} strategies, "
        f"{steps} timed rounds"
    )
    total = work(strategies, steps)
    bar: Any = None

    def calibrated(step_s: float, wall_s: float) -> None:
        nonlocal bar
        est = total * wall_s
        print(
            f"estimated time: about {_duration(est)} (one step without checkpointing took "
            f"{wall_s * 1e3:.0f} ms; --quick for a smoke test)",
            flush=True,
        )
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(
                total=total,
                desc="remat bench",
                file=sys.stderr,
                leave=False,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed, {remaining} left",
            )

    try:
        result = run(
            cfg,
            strategies,
            device=device,
            steps=steps,
            clock=clock,
            calibrated=calibrated,
            progress=lambda label, weight: bar.update(weight) if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    print()
    print(report.format_table(result))
    print(report.how_measured(result))
    print(report.TIE_LEGEND)
    if skipped:
        print(
            f"skipped on {device.type}: {', '.join(s['strategy'] for s in skipped)} (needs a "
            "device; on a CPU-only setup tensors already live in host memory)"
        )
    print(result.noise.describe())
    print()
    print(report.recommendation(result))
    versus = report.against_uniform(result)
    if versus:
        print(versus)
    w = max(len(s.name) for s in strategies) + 2
    print("\n" + "\n".join(f"  {s.name:<{w}}{s.description}" for s in strategies))
    _save(result, env, skipped, args, json_path, plot_path, cfg, device, started)
    return 0


def _save(
    result: Result,
    env: dict[str, Any],
    skipped: list[dict[str, str]],
    args: argparse.Namespace,
    json_path: str | None,
    plot_path: str | None,
    cfg: ModelConfig,
    device: torch.device,
    started: float,
) -> None:
    if json_path is None:
        return
    written = []
    picture = None
    if plot_path is not None:
        if importlib.util.find_spec("matplotlib") is None:
            print(
                "\npicture skipped: matplotlib is not installed (pip install 'remat[plot]'); "
                "the JSON has the same numbers."
            )
        else:
            picture = plot_path
    for path in (json_path, picture):
        if path is not None and os.path.dirname(path):
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            except OSError as e:
                raise RunError(f"--out {os.path.dirname(path)}: cannot create it: {e}.") from None
    if picture is not None:
        from ..bench.plot import plot

        caption = [report.recommendation(result)]
        caption += [
            f"[{k}] {r.strategy}: {n}." for k, (r, n) in enumerate(report.footnotes(result.rows), 1)
        ]
        caption.append(result.noise.describe())
        flag = "--plot" if args.plot is not None else "--out"
        try:
            plot(
                result.rows,
                picture,
                title=(
                    f"remat bench: {cfg.model}, {cfg.layers} layers, d={cfg.d_model}, {device}, "
                    f"{result.threads} thread{'s' if result.threads != 1 else ''}"
                ),
                recommended=[r.strategy for r in result.recommended()],
                caption=caption,
            )
        except ImportError as e:
            raise UsageError(str(e)) from None
        except OSError as e:
            raise RunError(f"{flag} {picture}: cannot write it: {e.strerror or e}.") from None
        written.append(picture)
    data = report.to_json(
        result,
        environment=env,
        skipped=skipped,
        extra={
            "wall_time_s": time.perf_counter() - started,
            "arguments": {k: v for k, v in vars(args).items() if k != "run"},
            "outputs": {"json": json_path, "plot": picture},
        },
    )
    write_text(
        "--json" if args.json is not None else "--out", json_path, json.dumps(data, indent=2)
    )
    written.insert(0, json_path)
    print("\nwrote " + " and ".join(written))


def _duration(seconds: float) -> str:
    """``"45 s"``, ``"3 min"``.

    Example:
        >>> _duration(44.6), _duration(200)
        ('45 s', '3 min 20 s')
    """
    s = round(seconds)
    if s < 90:
        return f"{s} s"
    return f"{s // 60} min {s % 60} s" if s % 60 else f"{s // 60} min"


def _count(cfg: ModelConfig) -> int:
    """Parameters of the model, counted on the meta device (no memory used)."""
    with torch.device("meta"):
        model = build(cfg, "meta")
    return param_bytes(model) // 4
