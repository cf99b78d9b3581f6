"""``MODULE:FACTORY`` and the built-in model: what ``remat plan``, ``explain`` and ``verify`` run.

``MODULE`` is a module importable from the current directory (or ``PYTHONPATH``)
or the path of a Python file (``path/to/models.py:make``). ``FACTORY`` is called
without arguments and returns ``(model, example_args)``: ``model`` an
``nn.Module``; ``example_args`` the inputs of one training step, as

- a tuple: the positional arguments of ``forward`` (``(x,)``, ``(x, mask)``);
- a :class:`remat.Inputs`: positional and keyword arguments
  (``remat.Inputs(input_ids=ids, labels=ids)``), as the API takes them;
- anything else: ``forward``'s only argument (a tensor, a list, a dict).

Every subcommand reads the factory this one way (:func:`load_factory`) and hands the
model its inputs as ``model(*inputs.args, **inputs.kwargs)``. Without a factory the
commands take the built-in model of ``remat bench`` at its default size.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Any

import torch

from ..engine.errors import PlanError
from ..planner.inputs import Inputs
from ._blocks import for_the_shell
from ._usage import RunError, UsageError, describe

FACTORY_HELP = (
    "FACTORY is a function without arguments returning (model, example_args): example_args "
    "is a tuple of forward's positional inputs, remat.Inputs(*args, **kwargs) for keyword "
    "inputs too (remat.Inputs(input_ids=ids, labels=ids)), or forward's only input."
)
"""What every subcommand's ``--help`` says about ``MODULE:FACTORY``."""


def add_target_arguments(p: argparse.ArgumentParser, verb: str) -> None:
    """The ``MODULE:FACTORY`` argument and ``--model`` (the built-in model without one) that
    every subcommand taking a user's model has; ``verb`` names what it does to it."""
    p.add_argument(
        "target",
        metavar="MODULE:FACTORY",
        nargs="?",
        default=None,
        help="e.g. mypkg.models:make_model, or a file: path/to/models.py:make_model "
        "(default: the built-in model, see --model)",
    )
    p.add_argument(
        "--model",
        default=None,
        help=f"without MODULE:FACTORY: the built-in model to {verb}, gpt or mlp (default gpt)",
    )


def import_target(mod_name: str) -> Any:
    """The module named ``mod_name``, or loaded from the file ``mod_name`` (``.py``)."""
    is_file = mod_name.endswith(".py") and os.path.isfile(mod_name)
    if is_file or os.sep in mod_name or "/" in mod_name:
        path = os.path.abspath(mod_name)
        if not os.path.isfile(path):
            raise UsageError(
                f"MODULE:FACTORY: no file {mod_name!r}; pass an existing .py file or a module name."
            )
        name = os.path.splitext(os.path.basename(path))[0]
        if name in sys.modules:  # do not shadow a module already imported under that name
            name = f"_remat_cli_{name}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise UsageError(
                f"MODULE:FACTORY: cannot load {mod_name!r} as Python; pass a .py file."
            )
        mod = importlib.util.module_from_spec(spec)
        if os.path.dirname(path) not in sys.path:  # as `python file.py`: its neighbours import
            sys.path.insert(0, os.path.dirname(path))
        sys.modules[name] = mod  # dataclasses and pickling look a module up there
        try:
            spec.loader.exec_module(mod)
        except Exception as e:
            del sys.modules[name]
            raise RunError(f"importing {mod_name} raised {describe(e)}") from None
        return mod
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(mod_name)
    except ImportError as e:
        raise UsageError(
            f"cannot import module {mod_name!r}: {e}. Pass a module importable from the "
            "current directory or PYTHONPATH, or a file: path/to/models.py:FACTORY."
        ) from None
    except Exception as e:  # the module itself is broken: a SyntaxError, an error at import
        raise RunError(f"importing {mod_name} raised {describe(e)}") from None


