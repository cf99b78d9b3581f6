"""``remat plan MODULE:FACTORY --budget 60%``: profile a model and print the plan.

Without ``MODULE:FACTORY`` the built-in model of ``remat bench`` is planned
(``--model gpt`` or ``mlp``, the default size), so the command can be tried
before writing a factory: ``remat plan --budget 50%``.

``MODULE`` is a module importable from the current directory (or ``PYTHONPATH``)
or the path of a Python file (``path/to/models.py:make``). ``FACTORY`` is called
without arguments and returns ``(model, example_args)``: ``model`` an
``nn.Module``, ``example_args`` a tuple of positional arguments for its forward, a
:class:`remat.Inputs` for keyword arguments too, or its only argument (see
:mod:`remat.cli._factory`).

A model (and inputs) the factory builds on the meta device (``with torch.device("meta"):``)
is planned from shapes alone (:mod:`remat.planner.meta`): nothing is allocated, every
tensor's bytes are counted as on ``--device`` (the device it will train on), and the
scratch inside operators is not counted (the output says so). ``--hf-config`` builds a
Hugging Face causal language model from its config on meta (:mod:`remat.cli._hfconfig`):
"will a 7B model fit in 80 GB at 4096 tokens?" answered on a laptop, in seconds::

    remat plan --hf-config llama-7b.json --batch 1 --seq 4096 --dtype bfloat16 \
        --optimizer adamw --budget 60GiB --device cuda --calibration H100

The command-line values are checked before the model is built; the factory or
the model raising is a runtime error (exit code 1), reported in one line with
where it was raised.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
from typing import Any

import torch

from ..engine.bytes import fmt_bytes as _fmt
from ..engine.errors import PlanError
from ..modules.modelinfo import device_of
from ..planner import advice
from ..planner.apply import restore_state, snapshot_state
from ..planner.calibration import named as named_calibration
from ..planner.calibration import saved_names
from ..planner.inputs import Inputs
from ..planner.loop import Loop
from ..planner.measure import plan_scratch, profile
from ..planner.meta import is_meta, one_sequence_a_row
from ..planner.progress import Progress
from ..planner.shaped import ProfileSource
from ..planner.shapes import Shapes, shape_plans
from ..planner.solve import plan
from ..planner.stepmodel import located, parse_budget
from ._blocks import BlockFilter, add_blocks_argument, blocks_filter, for_the_shell, parse_blocks
from ._factory import FACTORY_HELP, add_target_arguments, model_failure
from ._factory import builtin_model as _builtin
from ._factory import load_factory as _load
from ._hfconfig import DTYPES, read_config
from ._hfconfig import build as build_hf
from ._usage import Reported, RunError, UsageError, check_output_path, describe, write_text


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="profile your model and print the checkpointing plan for a memory budget",
        description=(
            "Profile a model and choose keep/recompute/selective/offload per block so that the "
            f"predicted peak fits the budget at the least added time. {FACTORY_HELP} Without "
            "MODULE:FACTORY, the built-in model of remat bench is planned (try: remat plan "
            "--budget 50%). --json FILE saves the plan: apply it with "
            "remat.Plan.load(FILE).apply(model), check it with remat verify --plan FILE."
        ),
    )
    add_target_arguments(p, "plan")
    add_blocks_argument(p, "plan")
    hf = p.add_argument_group(
        "a Hugging Face model from its config (instead of MODULE:FACTORY), built on the meta "
        "device: nothing allocated"
    )
    hf.add_argument(
        "--hf-config",
        metavar="FILE_OR_JSON",
        default=None,
        help="a model's config.json, a folder holding one, or the JSON text; planned as "
        "AutoModelForCausalLM.from_config on the meta device with use_cache=False",
    )
    hf.add_argument("--batch", type=int, default=None, help="with --hf-config: rows (default 1)")
    hf.add_argument("--seq", type=int, default=None, help="with --hf-config: tokens a row")
    hf.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="with --hf-config: the parameters' dtype (default: the config's torch_dtype, "
        "else float32)",
    )
    p.add_argument(
        "--budget",
        required=True,
        help="the training step's peak: bytes, '18GiB' ('18GB' = 18e9), or '60%%' of what the "
        "unchecked step allocates above its static bytes",
    )
    p.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default="none",
        help="the optimizer of your loop, made with torch's defaults on the model's parameters "
        "(its state and step are part of the peak; default: none)",
    )
    p.add_argument(
        "--keep-grads",
        action="store_true",
        help="your loop keeps gradients allocated (zero_grad(set_to_none=False), accumulation)",
    )
    p.add_argument(
        "--timer",
        choices=("time", "measured", "flops"),
        default="time",
        help="how the time a decision adds is priced: time counts each block's work and "
        "prices it with this device's calibration (cached; stable plans), measured times the "
        "blocks (varies with load), flops counts FLOPs only (default: time)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="for a model on the meta device (--hf-config, or a factory that builds under "
        "torch.device('meta')): the device it will train on; bytes are counted as there and "
        "--timer time prices with its calibration (default cpu)",
    )
    p.add_argument(
        "--calibration",
        metavar="NAME_OR_FILE",
        default=None,
        help="with --timer time: price the plan with a saved calibration: a device's name "
        "(one shipped with remat) or a file written by remat.planner.calibration.save "
        "(default: this machine's device, calibrated once and cached)",
    )
    p.add_argument(
        "--autocast",
        choices=tuple(AUTOCAST),
        default=None,
        help="your loop is torch's mixed-precision recipe: forward and loss in a "
        "torch.autocast region of this dtype on the model's device, backward and the "
        "optimizer step after it (default: no autocast)",
    )
    p.add_argument(
        "--solver",
        choices=("auto", "milp", "dp"),
        default="auto",
        help="auto/dp: the chain dynamic program (spans too); milp: one decision per block",
    )
    p.add_argument(
        "--no-spans",
        action="store_true",
        help="one decision per block: no regions spanning consecutive blocks",
    )
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="also apply the plan and run remat explain's boundary diagnostics on one "
        "instrumented step (two more steps)",
    )
    p.add_argument(
        "--shapes",
        metavar="DIMS[:MULTIPLE]",
        default=None,
        help="batches vary along these input dimensions (1: the sequence of (batch, seq) "
        "tokens; 2,3: square images), the example being the largest: plan every size up to "
        "it (remat.Shapes), printing the plan at each profiled size; MULTIPLE rounds sizes up "
        "to buckets (default 1)",
    )
    p.add_argument("--json", metavar="FILE", default=None, help="also write the plan as JSON")
    p.set_defaults(run=main)


#: ``--autocast`` names and their dtypes.
AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}

#: ``--optimizer`` names and how each optimizer is made (torch's default hyper-parameters).
OPTIMIZERS: dict[str, Any] = {
    "none": None,
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params),
    "adamw": lambda params: torch.optim.AdamW(params),
}


def _check(args: argparse.Namespace) -> None:
    """Check the values that need no model, before it is built and profiled."""
    try:
        parse_budget(args.budget, 0, 2**62)  # a percentage is checked against the profile later
    except ValueError as e:
        raise UsageError(
            f"--budget {args.budget!r}: {str(e).removeprefix('remat.plan: ')}"
        ) from None
    if args.solver == "milp" and importlib.util.find_spec("scipy") is None:
        raise UsageError(
            "--solver milp needs scipy: pip install 'remat[plan]' (or pass --solver dp)."
        )
    if args.json is not None:
        check_output_path("--json", args.json)
    if args.blocks is not None:
        parse_blocks(args.blocks)
    _check_hf(args)
    if args.calibration is not None:
        if args.timer != "time":
            raise UsageError(
                f"--calibration prices counted work (--timer time); --timer {args.timer} "
                "does not use it: drop one of them."
            )
        try:
            named_calibration(args.calibration, torch.float32)
        except (ValueError, OSError, KeyError) as e:
            raise UsageError(
                f"--calibration {args.calibration!r}: "
                f"{str(e).removeprefix('remat: ').removesuffix('.')}; pass a device's name "
                f"({', '.join(sorted(saved_names())) or 'none shipped yet'}) or a file saved "
                "by remat.planner.calibration.save."
            ) from None
    if args.shapes is not None:
        args.shapes = parse_shapes(args.shapes)
        if args.diagnose:
            raise UsageError(
                "--diagnose runs on one batch shape: leave it out with --shapes, and run "
                "remat explain on a batch to see its warnings."
            )


def _check_hf(args: argparse.Namespace) -> None:
    """``--hf-config`` and the flags that only go with it."""
    if args.hf_config is None:
        given = [f for f in ("batch", "seq", "dtype") if getattr(args, f) is not None]
        if given:
            raise UsageError(
                f"--{given[0]} sizes the inputs of --hf-config; a factory makes its own "
                "inputs: drop it, or pass --hf-config."
            )
        return
    if args.target is not None or args.model is not None:
        other = args.target if args.target is not None else f"--model {args.model}"
        raise UsageError(
            f"--hf-config builds the model to plan: drop {other}, or drop --hf-config."
        )
    if args.seq is None:
        raise UsageError("--hf-config needs --seq, the tokens a row of the batch (e.g. 4096).")
    for flag, value in (("--batch", args.batch), ("--seq", args.seq)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}.")


def _check_meta(args: argparse.Namespace, shaped: bool, where: Any) -> None:
    """The flags that depend on whether the model is on the meta device (``shaped``)."""
    if not shaped:
        if args.device is not None:
            raise UsageError(
                f"--device is for a model on the meta device (the device it will train on); "
                f"{args.target}'s model is on {where}, where it is profiled: drop --device."
            )
        return
    refused = {
        "--autocast": args.autocast is not None,
        "--diagnose": args.diagnose,
        "--timer measured": args.timer == "measured",
    }
    for flag, given in refused.items():
        if given:
            raise UsageError(
                f"{flag} runs real steps, and a model on the meta device has none: drop it "
                "(build the model in the dtype it computes in for --autocast)."
            )
    if args.shapes is not None:
        raise UsageError(
            "--shapes is not planned from shapes yet: plan the largest batch of a model on "
            "the meta device without it, or build the model on its device."
        )
    if (
        args.device == "cuda"
        and args.timer == "time"
        and args.calibration is None
        and not torch.cuda.is_available()
    ):
        raise UsageError(
            "--device cuda prices the plan with a GPU's calibration and this machine has no "
            "CUDA device: pass --calibration NAME_OR_FILE (shipped: "
            f"{', '.join(sorted(saved_names())) or 'none yet'}; or a file saved by "
            "remat.planner.calibration.save on the GPU), or --timer flops."
        )


def parse_shapes(text: str) -> Shapes:
    """``--shapes DIMS[:MULTIPLE]`` as a :class:`remat.Shapes` (``"1"``, ``"2,3:32"``).

    Example:
        >>> parse_shapes("2,3:32")
        Shapes(dims=(2, 3), sizes=(), multiple=32, larger='error', checks=4)
    """
    dims, _, multiple = text.partition(":")
    try:
        return Shapes(
            dims=tuple(int(d) for d in dims.split(",")), multiple=int(multiple) if multiple else 1
        )
    except ValueError as e:
        raise UsageError(
            f"--shapes {text!r}: expected DIMS[:MULTIPLE], dimensions separated by commas "
            f"(1, or 2,3:32); {str(e).removeprefix('remat.Shapes: ')}"
        ) from None


def main(args: argparse.Namespace) -> int:
    """Run ``remat plan``: exit code 0 done, 2 a usage mistake, 1 the factory or model failed.
    Each stage is said on standard error as it starts (the plan is printed on standard output)."""
    say = Progress("remat plan")
    with Reported("remat plan") as run:
        _check(args)
        if args.hf_config is not None:
            fields = read_config(args.hf_config)
            batch, dtype = args.batch or 1, DTYPES.get(args.dtype or "")
            if dtype is None:
                dtype = DTYPES.get(
                    str(fields.get("torch_dtype") or fields.get("dtype")), torch.float32
                )
            try:
                model, inputs, label = build_hf(fields, batch, args.seq, dtype)
            except UsageError:
                raise
            except Exception as e:
                raise RunError(f"building the model of --hf-config raised {describe(e)}") from None
            was_tuple = True
            print(f"remat plan: {label}", flush=True)
        elif args.target is None:
            model, inputs, label = _builtin(args.model)
            was_tuple = True
            print(f"remat plan: {label}", flush=True)
        elif args.model is not None:
            raise UsageError(
                f"--model {args.model} picks a built-in model: drop it, or drop {args.target}."
            )
        else:
            model, inputs, was_tuple = _load(args.target)
        example = (inputs.args, inputs.kwargs)  # every tensor the model is given
        shaped = is_meta(model, example)
        _check_meta(args, shaped, device_of(model, example) if not shaped else "meta")
        pick = blocks_filter(model, args.blocks)
        try:
            make = OPTIMIZERS[args.optimizer]
            opt = None if make is None else make(model.parameters())
            region: Any = contextlib.nullcontext()
            if args.autocast is not None:  # planned inside it: see remat.planner.amp
                device = device_of(model, example)
                region = torch.autocast(device.type, dtype=AUTOCAST[args.autocast])
            with region, one_sequence_a_row() if shaped else contextlib.nullcontext():
                if args.shapes is not None:
                    return _plan_shapes(args, model, inputs, opt, pick)
                if shaped:
                    say("profiling from shapes (nothing allocated)")
                    prof = profile(
                        model,
                        inputs,
                        optimizer=opt,
                        set_to_none=not args.keep_grads,
                        check_fn=pick,
                        timer=args.timer,
                        device=args.device or "cpu",
                        calibration=args.calibration,
                    )
                else:
                    prof = _real_profile(args, model, inputs, opt, pick, say)
        except UsageError:  # --shapes: no plan meets the budget at some size
            raise
        except Exception as e:  # the model cannot be run or planned as given
            raise model_failure(e, "profiling", args.target, was_tuple) from None
        say(f"planning {len(prof.blocks)} blocks")
        try:
            chosen = plan(
                prof, args.budget, solver=args.solver, spans=False if args.no_spans else None
            )
        except (PlanError, ValueError) as e:
            raise UsageError(for_the_shell(str(e))) from None
        step: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        if args.diagnose:
            chosen.apply(model)
            step = (inputs.args, inputs.kwargs)
        with region:
            chosen.diagnostics = advice.on_model(model, chosen, step)
        print(
            f"remat plan: {len(prof.blocks)} blocks, unchecked step peak "
            f"{_fmt(prof.unchecked_peak_bytes)} (before it starts: {_fmt(prof.static_step_bytes)} of "
            "parameters, buffers, inputs, kept gradients and optimizer state), "
            f"device {prof.device}; 'adds': "
            + ("the time a decision adds to a step" if prof.cost_unit == "s" else "its FLOPs")
            + (f" priced with calibration {args.calibration}" if args.calibration else "")
        )
        if prof.from_shapes and not prof.scratch.located:
            print(
                f"remat plan: from shapes (a model on the meta device, nothing allocated): "
                f"every tensor's bytes as on {prof.device}; the scratch inside operators "
                "(cuBLAS, cuDNN, oneDNN workspaces) is not counted, only a real step shows it: "
                "leave room for it under the budget"
            )
        say.done("planned")
        print(for_the_shell(str(chosen)))
        if args.json is not None:
            write_text("--json", args.json, chosen.to_json())
            # a model built on meta has no real steps to verify
            print(saved_how(args.json, None if shaped else args.target or ""))
    return run.code


def _real_profile(
    args: argparse.Namespace,
    model: Any,
    inputs: Inputs,
    opt: Any,
    pick: BlockFilter | None,
    say: Progress,
) -> Any:
    """The profile of a model on its device: from shapes (a meta copy, nothing allocated),
    with the scratch inside operators measured in one real step of the plan for
    ``--budget`` (the step that plan runs, not the unchecked one); of real steps where shapes
    cannot (said)."""
    loop = Loop(optimizer=opt, set_to_none=not args.keep_grads, check_fn=pick, timer=args.timer)
    prof = ProfileSource(model, loop, agree=False, device=None, say=say)(inputs)
    if not prof.from_shapes:
        return prof
    try:
        first = plan(prof, args.budget, solver=args.solver, spans=False if args.no_spans else None)
    except (PlanError, ValueError):
        return prof  # no plan: the error is the planner's, below
    blocks = {b.name: model.get_submodule(b.name) for b in prof.blocks}
    wrapping = snapshot_state(blocks)
    say("measuring the scratch inside operators in one step of the plan")
    try:
        first.apply(model)
        where = plan_scratch(model, inputs, list(blocks), loop)
    finally:
        restore_state(blocks, wrapping)
    return located(prof, where)


def _plan_shapes(
    args: argparse.Namespace, model: Any, inputs: Inputs, opt: Any, pick: BlockFilter | None
) -> int:
    """``--shapes``: the plans at every profiled size (the example is the largest batch)."""
    try:
        loop = Loop(optimizer=opt, set_to_none=not args.keep_grads, check_fn=pick, timer=args.timer)
        plans = shape_plans(model, inputs, args.shapes, args.budget, loop)
        chosen = {n: plans.plan_for(n) for n in plans.fit.knots}
    except (PlanError, ValueError) as e:
        raise UsageError(for_the_shell(str(e))) from None
    print(for_the_shell(str(plans)))
    for n, p in chosen.items():
        print(f"\nat size {n}:")
        print(for_the_shell(str(p)))
    if args.json is not None:
        data = {str(n): json.loads(p.to_json()) for n, p in chosen.items()}
        write_text("--json", args.json, json.dumps(data, indent=2))
    return 0


def saved_how(path: str, target: str | None) -> str:
    """What ``--json FILE`` wrote and how to use it (printed after the plan); ``target``: the
    ``MODULE:FACTORY`` for ``remat verify`` (``""``: the built-in model; ``None``: no real
    steps to verify, a model on the meta device).

    Example:
        >>> print(saved_how("plan.json", "models.py:make"))
        remat plan: saved the plan to plan.json; apply it in your training script with
          plan = remat.Plan.load('plan.json'); plan.apply(model)
        check it on real steps: remat verify models.py:make --plan plan.json
    """
    text = (
        f"remat plan: saved the plan to {path}; apply it in your training script with\n"
        f"  plan = remat.Plan.load({path!r}); plan.apply(model)"
    )
    if target is not None:
        text += (
            f"\ncheck it on real steps: remat verify {target + ' ' if target else ''}--plan {path}"
        )
    return text
