"""``remat verify [MODULE:FACTORY] --plan plan.json``: a plan on real steps, against its prediction.

Applies a plan to the model a factory returns (see :mod:`remat.cli._factory`; the built-in
model of ``remat bench`` without one): a plan saved by ``remat plan --json FILE`` or
:meth:`remat.Plan.save` (``--plan FILE``), or one made on the spot for ``--budget``
(:func:`remat.profile` and :func:`remat.plan`, as ``remat plan`` does). Without either,
the model is verified as the factory returns it (its own checkpoints). Then it runs real
steps:

- the step peak of the loop the plan was made for (:func:`remat.measure_peak`: the larger
  of the first step and a later one, in the units of a budget), printed beside the plan's
  prediction and budget;
- :func:`remat.verify`: one step with the plan and one without, every gradient, buffer
  and the loss compared bitwise, with the boundary warnings.

A plan does not record the loop it was made for: pass the ``--optimizer`` and
``--keep-grads`` it was planned with, or the measured peak is of another step.

Exit codes: 0 when everything is bitwise equal and the measured peak is within the plan's
budget, 1 when something differs or the peak is over the budget (the report is printed
first), 2 a usage mistake (found before any step runs).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..engine.bytes import fmt_bytes
from ..engine.errors import PlanError
from ..measure.verify import verify
from ..planner.auto import measure_peak
from ..planner.measure import profile
from ..planner.meta import is_meta
from ..planner.solve import Plan, plan
from ..planner.stepmodel import parse_budget
from ._blocks import add_blocks_argument, blocks_filter, for_the_shell, parse_blocks
from ._factory import FACTORY_HELP, add_target_arguments, builtin_model, factory_hint, load_factory
from ._usage import RunError, UsageError, describe
from .plan import OPTIMIZERS


def add_parser(sub: Any) -> None:
    """Register ``verify`` on the subparsers object of ``remat``'s parser."""
    p = sub.add_parser(
        "verify",
        help="apply a plan, run real steps: measured vs predicted peak, gradients bitwise",
        description=(
            "Apply a checkpointing plan to a model (a file saved by remat plan --json, or one "
            "planned on the spot for --budget), run real training steps and report the "
            "measured step peak beside the plan's prediction and budget, and whether every "
            "gradient, buffer and the loss are bitwise those of the model without "
            f"checkpointing (remat.verify). {FACTORY_HELP} Without MODULE:FACTORY, the "
            "built-in model of remat bench is verified (try: remat verify --budget 50%). "
            "Exit code 1 when something differs or the peak is over the budget."
        ),
    )
    add_target_arguments(p, "verify")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--plan",
        metavar="FILE",
        default=None,
        help="a plan saved by remat plan --json FILE or remat.Plan.save (remat.Plan.load)",
    )
    which.add_argument(
        "--budget",
        default=None,
        help="plan on the spot for this step peak (as remat plan --budget: bytes, '18GiB', "
        "'60%%'); without --plan or --budget the model is verified as the factory returns it",
    )
    p.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default="none",
        help="the optimizer of your loop, as the plan was made for (its state and step are "
        "part of the peak; default: none)",
    )
    p.add_argument(
        "--keep-grads",
        action="store_true",
        help="your loop keeps gradients allocated, as the plan was made for",
    )
    p.add_argument(
        "--timer",
        choices=("time", "measured", "flops"),
        default=None,
        help="with --budget: how the planner prices recompute (see remat plan --help; "
        "default: time)",
    )
    add_blocks_argument(p, "plan with --budget")
    p.set_defaults(run=main)


def _check(args: argparse.Namespace) -> Plan | None:
    """The values that need no model, and the plan file read, before the model is built."""
    if args.target is not None and args.model is not None:
        raise UsageError(
            f"--model {args.model} picks a built-in model: drop it, or drop {args.target}."
        )
    if args.timer is not None and args.budget is None:
        raise UsageError(
            f"--timer {args.timer} prices a plan made for --budget; a saved plan is priced "
            "already: add --budget, or drop --timer."
        )
    if args.blocks is not None:
        if args.budget is None:
            raise UsageError(
                f"--blocks {args.blocks!r} picks the blocks to plan for --budget; a saved plan "
                "names its own blocks: add --budget, or drop --blocks."
            )
        parse_blocks(args.blocks)
    if args.budget is not None:
        try:
            parse_budget(args.budget, 0, 2**62)  # a percentage is checked against the profile
        except ValueError as e:
            raise UsageError(
                f"--budget {args.budget!r}: {str(e).removeprefix('remat.plan: ')}"
            ) from None
    if args.plan is None:
        return None
    if not os.path.isfile(args.plan):
        raise UsageError(
            f"--plan {args.plan}: no such file; pass a plan saved by remat plan --json FILE "
            "(or remat.Plan.save)."
        )
    try:
        return Plan.load(args.plan)
    except OSError as e:
        raise UsageError(f"--plan {args.plan}: cannot read it: {e.strerror or e}.") from None
    except (PlanError, ValueError, TypeError) as e:
        raise UsageError(f"--plan {args.plan}: not a plan remat can read: {e}") from None