def load_factory(target: str) -> tuple[torch.nn.Module, Inputs, bool]:
    """The model ``target`` (``MODULE:FACTORY``) returns, its inputs as one :class:`Inputs`,
    and whether ``example_args`` said how to pass them (a tuple or an ``Inputs``; else the
    value is ``forward``'s only argument, and an error running it adds that hint)."""
    mod_name, _, attr = target.rpartition(":")  # the last colon, so a Windows path (C:...) works
    if not mod_name or not attr:
        raise UsageError(
            f"expected MODULE:FACTORY (e.g. mypkg.models:make or models.py:make), got {target!r}."
        )
    mod = import_target(mod_name)
    factory = getattr(mod, attr, None)
    if factory is None:
        raise UsageError(f"module {mod_name!r} has no attribute {attr!r}.")
    if not callable(factory):
        raise UsageError(
            f"{target} is not callable (got {type(factory).__name__}); pass a FACTORY, a "
            "function that returns (model, example_args)."
        )
    try:
        result = factory()
    except TypeError as e:
        if e.__traceback__ is not None and e.__traceback__.tb_next is None:
            # raised by the call itself (a required argument): a usage mistake
            raise UsageError(
                f"{target}() cannot be called without arguments ({e}); pass a FACTORY that "
                "takes none and returns (model, example_args)."
            ) from None
        raise RunError(f"{target}() raised {describe(e)}") from None
    except Exception as e:
        raise RunError(f"{target}() raised {describe(e)}") from None
    if not (isinstance(result, tuple) and len(result) == 2):
        got = type(result).__name__
        if isinstance(result, tuple):
            got = f"a tuple of {len(result)} items"
        raise UsageError(
            f"{target}() must return a pair (model, example_args), got {got}; "
            "return (model, (input,))."
        )
    model, example = result
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"{target}() must return (model, example_args) with model an nn.Module, got a "
            f"{type(model).__name__} first; return (model, (input,))."
        )
    if isinstance(example, Inputs):
        return model, Inputs(*example.args, **example.kwargs), True
    if isinstance(example, tuple):
        if any(isinstance(a, Inputs) for a in example):
            raise UsageError(
                f"{target}() returned a remat.Inputs inside a tuple; return it alone: "
                "(model, remat.Inputs(*args, **kwargs))."
            )
        return model, Inputs(*example), True
    return model, Inputs(example), False


def builtin_model(name: str | None) -> tuple[torch.nn.Module, Inputs, str]:
    """The default-size built-in model of ``remat bench``, its example input and a label."""
    from ..bench.models import MODELS, ModelConfig, build, example_input

    kind = name or "gpt"
    if kind not in MODELS:
        raise UsageError(f"--model: unknown model {kind!r}; choose one of: {', '.join(MODELS)}.")
    cfg = ModelConfig(model=kind)
    heads = f", {cfg.heads} heads" if kind == "gpt" else ""
    label = (
        f"built-in {kind} ({cfg.layers} layers, d={cfg.d_model}{heads}, seq {cfg.seq}, "
        f"batch {cfg.batch})"
    )
    return build(cfg), Inputs(example_input(cfg)), label


def factory_hint(target: str, example_was_tuple: bool) -> str:
    """Why a model may have failed on its example: a list of args is its only argument."""
    if example_was_tuple:
        return ""
    return (
        f" ({target}() returned example_args that is not a tuple: it was passed as the "
        "model's only argument; return a tuple for several, remat.Inputs(*args, **kwargs) "
        "for keyword inputs)"
    )


def model_failure(
    e: Exception, doing: str, target: str | None, example_was_tuple: bool
) -> RunError:
    """The :class:`RunError` for ``e``, raised while ``doing`` (``"profiling"``) the user's
    model (``target``; ``None``: the built-in one): remat's own message as it is (it says what
    to change; the API's ``check_fn`` named as the flag), else what raised, with
    :func:`factory_hint`."""
    if isinstance(e, PlanError) or str(e).startswith("remat."):
        return RunError(for_the_shell(str(e)))
    return RunError(
        f"{doing} {target or 'the built-in'}'s model raised {describe(e)}"
        + factory_hint(target or "", example_was_tuple)
    )
