"""The reentrant variant (``use_reentrant=True``): an ``autograd.Function``.

Forward runs the function under ``no_grad`` and keeps only its tensor
arguments; backward re-runs it with grad enabled on detached copies of them
and calls ``torch.autograd.backward`` on the recomputed outputs (a reentrant
backward, hence the name). It follows torch's semantics and restrictions:
keyword arguments are rejected, ``torch.autograd.grad`` and
``backward(inputs=...)`` raise, and tensors nested in containers get no
gradient.

One deliberate difference: when no tensor argument requires grad (frozen
embeddings feeding a trainable block, LoRA), torch's outputs do not require
grad and the parameters inside silently get no gradient. remat adds a hidden
zero-size leaf that requires grad, so the outputs are part of the graph and
backward reaches the parameters. When nothing inside requires grad either,
the outputs still report ``requires_grad=True`` and backward returns no
gradients. A region whose inputs require grad only through such anchors (it reads
a frozen region's output) does not raise torch's "checkpoint() is not necessary"
error when it turns out not to use them: torch's inputs would not require grad.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from . import config, observe
from .state import ForwardState, generators_in

_BACKWARD_INPUTS_MSG = (
    "remat.checkpoint: When use_reentrant=True, torch.utils.checkpoint is incompatible with "
    ".grad() or passing an `inputs` parameter to .backward(), and so is remat.checkpoint: its "
    "backward runs a nested backward that cannot see which inputs you asked for. Pass "
    "use_reentrant=False (the default), or call .backward() without the inputs argument."
)


def detach_variable(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Detach each tensor in ``inputs``, keeping its ``requires_grad``; as torch's helper.

    Args:
        inputs: a tuple; entries that are not tensors are passed through.

    Example:
        >>> import torch, remat
        >>> x = torch.ones(2, requires_grad=True) * 2
        >>> (d,) = remat.detach_variable((x,))
        >>> d.requires_grad, d.grad_fn is None
        (True, True)
    """
    if not isinstance(inputs, tuple):
        raise RuntimeError(
            "detach_variable: Only tuple of tensors is supported. Got Unsupported input type: "
            f"{type(inputs).__name__}. Wrap the inputs in a tuple."
        )
    out = []
    for inp in inputs:
        if not isinstance(inp, torch.Tensor):
            out.append(inp)
            continue
        x = inp.detach()
        x.requires_grad = inp.requires_grad
        out.append(x)
    return tuple(out)


def check_backward_validity(inputs: Iterable[Any]) -> None:
    """Warn when no tensor in ``inputs`` requires grad, as torch's helper does.

    Example:
        >>> import torch, remat
        >>> remat.check_backward_validity([torch.ones(1, requires_grad=True)])
    """
    if not any(isinstance(i, torch.Tensor) and i.requires_grad for i in inputs):
        warnings.warn(
            "None of the inputs have requires_grad=True. Gradients will be None", stacklevel=2
        )


def _forward(
    ctx: Any,
    run_function: Callable[..., Any],
    preserve: bool,
    args: tuple[Any, ...],
    anchored: bool,
    params: tuple[Any, ...],
) -> Any:
    """Keep the tensor arguments and the forward's state, run ``run_function`` without grad."""
    ctx.run_function = run_function
    ctx.preserve_rng_state = preserve
    ctx.anchored = anchored
    ctx.n_params = len(params)
    ctx.params = params
    tensors = []
    ctx.tensor_indices = []
    ctx.inputs = []
    ctx.repeat = _repeats(args)  # a tensor passed twice is saved once
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            if i in ctx.repeat:
                ctx.inputs.append(None)
                continue
            tensors.append(arg)
            ctx.tensor_indices.append(i)
            ctx.inputs.append(None)
        else:
            ctx.inputs.append(arg)
    generators: list[torch.Generator] = []
    if preserve:
        generators_in(args, generators)
    ctx.state = ForwardState(tensors, preserve, generators)
    ctx.save_for_backward(*tensors)
    with config.entering_region(), torch.no_grad():
        return run_function(*args)


