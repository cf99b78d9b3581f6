"""Profiles and plans written out field for field, to compare two versions of remat.

A refactor that must not change behaviour (#36) is checked by running this script on the
commit before it and on the commit after it and comparing the two JSON files: they must be
identical. For each model (the benchmark GPT and MLP chain, a ResNet-50-shaped CNN and, where
``transformers`` is installed, a small Llama, the last two from the test suite's models)
it profiles one training step with ``timer="flops"`` (costs are counted FLOPs, so every
number is deterministic: bytes are exact on any machine), and plans it at budgets of 70, 50 and 30 %
(``remat.plan``'s percentages: of what the unchecked step allocates above its static
bytes). It writes each profile's JSON, each plan's JSON, decisions,
predicted peak and table (``str(plan)``), or the error where no plan fits.

The models come from this checkout (``tests/support``), the ``remat`` imported is whichever
the environment gives (``PYTHONPATH=<other checkout>/src`` to run another version).

Run: python benchmarks/plan_compare.py [--json out.json] [--models gpt,mlp,resnet,llama]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the test suite's models (tests/support)

import remat  # noqa: E402
from remat.bench.models import ModelConfig, build, example_input  # noqa: E402

FRACTIONS = (0.7, 0.5, 0.3)

#: A model and the arguments of one step (positional, keyword).
Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def _bench(model: str) -> Case:
    cfg = ModelConfig(model=model, layers=6, d_model=64, seq=256, batch=4, heads=2, vocab=128)
    return build(cfg), (example_input(cfg),), {}


def _resnet() -> Case:
    from tests.support.vision_models import ResNet

    torch.manual_seed(0)
    x = torch.randn(2, 3, 128, 128, generator=torch.Generator().manual_seed(1))
    return ResNet((4, 8, 16, 32), bottleneck=True), (x,), {}


def _llama() -> Case:
    from tests.support.hf_models import llama

    torch.manual_seed(0)
    model, batch = llama()
    return model, (), batch


CASES: dict[str, Callable[[], Case]] = {
    "gpt": lambda: _bench("gpt"),
    "mlp": lambda: _bench("mlp"),
    "resnet": _resnet,
    "llama": _llama,
}


def _loss(out: Any) -> torch.Tensor:
    """The loss of a model's output: itself, a Hugging Face output's ``loss``, or its sum."""
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.sum()
    return out.loss  # type: ignore[no-any-return]


def compare_model(name: str) -> dict[str, Any]:
    """The profile of model ``name`` and its plans at :data:`FRACTIONS` of its peak."""
    model, args, kwargs = CASES[name]()
    prof = remat.profile(model, *args, loss_fn=_loss, timer="flops", **kwargs)
    plans: dict[str, Any] = {}
    for f in FRACTIONS:
        budget = f"{f:.0%}"
        try:
            plan = remat.plan(prof, budget)
        except remat.PlanError as e:
            plans[budget] = {"error": str(e)}
            continue
        plans[budget] = {
            "decisions": dict(plan.decisions),
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "json": json.loads(plan.to_json()),
            "table": str(plan),
        }
    return {
        "profile": json.loads(prof.to_json()),
        "unchecked_peak_bytes": prof.unchecked_peak_bytes,
        "floor_bytes": prof.floor_bytes,
        "plans": plans,
    }


def available(names: list[str]) -> list[str]:
    """``names`` but ``llama`` where ``transformers`` is not installed."""
    if "llama" in names:
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("llama skipped: transformers is not installed", flush=True)
            return [n for n in names if n != "llama"]
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(CASES), help="comma-separated: " + ",".join(CASES))
    ap.add_argument("--json", default=None, help="write the profiles and plans to this file")
    args = ap.parse_args(argv)
    names = available(args.models.split(","))
    print(
        {
            "remat": remat.__file__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "models": names,
        },
        flush=True,
    )
    out = {}
    for name in names:
        out[name] = compare_model(name)
        for pct, p in out[name]["plans"].items():
            said = p.get("predicted_peak_bytes", p.get("error", "")[:60])
            print(f"{name:7} {pct:>4}: {said}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
