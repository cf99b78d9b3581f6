"""``remat plan MODULE:FACTORY --budget 60%``: profile a model and print the plan."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

import torch

from .._errors import PlanError
from .._plan import plan
from .._profile import profile
from ._usage import UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="profile your model and print the checkpointing plan for a memory budget",
        description=(
            "Profile a model and choose keep/recompute/selective/offload per block so that the "
            "predicted peak fits the budget at the least added time. FACTORY is a function "
            "returning (model, example_args)."
        ),
    )
    p.add_argument("target", metavar="MODULE:FACTORY", help="e.g. mypkg.models:make_model")
    p.add_argument(
        "--budget", required=True, help="bytes, '18GiB', or '60%%' of the unchecked peak"
    )
    p.add_argument("--timer", choices=("time", "flops"), default="time", help="cost measure")
    p.add_argument("--solver", choices=("auto", "milp", "dp"), default="auto")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the plan as JSON")
    p.set_defaults(run=main)


def _load(target: str) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    if ":" not in target:
        raise UsageError(f"expected MODULE:FACTORY (e.g. mypkg.models:make), got {target!r}.")
    mod_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(f"cannot import module {mod_name!r}: {e}") from None
    factory = getattr(mod, attr, None)
    if factory is None:
        raise UsageError(f"module {mod_name!r} has no attribute {attr!r}.")
    result = factory()
    if not (
        isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)
    ):
        raise UsageError(
            f"{target}() must return (model, example_args), got {type(result).__name__}."
        )
    model, example = result
    args = example if isinstance(example, tuple) else (example,)
    return model, args


def main(args: argparse.Namespace) -> int:
    try:
        model, example = _load(args.target)
        prof = profile(model, *example, timer=args.timer)
        chosen = plan(prof, args.budget, solver=args.solver)
    except (UsageError, PlanError, ValueError) as e:
        print(f"remat plan: error: {e}", file=sys.stderr)
        return 2
    print(
        f"remat plan: {len(prof.blocks)} blocks, unchecked activation peak "
        f"{prof.unchecked_peak_bytes / 2**20:.2f} MiB, device {prof.device}, cost in {prof.cost_unit}"
    )
    print(chosen)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(chosen.to_json())
    return 0