def _backward(ctx: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """Recompute and backpropagate; the gradients of the arguments, then of the params."""
    if not ctx.n_params and not torch.autograd._is_checkpoint_valid():
        raise RuntimeError(_BACKWARD_INPUTS_MSG)
    inputs = list(ctx.inputs)
    for idx, t in zip(ctx.tensor_indices, ctx.saved_tensors):
        inputs[idx] = t
    repeat = ctx.repeat
    for i, j in repeat.items():
        inputs[i] = inputs[j]
    token = ctx.state.enter()
    try:
        with config.recomputing_region():
            detached = detach_variable(tuple(inputs))
            # A tensor passed twice (attention's query, key and value) is one detached
            # object again, so code testing identity (``query is key``) takes its forward
            # path; its gradient goes out once, at its first position.
            if repeat:
                detached = tuple(detached[repeat.get(i, i)] for i in range(len(detached)))
            for x, d in zip(inputs, detached):
                if isinstance(d, torch.Tensor) and d.requires_grad:
                    d._remat_source = x  # type: ignore[attr-defined]  # see _reaches_leaf
            with torch.enable_grad():
                outputs = ctx.run_function(*detached)
    finally:
        ctx.state.exit(token)
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    outs, out_grads = [], []
    for o, g in zip(outputs, grads):
        if isinstance(o, torch.Tensor) and o.requires_grad:
            outs.append(o)
            out_grads.append(g)
    if not outs and not ctx.anchored and not ctx.n_params and _reaches_leaf(inputs):
        raise RuntimeError(
            "remat.checkpoint: none of output has requires_grad=True, this checkpoint() is not "
            "necessary: no output of the checkpointed function requires grad in recompute. "
            "Remove the checkpoint, or check that the function uses its inputs or parameters."
        )
    if ctx.n_params:
        # Known parameters: their gradients go out through the outer graph (so DDP and
        # friends see each parameter used once), not into .grad by a nested backward.
        wanted = [
            x
            for i, x in enumerate(detached)
            if isinstance(x, torch.Tensor) and x.requires_grad and i not in repeat
        ]
        wanted += [p for p in ctx.params if p.requires_grad]
        # Leaves the region reads but does not own (a weight tied to another module's):
        # they get their gradients from a nested backward, as without the parameters.
        foreign = _foreign_leaves(outs, wanted) if outs else []
        got = iter(
            torch.autograd.grad(
                outs, wanted, out_grads, allow_unused=True, retain_graph=bool(foreign)
            )
            if outs and wanted
            else [None] * len(wanted)
        )
        if foreign:
            torch.autograd.backward(outs, out_grads, inputs=foreign)
        input_grads = tuple(
            next(got)
            if isinstance(x, torch.Tensor) and x.requires_grad and i not in repeat
            else None
            for i, x in enumerate(detached)
        )
        param_grads = tuple(next(got) if p.requires_grad else None for p in ctx.params)
        return input_grads + param_grads
    if outs:
        torch.autograd.backward(outs, out_grads)
    return tuple(
        x.grad if isinstance(x, torch.Tensor) and i not in repeat else None
        for i, x in enumerate(detached)
    )


def _repeats(inputs: Sequence[Any]) -> dict[int, int]:
    """Positions of tensors seen at an earlier position -> that first position."""
    first: dict[int, int] = {}
    repeat: dict[int, int] = {}
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor):
            j = first.setdefault(id(x), i)
            if j != i:
                repeat[i] = j
    return repeat


