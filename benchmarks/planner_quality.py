"""How good are the planner's plans? Brute force every per-block plan of three model families.

Families: ``gpt`` (remat's built-in GPT), ``cnn`` (a ResNet-shaped CNN: a stem and two stages
of two BasicBlocks, the first of a stage downsampling), ``encdec`` (a T5-shaped
encoder-decoder: Hugging Face T5 from a small random config when transformers is installed,
else ``torch.nn.Transformer``). Each has four candidate blocks (the default blocks of the
whole model), so 3**4 = 81 plans of keep / recompute / selective per block.

For each budget (a percentage, as remat.plan reads it: static bytes plus that share of what
the unchecked step allocates above them) every plan's absolute step peak is measured
(the default loop with AdamW, first and later step, by remat.measure_peak), and every plan's
step time (zero_grad, forward, backward, optimizer.step) in ``--rounds`` interleaved rounds
(plans in a shuffled order each round, the first round a warm-up), on one thread with its
thread CPU time on CPU (the steadiest clock on a shared machine). The planner's plan
(``remat.plan(profile, budget, spans=False)`` over the same three decisions, so that it is
one of the brute-forced plans) is compared with the fastest fitting plan: times are medians
over rounds as ratios to the all-keep plan, the spread is the interquartile range of the
chosen and the best plan's ratios, and the plan is *within noise* when its median is at most
the best's plus the larger of the two IQRs. Also reported: the fastest of the plans the
step model admits (predicted peak plus the scratch inside operators within the budget), the
plans ``remat.plan`` chooses among, which tells a cost-model miss (the plan slower than that
one) from a conservative memory prediction (that one slower than the best). ``--timers`` profiles with each cost measure
(``time``: counted work priced by the device's calibration, the default; ``measured``:
per-block timing; ``flops``) against the same brute-force data.

Run: python benchmarks/planner_quality.py [--families gpt,cnn,encdec] [--rounds 6]
     [--budgets 70,50,30] [--timers time,measured] [--json out.json] [--tiny]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import remat
from remat.bench.models import ModelConfig, build, example_input
from remat.planner.apply import apply_decision
from remat.planner.stepmodel import budget_of

DECS = ("keep", "recompute", "selective")
LETTERS = {"keep": "K", "recompute": "R", "selective": "S"}


class BasicBlock(nn.Module):
    """torchvision's ResNet block."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.down is None else self.down(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + idt)


class ResNet(nn.Module):
    """A stem, then stages of two BasicBlocks (``layer1``, ``layer2``, ...), pool, fc."""

    def __init__(self, widths: tuple[int, ...], classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        cin = widths[0]
        for i, w in enumerate(widths):
            stage = nn.Sequential(BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w))
            self.add_module(f"layer{i + 1}", stage)
            cin = w
        self.stages = len(widths)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return nn.functional.cross_entropy(self.fc(x.mean((2, 3))), y)


class TorchEncDec(nn.Module):
    """``torch.nn.Transformer`` with embeddings and a loss (when transformers is missing)."""

    def __init__(self, d: int, vocab: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.net = nn.Transformer(d, 4, 2, 2, 2 * d, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        out = self.net(self.emb(src), self.emb(tgt))
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), tgt.flatten())


