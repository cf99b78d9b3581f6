"""Compiled plans against torch.compile's own activation budget (issue #33).

On the bench GPT (``remat bench``'s default size; ``--quick``: 8 narrow layers), every block
compiled on its own (regional compilation, :mod:`remat.planner.regional`), AdamW, CPU, one
thread. Strategies:

* ``eager``: no checkpointing, no compile (the reference of the ratios);
* ``compiled``: every block compiled, partitioner budget 1.0 (the compiled unchecked step);
* ``compile-B``: every block compiled at the one global budget ``B`` (what
  ``torch._functorch.config.activation_memory_budget = B`` does to each block's graph),
  for ``B`` in a sweep;
* ``remat-compiled-P``: ``remat.auto_checkpoint(..., budget=P, compile=True)``: a budget per
  block chosen for ``P`` of the compiled unchecked step's activations;
* ``remat-eager-P``: remat's eager plan for the same budget in bytes.

Each is measured as one run gives it: the peak of one training step at the allocator
(``torch.profiler``'s allocator events: what compiled kernels allocate, scratch included),
absolute bytes with the parameters, gradients, optimizer state and inputs; the time of
``rounds`` interleaved rounds (one step of every strategy each, the order rotated, after
a warm-up), as ratios to ``eager`` paired by round (median and interquartile range); the
compile time is that of the profile (it compiles the levels 1.0, 0.5 and 0.0 the other
strategies then reuse, one code object per level). For each remat compiled plan the table names the
fastest global budget whose measured peak is within the plan's measured peak (compile's
setting that reaches the same bytes).

Run from the repository root::

    python benchmarks/compiled.py --quick            # about 5 minutes on the 2-core machine
    python benchmarks/compiled.py --json out.json    # the bench GPT, docs/BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from typing import Any

import torch
from torch import nn

import remat
from remat.bench import stats
from remat.bench.models import PRESETS, ModelConfig, build, example_input
from remat.planner.compiled import allocator_peak
from remat.planner.regional import compile_block
from remat.planner.scratch import profiled

SWEEP = (1.0, 0.7, 0.5, 0.3, 0.1, 0.0)
SHARES = ("50%", "30%")


class Run:
    """One strategy: its model, optimizer and step (``x``: the model's input, or its keyword
    inputs as a dict)."""

    def __init__(self, name: str, model: nn.Module, x: Any) -> None:
        self.name, self.model, self.x = name, model, x
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.times: list[float] = []
        self.first_s = 0.0
        self.peak = 0
        self.plan: remat.Plan | None = None

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = _loss(self.model, self.x)
        loss.backward()
        self.opt.step()


def _loss(model: nn.Module, x: Any) -> torch.Tensor:
    out = model(**x) if isinstance(x, dict) else model(x)
    return out if torch.is_tensor(out) else out.loss


def _args(x: Any) -> tuple[Any, ...]:
    """``x`` as the positional arguments of remat's calls (keyword inputs as one Inputs)."""
    return (remat.Inputs(**x),) if isinstance(x, dict) else (x,)


