"""Does the cost model predict time? Each operator class of each family, modelled against measured.

The planner prices a block's recompute from counted work (:mod:`remat.planner.counting`) and
the device's calibrated constants (:mod:`remat.planner.calibration`): per operator call
``flops / rate[kind] + bytes / byte_rate + per_op``. This script checks those prices where
they are used, on the families the tests plan:

1. **Per operator class.** Every ATen call of each candidate block's forward is recorded once
   (a dispatch mode, the block run alone on the inputs the model gave it), then replayed
   alone, ``--reps`` calls in a row timed together, the least of ``--rounds`` such timings
   (the least disturbed by other work), with gradients enabled as in a recompute. Calls are
   grouped by class (:data:`remat.planner.counting.CLASSES`: matmul, attention, convolution,
   normalisation, pointwise, random, copy); per family and class the modelled seconds (the
   calls' prices, ``per_op`` included) are set against the measured ones:
   ``error = modelled / measured - 1``.
2. **Per block.** The modelled ``recompute`` cost of each block (``timer="time"``) against the
   block's measured one (``timer="measured"``: the block's forward and backward timed in
   real steps, kept and checkpointed), as ratios summed over the blocks of the family.

On CPU everything runs on one thread timed by the thread's CPU time (other processes do
not count). Numbers are machine-specific: the table in ``docs/BENCHMARKS.md`` says where
they were taken.

Run: python benchmarks/cost_model.py [--families gpt,cnn,encdec,llama] [--rounds 5]
     [--reps 20] [--json out.json] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

import remat
from remat.modules.modelinfo import candidates
from remat.planner.calibration import constants
from remat.planner.counting import CLASSES, OpCount, _Counter, op_class

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planner_quality import family as quality_family  # noqa: E402


def family(name: str, tiny: bool) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    """planner_quality's families (``gpt``, ``cnn``, ``encdec``), and ``llama`` (Hugging
    Face Llama from a small random config)."""
    if name != "llama":
        return quality_family(name, tiny)
    import transformers as T

    torch.manual_seed(0)
    d, seq = (32, 32) if tiny else (128, 256)
    cfg = T.LlamaConfig(
        vocab_size=128, hidden_size=d, intermediate_size=3 * d, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
    )  # fmt: skip
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    model = T.LlamaForCausalLM(cfg)
    kw = {"input_ids": ids, "labels": ids, "use_cache": False}
    return model, (), kw, f"HF Llama d={d}, 4 blocks, seq {seq}"


class _Recorder(_Counter):
    """The counter, keeping each call's function and arguments for a replay."""

    def __init__(self) -> None:
        super().__init__()
        self.replays: list[tuple[Any, Any, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # the arguments as this call saw them (a later in-place call changes them), with the
        # flag that makes a replay build the autograd graph a recompute builds
        self.replays.append((func, *tree_map_only(torch.Tensor, _snapshot, (args, kwargs or {}))))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    c = t.detach().clone()
    return c.requires_grad_(t.requires_grad) if c.is_floating_point() else c


def record_blocks(
    model: nn.Module, blocks: dict[str, nn.Module], args: Any, kwargs: Any
) -> dict[str, _Recorder]:
    """Each block's forward, run alone on the inputs the model gave it, recorded."""
    inputs: dict[str, Any] = {}

    def grab(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, a: Any, kw: Any) -> None:
            inputs.setdefault(name, (a, dict(kw)))

        return hook

    handles = [m.register_forward_pre_hook(grab(n), with_kwargs=True) for n, m in blocks.items()]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for n, m in blocks.items():
        a, kw = inputs[n]
        rec = _Recorder()
        with torch.no_grad(), rec:
            m(*a, **kw)
        out[n] = rec
    return out


def _clock() -> float:
    return time.thread_time()


def time_call(func: Any, args: Any, kwargs: Any, reps: int, rounds: int) -> float:
    """Seconds of one call of ``func``: the least over ``rounds`` of ``reps`` calls in a row
    (gradients enabled as in a recompute; an in-place call on a leaf runs without)."""

    def run() -> None:
        for _ in range(reps):
            func(*args, **kwargs)

    try:
        with torch.enable_grad():
            func(*args, **kwargs)
        grad = True
    except RuntimeError:
        grad = False
    best = float("inf")
    for _ in range(rounds):
        with torch.set_grad_enabled(grad):
            t0 = _clock()
            run()
            best = min(best, (_clock() - t0) / reps)
    return best


def class_errors(
    recorders: dict[str, _Recorder], reps: int, rounds: int, device: torch.device
) -> dict[str, dict[str, float]]:
    """Per class: calls, modelled and measured seconds (sums over every block's calls)."""
    k = constants(device, torch.float32, 1)
    out: dict[str, dict[str, Any]] = {
        c: {"calls": 0, "modelled_s": 0.0, "measured_s": 0.0} for c in CLASSES
    }
    skipped: dict[str, int] = {}
    for rec in recorders.values():
        for c, (func, args, kwargs) in zip(rec.counts(), rec.replays):
            if getattr(func, "is_view", False):
                continue  # a view moves nothing; its dispatch is in per_op of the others
            try:
                measured = time_call(func, args, kwargs, reps, rounds)
            except Exception:  # noqa: BLE001 - a call that cannot run again alone: said
                skipped[c.op] = skipped.get(c.op, 0) + 1
                continue
            row = out[op_class(c)]
            row["calls"] += 1
            row["modelled_s"] += _price(c, k)
            row["measured_s"] += measured
    for row in out.values():
        m = row["measured_s"]
        row["error"] = row["modelled_s"] / m - 1 if m > 0 else float("nan")
    found: dict[str, dict[str, Any]] = {c: r for c, r in out.items() if r["calls"]}
    if skipped:
        found["not replayed"] = {"calls": sum(skipped.values()), "ops": skipped}
    return found


def _price(c: OpCount, k: Any) -> float:
    return float(k.op_seconds(c.kind, c.flops, c.bytes) + k.per_op)


def block_errors(
    model: nn.Module, args: Any, kwargs: Any, repeats: int
) -> dict[str, dict[str, float]]:
    """Per block: the modelled and the measured ``recompute`` cost (seconds)."""
    loss = _loss_fn(model, args, kwargs)
    kw: dict[str, Any] = dict(decisions=["keep", "recompute"], loss_fn=loss)
    measured = remat.profile(model, *args, timer="measured", repeats=repeats, **kw, **kwargs)
    modelled = remat.profile(model, *args, timer="time", **kw, **kwargs)
    out = {}
    for a, b in zip(modelled.blocks, measured.blocks):
        m = b.cost["recompute"]
        out[a.name] = {
            "modelled_s": a.cost["recompute"],
            "measured_s": m,
            "error": a.cost["recompute"] / m - 1 if m > 0 else float("nan"),
        }
    return out


def _loss_fn(model: nn.Module, args: Any, kwargs: Any) -> Callable[[Any], torch.Tensor] | None:
    with torch.no_grad():
        out = model(*args, **kwargs)
    if isinstance(out, torch.Tensor):
        return None if out.dim() == 0 else (lambda o: o.float().sum())
    return lambda o: o.loss


def run_family(name: str, a: argparse.Namespace) -> dict[str, Any]:
    model, args, kwargs, what = family(name, a.tiny)
    device = torch.device("cpu")
    blocks = {n: model.get_submodule(n) for n in candidates(model, None)}
    recorders = record_blocks(model, blocks, args, kwargs)
    classes = class_errors(recorders, a.reps, a.rounds, device)
    per_block = block_errors(model, args, kwargs, a.rounds)
    mod = sum(r["modelled_s"] for r in per_block.values())
    mea = sum(r["measured_s"] for r in per_block.values())
    return {
        "model": what,
        "blocks": len(blocks),
        "classes": classes,
        "per_block": per_block,
        "recompute_total": {
            "modelled_s": mod,
            "measured_s": mea,
            "error": mod / mea - 1 if mea > 0 else float("nan"),
        },
    }


def report(results: dict[str, Any]) -> str:
    """The per-class table and the per-family recompute totals, as text."""
    lines = [
        f"{'family':<8}{'class':<15}{'calls':>7}{'modelled':>12}{'measured':>12}{'error':>9}",
        "-" * 63,
    ]
    for fam, r in results.items():
        for c, row in r["classes"].items():
            if c == "not replayed":
                lines.append(f"{fam:<8}{c:<15}{row['calls']:>7}  {', '.join(row['ops'])}")
                continue
            lines.append(
                f"{fam:<8}{c:<15}{row['calls']:>7}{row['modelled_s'] * 1e3:>9.3f} ms"
                f"{row['measured_s'] * 1e3:>9.3f} ms{row['error']:>+8.0%}"
            )
    lines += ["", "recompute cost per family (sum over its blocks), modelled against measured:"]
    for fam, r in results.items():
        t = r["recompute_total"]
        lines.append(
            f"  {fam}: {t['modelled_s'] * 1e3:.2f} ms modelled, {t['measured_s'] * 1e3:.2f} ms "
            f"measured ({t['error']:+.0%}; {r['model']})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="gpt,cnn,encdec,llama")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="small models (a test's size)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for name in a.families.split(","):
        if name == "llama":
            try:
                import transformers  # noqa: F401
            except ImportError:
                print("llama skipped: transformers is not installed (pip install 'remat[hf]')")
                continue
        results[name] = run_family(name, a)
    print(
        f"cost model check: torch {torch.__version__}, {platform.processor() or platform.machine()}"
        f", one thread, thread CPU time, {a.rounds} rounds of {a.reps} calls"
    )
    print(report(results))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"results": results, "rounds": a.rounds, "reps": a.reps}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