def family(name: str, tiny: bool) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str]:
    """``(model, args, kwargs, description)`` of one family; ``tiny``: small enough for a test."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        cfg = ModelConfig(
            layers=4, d_model=16 if tiny else 128, seq=64 if tiny else 256, batch=4,
            heads=2 if tiny else 4, vocab=32 if tiny else 256,
        )  # fmt: skip
        return build(cfg), (example_input(cfg),), {}, f"remat GPT {vars(cfg)}"
    if name == "cnn":
        widths, hw, batch = ((4, 8), 16, 4) if tiny else ((16, 32), 64, 8)
        x = torch.randn(batch, 3, hw, hw, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        return ResNet(widths), (x, y), {}, f"ResNet-shaped, stages {widths}, input {list(x.shape)}"
    if name == "encdec":
        seq, d = (64, 16) if tiny else (256, 64)
        ids = torch.randint(0, 64, (4, seq), generator=g)
        try:
            import transformers as T
        except ImportError:
            return TorchEncDec(d), (ids, ids), {}, f"torch.nn.Transformer d={d}, seq {seq}"
        cfg = T.T5Config(
            vocab_size=64, d_model=d, d_kv=d // 4, d_ff=2 * d, num_layers=2, num_decoder_layers=2,
            num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        kw = {"input_ids": ids, "labels": ids[:, : seq // 2].contiguous(), "use_cache": False}
        return (
            T.T5ForConditionalGeneration(cfg),
            (),
            kw,
            f"HF T5 d_model={d}, 2+2 blocks, seq {seq}",
        )
    raise SystemExit(f"planner_quality: unknown family {name!r}; pick gpt, cnn or encdec.")


def loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().sum()
    return out.loss


def run_family(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model, xs, kw, about = family(name, args.tiny)
    print(f"\n== {name}: {about}")
    decs = args.decisions.split(",")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    profiles: dict[str, Any] = {}
    profile_s: dict[str, float] = {}
    for timer in args.timers.split(","):
        t0 = time.perf_counter()
        profiles[timer] = remat.profile(
            model, *xs, optimizer=opt, decisions=decs, timer=timer, repeats=args.repeats, **kw
        )
        profile_s[timer] = time.perf_counter() - t0
    names = [b.name for b in next(iter(profiles.values())).blocks]
    mods = [model.get_submodule(n) for n in names]
    plans = list(itertools.product(decs, repeat=len(names)))
    peaks: dict[tuple[str, ...], int] = {}
    for ds in plans:
        for m, d in zip(mods, ds):
            apply_decision(m, d)
        peaks[ds] = remat.measure_peak(model, *xs, optimizer=opt, loss_fn=loss_of, **kw)
    times = _times(model, xs, kw, opt, mods, plans, args.rounds)
    for m in mods:
        apply_decision(m, "keep")
    keep = statistics.median(times[("keep",) * len(names)])
    ratio = {ds: [t / keep for t in v] for ds, v in times.items()}
    med = {ds: statistics.median(v) for ds, v in ratio.items()}
    rows = []
    for pct in args.budgets.split(","):
        for timer, prof in profiles.items():
            try:
                p = remat.plan(prof, f"{pct}%", spans=False)
            except remat.PlanError:
                budget = budget_of(prof, f"{pct}%")  # as remat.plan reads it
                fits = [ds for ds in plans if peaks[ds] <= budget]
                rows.append(
                    {
                        "family": name,
                        "timer": timer,
                        "budget": f"{pct}%",
                        "budget_bytes": budget,
                        "plan": None,
                        "fitting_plans": len(fits),
                    }
                )
                print(
                    f"{pct}% [{timer}]: refused; {len(fits)} of {len(plans)} plans fit (measured)"
                )
                continue
            ours = tuple(str(p.decisions[n]) for n in names)
            fits = [ds for ds in plans if peaks[ds] <= p.budget_bytes]
            best = min(fits, key=lambda ds: med[ds])
            band = max(_iqr(ratio[best]), _iqr(ratio[ours]))
            admitted = admissible(prof, plans, p.budget_bytes)
            allowed = [ds for ds in fits if ds in admitted] or [ours]
            fastest_admitted = min(allowed, key=lambda ds: med[ds])
            row = {
                "family": name,
                "timer": timer,
                "budget": f"{pct}%",
                "budget_bytes": p.budget_bytes,
                "plan": ours,
                "plan_peak_bytes": peaks[ours],
                "met": peaks[ours] <= p.budget_bytes,
                "predicted_peak_bytes": p.predicted_peak_bytes,
                "plan_time": med[ours],
                "plan_iqr": _iqr(ratio[ours]),
                "best": best,
                "best_time": med[best],
                "best_iqr": _iqr(ratio[best]),
                "fitting_plans": len(fits),
                "rank": sorted(med[ds] for ds in fits).index(med[ours]) + 1
                if ours in fits
                else None,
                "within_noise": med[ours] <= med[best] + band,
                "admitted_plans": len(admitted),
                "best_admitted": fastest_admitted,
                "best_admitted_time": med[fastest_admitted],
            }
            rows.append(row)
            print(
                f"{pct}% [{timer}]: plan {_short(ours)} x{row['plan_time']:.3f} "
                f"(IQR {row['plan_iqr']:.3f}, {'met' if row['met'] else 'MISSED'}) | best of "
                f"{len(fits)} {_short(best)} x{row['best_time']:.3f} (IQR {row['best_iqr']:.3f}) | "
                f"rank {row['rank']} | within noise: {'yes' if row['within_noise'] else 'NO'} | "
                f"fastest of the {len(admitted)} the step model admits "
                f"{_short(fastest_admitted)} x{med[fastest_admitted]:.3f}"
            )
    return {
        "family": name,
        "model": about,
        "blocks": names,
        "profile_s": profile_s,
        "plan_times": {",".join(ds): v for ds, v in ratio.items()},
        "rows": rows,
    }


def admissible(
    prof: remat.Profile, plans: list[tuple[str, ...]], budget: int
) -> list[tuple[str, ...]]:
    """The plans whose predicted peak plus the scratch inside operators fits ``budget``: the
    plans ``remat.plan`` chooses among (its cost model picks one of them)."""
    return [ds for ds in plans if prof.peak(list(ds)).bytes + prof.scratch.bytes <= budget]


def _times(
    model: nn.Module,
    xs: tuple[Any, ...],
    kw: dict[str, Any],
    opt: torch.optim.Optimizer,
    mods: list[nn.Module],
    plans: list[tuple[str, ...]],
    rounds: int,
) -> dict[tuple[str, ...], list[float]]:
    clock: Callable[[], float] = (
        time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    )
    state = [p.detach().clone() for p in model.parameters()]
    order = list(plans)
    shuffle = random.Random(0)
    out: dict[tuple[str, ...], list[float]] = {ds: [] for ds in plans}
    for r in range(rounds + 1):  # interleaved; the first round is a warm-up
        shuffle.shuffle(order)
        for ds in order:
            for m, d in zip(mods, ds):
                apply_decision(m, d)
            t = clock()
            opt.zero_grad()
            loss_of(model(*xs, **kw)).backward()
            opt.step()
            if r:
                out[ds].append(clock() - t)
            with torch.no_grad():  # every plan is timed on the same weights
                for p, v in zip(model.parameters(), state):
                    p.copy_(v)
    opt.state.clear()
    return out


def _iqr(v: list[float]) -> float:
    if len(v) < 2:
        return 0.0
    q = statistics.quantiles(v, n=4)
    return q[2] - q[0]


def _short(ds: tuple[str, ...]) -> str:
    return "".join(LETTERS[d] for d in ds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="gpt,cnn,encdec")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds after one warm-up")
    ap.add_argument("--budgets", default="70,50,30", help="percentages")
    ap.add_argument(
        "--timers", default="time", help="cost measures to profile with, e.g. time,measured"
    )
    ap.add_argument("--repeats", type=int, default=3, help="the profile's repeats (timer=measured)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--decisions", default=",".join(DECS), help="brute-forced, 'keep' first")
    ap.add_argument("--tiny", action="store_true", help="tiny models (a smoke test)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    env = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "clock": "thread_time" if torch.get_num_threads() == 1 else "perf_counter",
        "rounds": args.rounds,
    }
    print("environment:", env)
    legend = (
        "plans: one letter a block, K keep, R recompute, S selective; times: x the all-keep step"
    )
    print(legend)
    out = [run_family(f, args) for f in args.families.split(",")]
    env["load_average_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "families": out}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