def _blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated blocks: the bench GPT's ``blocks``, a Hugging Face Llama's layers."""
    return model.blocks if hasattr(model, "blocks") else model.model.layers


def llama() -> tuple[nn.Module, dict[str, Any]]:
    """A Llama-shaped model (Hugging Face ``LlamaForCausalLM``, random weights): 6 layers,
    hidden 256, 4 heads (2 key/value heads), MLP 688, vocabulary 512, batch 4 x 512 tokens."""
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    ids = torch.randint(0, 512, (4, 512), generator=torch.Generator().manual_seed(1))
    return T.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids, "use_cache": False}


def _compiled(base: nn.Module, budget: float) -> nn.Module:
    model = copy.deepcopy(base)
    for block in _blocks(model):
        compile_block(block, budget)
    return model


def _static(run: Run) -> int:
    """Bytes alive as a step starts: parameters, buffers, input, gradients, optimizer state."""
    inputs = list(run.x.values()) if isinstance(run.x, dict) else [run.x]
    tensors = [*run.model.parameters(), *run.model.buffers()]
    tensors += [t for t in inputs if torch.is_tensor(t)]
    tensors += [p.grad for p in run.model.parameters() if p.grad is not None]
    for state in run.opt.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def measure(runs: list[Run], rounds: int) -> None:
    """First step (compile), a warm-up, the allocator peak of one step, then the rounds."""
    for r in runs:
        start = time.perf_counter()
        r.step()
        r.first_s = time.perf_counter() - start
        r.step()
    for r in runs:
        r.opt.zero_grad(set_to_none=True)
        base = _static(r)
        r.peak = base + allocator_peak(profiled(r.step), torch.device("cpu"))
    for k in range(rounds):
        order = runs[k % len(runs) :] + runs[: k % len(runs)]
        for r in order:
            start = time.perf_counter()
            r.step()
            r.times.append(time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the quick bench size, 3 budgets")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 10; 5 quick)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                    help="the bench GPT (default) or a Llama-shaped Hugging Face model")  # fmt: skip
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    #: quick: a deeper, narrower GPT whose activations outweigh its weights (30 % reachable)
    quick = ModelConfig(layers=8, d_model=64, seq=256, batch=4, heads=4, vocab=128)
    cfg = quick if args.quick else PRESETS["default"].config()
    rounds = args.rounds or (5 if args.quick else 10)
    sweep = (1.0, 0.5, 0.0) if args.quick else SWEEP
    if args.model == "llama":
        base, x = llama()
        described = "Llama-shaped: 6 layers, hidden 256, MLP 688, 4 heads (2 kv), batch 4 x 512"
    else:
        base, x = build(cfg), example_input(cfg)
        described = dataclass_text(cfg)
    runs = [Run("eager", copy.deepcopy(base), x)]
    runs += [Run("compiled" if b == 1.0 else f"compile-{b}", _compiled(base, b), x) for b in sweep]
    start = time.perf_counter()
    profiled_model = copy.deepcopy(base)
    prof = remat.profile(profiled_model, *_args(x), optimizer=torch.optim.AdamW(profiled_model.parameters()),
                         compile=True, repeats=3)  # fmt: skip
    profile_s = time.perf_counter() - start
    for share in SHARES:
        model = copy.deepcopy(base)
        run = Run(f"remat-compiled-{share}", model, x)
        try:
            run.plan = remat.auto_checkpoint(model, *_args(x), budget=share, optimizer=run.opt,
                                             profile=prof, quiet=True)  # fmt: skip
        except remat.PlanError as e:
            print(f"{run.name}: {str(e).splitlines()[0]}")
            continue
        runs.append(run)
        eager = Run(f"remat-eager-{share}", copy.deepcopy(base), x)
        try:
            eager.plan = remat.auto_checkpoint(eager.model, *_args(x), budget=run.plan.budget_bytes,
                                               optimizer=eager.opt, quiet=True)  # fmt: skip
            runs.append(eager)
        except remat.PlanError as e:
            print(f"{eager.name}: {str(e).splitlines()[0]}")
    measure(runs, rounds)
    ref = runs[0].times
    rows = {}
    for r in runs:
        s = stats.spread(stats.paired_ratios(r.times, ref))
        rows[r.name] = {
            "peak_bytes": r.peak,
            "time_ratio": s.median,
            "time_low": s.low,
            "time_high": s.high,
            "first_step_s": r.first_s,
            "budget_bytes": None if r.plan is None else r.plan.budget_bytes,
            "predicted_bytes": None if r.plan is None else r.plan.predicted_peak_bytes,
            "decisions": None if r.plan is None else "".join(
                d.value[0] for d in r.plan.decisions.values()
            ),
        }
    compiled = {n: v for n, v in rows.items() if n == "compiled" or n.startswith("compile-")}
    for name, row in rows.items():
        if name.startswith("remat-compiled-"):
            within = [(v["time_ratio"], n) for n, v in compiled.items() if v["peak_bytes"] <= row["peak_bytes"]]
            row["compile_same_bytes"] = min(within)[1] if within else None
    env = {
        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
        "threads": 1, "rounds": rounds, "model": described, "profile_s": profile_s,
    }  # fmt: skip
    print(f"{env}\n")
    print(f"{'strategy':24} {'peak MiB':>9} {'time x eager':>18}  plan / same bytes")
    for name, row in rows.items():
        spread_text = f"{row['time_ratio']:.2f} [{row['time_low']:.2f}-{row['time_high']:.2f}]"
        extra = row["decisions"] or ""
        if row.get("compile_same_bytes"):
            extra += f"  compile's budget for these bytes: {row['compile_same_bytes']}"
        if row["predicted_bytes"] is not None:
            extra += f"  (predicted {row['predicted_bytes'] / 2**20:.2f} MiB)"
        print(f"{name:24} {row['peak_bytes'] / 2**20:9.2f} {spread_text:>18}  {extra}")
    out = {"env": env, "runs": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


def dataclass_text(cfg: Any) -> str:
    """``cfg``'s fields as ``name=value`` text."""
    return ", ".join(f"{k}={v}" for k, v in vars(cfg).items())


if __name__ == "__main__":
    main()