class CheckpointFunction(torch.autograd.Function):
    """The reentrant checkpoint as an ``autograd.Function``, under torch's name and signature.

    ``CheckpointFunction.apply(run_function, preserve_rng_state, *args)`` runs
    ``run_function(*args)`` without grad and recomputes it in backward, exactly
    as ``torch.utils.checkpoint.CheckpointFunction`` does (same arguments, same
    warning when no argument requires grad, same errors), for code that calls
    or subclasses torch's class. ``ctx.run_function``, ``ctx.preserve_rng_state``,
    ``ctx.inputs`` and ``ctx.tensor_indices`` are set as in torch. Prefer
    ``remat.checkpoint(fn, *args, use_reentrant=True)``, which also gives the
    parameters inside gradients when no argument requires grad.

    Example:
        >>> import torch, remat
        >>> x = torch.randn(3, requires_grad=True)
        >>> remat.CheckpointFunction.apply(torch.sin, True, x).sum().backward()
        >>> torch.equal(x.grad, x.detach().cos())
        True
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any
    ) -> Any:
        check_backward_validity(args)
        return _forward(ctx, run_function, preserve_rng_state, args, False, ())

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (None, None) + _backward(ctx, grads)


class _ReentrantCheckpoint(torch.autograd.Function):
    """What ``checkpoint(use_reentrant=True)`` and the wrapper run: an anchor and known params."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        run_function: Callable[..., Any],
        preserve: bool,
        anchor: Any,
        n_params: int,
        *args_and_params: Any,
    ) -> Any:
        n_args = len(args_and_params) - n_params
        return _forward(
            ctx,
            run_function,
            preserve,
            args_and_params[:n_args],
            anchor is not None,
            args_and_params[n_args:],
        )

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return (None, None, None, None) + _backward(ctx, grads)


def _reaches_leaf(inputs: list[Any]) -> bool:
    """Whether a tensor in ``inputs`` requires grad through a leaf other than an anchor.

    An input whose graph reaches only anchors (it was computed from the outputs
    of a region over frozen inputs) requires grad in remat alone: in torch it
    does not, and torch does not raise "not necessary" for the region reading it.
    The detached inputs of an enclosing recompute lead back to their originals.
    Only called on that error path: it walks the graph upstream of the region.
    """
    todo: list[Any] = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    seen: set[Any] = set()
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            while getattr(item, "_remat_source", None) is not None:
                item = item._remat_source  # type: ignore[attr-defined]
            if item.grad_fn is not None:
                todo.append(item.grad_fn)
            elif not getattr(item, "_remat_anchor", False):
                return True
            continue
        if item in seen:
            continue
        seen.add(item)
        leaf = getattr(item, "variable", None)  # AccumulateGrad
        if leaf is not None:
            todo.append(leaf)
            continue
        todo.extend(nxt for nxt, _ in item.next_functions if nxt is not None)
    return False


def _foreign_leaves(outs: list[torch.Tensor], known: list[torch.Tensor]) -> list[torch.Tensor]:
    """Leaves requiring grad that the graph of ``outs`` reaches, other than ``known``."""
    known_ids = {id(t) for t in known}
    found: list[torch.Tensor] = []
    seen: set[Any] = set()
    stack = []
    for o in outs:
        if o.grad_fn is not None:
            stack.append(o.grad_fn)
        elif id(o) not in known_ids:
            found.append(o)  # a leaf returned as it is
            known_ids.add(id(o))
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad
        if leaf is not None:
            if id(leaf) not in known_ids:
                found.append(leaf)
                known_ids.add(id(leaf))
            continue
        stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return found


def run_reentrant(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    preserve_rng_state: bool,
    params: tuple[torch.Tensor, ...] = (),
) -> Any:
    """Run ``fn(*args)`` as a reentrant checkpointed region.

    ``params``: the parameters ``fn`` uses, when known (module wrappers). They
    become inputs of the region, their gradients leave backward through the
    outer graph, and ``torch.autograd.grad`` / ``backward(inputs=...)`` work.
    """
    anchor = None
    if not params and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        anchor = torch.empty(0, requires_grad=True)
        anchor._remat_anchor = True  # type: ignore[attr-defined]  # see _reaches_leaf
    obs = observe.current()
    if obs is None:
        return _ReentrantCheckpoint.apply(
            fn, preserve_rng_state, anchor, len(params), *args, *params
        )
    # observed (remat.explain): what apply saves when it returns is the region's inputs
    probe = obs.region_start("reentrant", fn)
    try:
        return _ReentrantCheckpoint.apply(
            fn, preserve_rng_state, anchor, len(params), *args, *params
        )
    finally:
        probe.inputs_kept()
        probe.forward_end()