def main(args: argparse.Namespace) -> int:
    """Run ``remat verify``: exit code 0 all equal and within budget, 1 a difference, an
    over-budget peak or a failure of the model, 2 a usage mistake."""
    try:
        saved = _check(args)
        if args.target is None:
            model, inputs, label = builtin_model(args.model)
            was_tuple = True
            print(f"remat verify: {label}", flush=True)
        else:
            model, inputs, was_tuple = load_factory(args.target)
        if is_meta(model, (inputs.args, inputs.kwargs)):
            raise UsageError(
                "verify runs real steps, and a model on the meta device has none: build it on "
                "the device it trains on (remat plan plans a meta model from shapes)."
            )
        pick = blocks_filter(model, args.blocks)
        make = OPTIMIZERS[args.optimizer]
        opt = None if make is None else make(model.parameters())
        name = args.target or "the built-in"
        chosen = saved
        try:
            if saved is not None:
                saved.apply(model)
                print(f"remat verify: applied {args.plan} ({_summary(saved)})", flush=True)
            elif args.budget is not None:
                print("remat verify: planning (remat.profile, remat.plan)", flush=True)
                prof = profile(
                    model,
                    inputs,
                    optimizer=opt,
                    set_to_none=not args.keep_grads,
                    check_fn=pick,
                    timer=args.timer or "time",
                )
                chosen = plan(prof, args.budget)
                chosen.apply(model)
                print(f"remat verify: applied the plan ({_summary(chosen)})", flush=True)
        except PlanError as e:
            where = f"--plan {args.plan}: " if saved is not None else ""
            raise UsageError(where + for_the_shell(str(e))) from None
        print("remat verify: running the steps (remat.measure_peak, remat.verify)", flush=True)
        try:
            peak = measure_peak(model, inputs, optimizer=opt, set_to_none=not args.keep_grads)
            report = verify(model, *inputs.args, **inputs.kwargs)
        except Exception as e:
            if isinstance(e, PlanError) or str(e).startswith("remat."):
                raise RunError(for_the_shell(str(e))) from None
            raise RunError(
                f"running {name}'s model raised {describe(e)}"
                + factory_hint(args.target or "", was_tuple)
            ) from None
        over = chosen is not None and peak > chosen.budget_bytes
        print(peak_line(peak, chosen, args))
        print(report)
        if not report.ok:
            print(
                f"remat verify: error: {len(report.differences)} of {report.compared} tensors "
                "differ with checkpointing (listed above)",
                file=sys.stderr,
            )
            return 1
        if over:
            assert chosen is not None
            print(
                f"remat verify: error: the measured step peak {fmt_bytes(peak)} is over the "
                f"plan's budget {fmt_bytes(chosen.budget_bytes)}",
                file=sys.stderr,
            )
            return 1
    except UsageError as e:
        print(f"remat verify: error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"remat verify: error: {e}", file=sys.stderr)
        return 1
    return 0


def _summary(p: Plan) -> str:
    """``6 blocks: 3 recompute, 2 selective, 1 keep``."""
    counts: dict[str, int] = {}
    for d in p.decisions.values():
        counts[d.value] = counts.get(d.value, 0) + 1
    parts = ", ".join(f"{n} {d}" for d, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"{len(p.decisions)} blocks: {parts}"


def peak_line(peak: int, p: Plan | None, args: argparse.Namespace) -> str:
    """The measured step peak, beside the plan's prediction and budget when there is a plan.

    Example:
        >>> import argparse
        >>> p = Plan(decisions={"b.0": "recompute"}, predicted_peak_bytes=3 * 2**20,
        ...          predicted_overhead_s=0.0, unchecked_peak_bytes=5 * 2**20, budget_bytes=4 * 2**20)
        >>> print(peak_line(3 * 2**20, p, argparse.Namespace(optimizer="none", keep_grads=False)))
        step peak (measured: the larger of the first step and a later one, as a budget counts it): 3.00 MiB
          predicted 3.00 MiB (exact), budget 4.00 MiB: within
    """
    head = (
        "step peak (measured: the larger of the first step and a later one, as a budget "
        f"counts it): {fmt_bytes(peak)}"
    )
    if p is None:
        return head
    diff = peak - p.predicted_peak_bytes
    off = "exact" if diff == 0 else f"measured {'+' if diff > 0 else '-'}{fmt_bytes(abs(diff))}"
    within = "within" if peak <= p.budget_bytes else "OVER"
    text = (
        f"{head}\n  predicted {fmt_bytes(p.predicted_peak_bytes)} ({off}), budget "
        f"{fmt_bytes(p.budget_bytes)}: {within}"
    )
    if diff and getattr(args, "plan", None) is not None:
        loop = f"--optimizer {args.optimizer}" + (" --keep-grads" if args.keep_grads else "")
        text += (
            f"\n  (measured for the loop {loop}: a plan is predicted for the loop it was made "
            "for; pass the --optimizer and --keep-grads it was planned with)"
        )
    return text
