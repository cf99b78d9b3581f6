"""``remat explain [MODULE:FACTORY]``: what one training step keeps for backward, and why.

Runs :func:`remat.explain` on the model a factory returns, with its positional and
keyword inputs (see :mod:`remat.cli._factory`), or on the built-in model of ``remat bench``, and
prints the table: every tensor alive at the end of forward with its module,
operator, shape, dtype, bytes, source line and reason, totals per reason and
per module, where the step's peak falls, and the boundary warnings.
``--wrap`` checkpoints the model's repeated blocks first
(:func:`remat.apply_activation_checkpointing`), to see what that changes.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..measure.explain import explain
from ..modules.wrap import apply_activation_checkpointing
from ._blocks import add_blocks_argument, blocks_filter, for_the_shell, parse_blocks
from ._factory import (
    FACTORY_HELP,
    add_target_arguments,
    builtin_model,
    load_factory,
    model_failure,
)
from ._usage import Reported, RunError, UsageError, check_output_path, describe, write_text


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="list every tensor one training step keeps for backward, and why",
        description=(
            "Run one training step (forward, loss, backward) of a model and list every tensor "
            "alive at the end of forward: module, operator, shape, dtype, bytes, source line, "
            "and why it is kept (not checkpointed, a checkpoint's input, a selective save, "
            "offloaded). Says where the step's peak falls and warns about checkpoints that do "
            f"not help. {FACTORY_HELP} Without MODULE:FACTORY the built-in model of remat bench "
            "is explained."
        ),
    )
    add_target_arguments(p, "explain")
    p.add_argument(
        "--wrap",
        action="store_true",
        help="checkpoint the model's repeated blocks first (remat.apply_activation_checkpointing; "
        "--blocks picks others)",
    )
    add_blocks_argument(p, "checkpoint with --wrap")
    p.add_argument(
        "--all", action="store_true", help="list every tensor (default: the largest, see --top)"
    )
    p.add_argument(
        "--top", type=int, default=25, metavar="N", help="list the N largest tensors (default 25)"
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the report as JSON")
    p.set_defaults(run=main)


def _check(args: argparse.Namespace) -> None:
    if args.top < 1:
        raise UsageError(
            f"--top {args.top}: pass a number of rows >= 1 (the largest tensors to list), or "
            "--all for every one."
        )
    if args.blocks is not None:
        if not args.wrap:
            raise UsageError(
                f"--blocks {args.blocks!r} picks the blocks --wrap checkpoints: add --wrap, or "
                "drop --blocks."
            )
        parse_blocks(args.blocks)
    if args.json is not None:
        check_output_path("--json", args.json)
    if args.target is not None and args.model is not None:
        raise UsageError(
            f"--model {args.model} picks a built-in model: drop it, or drop {args.target}."
        )


def main(args: argparse.Namespace) -> int:
    """Run ``remat explain``: exit code 0 done, 2 a usage mistake, 1 the factory or model failed."""
    with Reported("remat explain") as run:
        _check(args)
        if args.target is None:
            model, inputs, label = builtin_model(args.model)
            was_tuple = True
            print(f"remat explain: {label}", flush=True)
        else:
            model, inputs, was_tuple = load_factory(args.target)
        if args.wrap:
            pick = blocks_filter(model, args.blocks)
            try:
                wrapped = apply_activation_checkpointing(model, check_fn=pick)
            except Exception as e:
                raise RunError(for_the_shell(f"--wrap: {describe(e)}")) from None
            print(f"remat explain: checkpointed {len(wrapped)} blocks", flush=True)
        try:
            report = explain(model, *inputs.args, **inputs.kwargs)
        except Exception as e:
            raise model_failure(e, "running", args.target, was_tuple) from None
        print(report.table(top=None if args.all else args.top))
        if args.json is not None:
            write_text("--json", args.json, report.to_json())
    return run.code
