"""Counted work: each operator a block's forward runs, with its FLOPs and the bytes it moves.

One forward of the model without gradients records every candidate block's inputs; each
block then runs alone, on those inputs and under the state the model called it under
(autocast, default dtype), inside the planner's ``selective`` dispatch mode and a counting
dispatch mode. Every ATen call is one :class:`OpCount`: its FLOPs (torch's formulas,
``torch.utils.flop_counter``: matmuls, convolutions, attention; 0 for the rest), the bytes
of its tensor arguments and results (0 for a view, which moves nothing), and whether the
selective policy serves it from its cache (``saved``) or recomputes it.

Everything here is a function of the model's structure and the inputs' shapes and dtypes:
the same model and inputs give the same counts in any process, on any machine. The cost
model (:func:`remat.planner.timing.modelled_costs`) turns them into seconds with the
device's calibrated constants (:mod:`remat.planner.calibration`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine.bytes import dense_bytes
from ..engine.selective import RECOMPUTE_ENTRY, create_selective_checkpoint_contexts
from ..engine.state import ForwardState
from ..engine.tree import tensors_in
from ..policies import save_matmuls

#: The kinds of operator call the calibration prices at rates of their own (:class:`OpCount`).
OpKind = Literal["mm", "conv", "random", "norm", "other"]


@dataclasses.dataclass(frozen=True)
class OpCount:
    """One operator call: ``kind`` is ``"mm"`` (matmul-like, attention), ``"conv"``
    (convolution), ``"random"`` (draws random numbers: dropout), ``"norm"`` (batch norm, which
    computes the batch's statistics) or ``"other"``; ``dtype`` the dtype of its first floating tensor
    argument (``None`` without one); ``saved`` whether the ``selective`` decision's cache
    serves it in recompute."""

    op: str
    kind: OpKind
    dtype: torch.dtype | None
    flops: float
    bytes: int
    saved: bool = False


def count_blocks(
    model: nn.Module, blocks: dict[str, nn.Module], args: Any, kwargs: Any
) -> tuple[list[OpCount], dict[str, list[OpCount]]]:
    """The operators of one whole forward of ``model`` (without gradients), and of each block's
    forward run alone under the selective policy (``saved`` marked)."""
    inputs: dict[str, Any] = {}
    handles = [
        m.register_forward_pre_hook(_InputGrab(n, inputs), with_kwargs=True)
        for n, m in blocks.items()
    ]
    whole = _Counter()
    try:
        with torch.no_grad(), quiet(), whole:  # one forward records every block's inputs
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    out: dict[str, list[OpCount]] = {}
    for n, m in blocks.items():
        save_mode, _ = create_selective_checkpoint_contexts(save_matmuls(prefer=True))
        counter = _Counter()
        block_args, block_kwargs, state = inputs[n]
        token = state.enter()  # the autocast (dtype, device) state the model called it under
        try:
            with torch.no_grad(), quiet(), save_mode, counter:  # the counter sees calls first
                m(*block_args, **block_kwargs)
        finally:
            state.exit(token)
        entries = save_mode.store.entries  # type: ignore[attr-defined]
        out[n] = [
            dataclasses.replace(c, saved=_entry(entries, func, i) is not RECOMPUTE_ENTRY)
            for c, func, i in counter.calls
        ]
    return whole.counts(), out


def count_call(fn: Callable[[], Any]) -> list[OpCount]:
    """The operators ``fn()`` runs (as it runs them: with gradients if enabled)."""
    counter = _Counter()
    with counter:
        fn()
    return counter.counts()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Warnings silenced: a model that checkpoints inside with torch's reentrant variant warns
    that no input requires grad, true in these forwards without gradients and not the
    user's concern."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _entry(entries: dict[Any, list[Any]], func: Any, i: int) -> Any:
    calls = entries.get(func, [])
    return calls[i] if i < len(calls) else RECOMPUTE_ENTRY


def _tensor_bytes(tree: Any) -> tuple[int, torch.dtype | None]:
    found: list[torch.Tensor] = []
    tensors_in(tree, found)
    dtype = next((t.dtype for t in found if t.is_floating_point()), None)
    return sum(dense_bytes(t) for t in found), dtype


#: Operators that draw random numbers (dropout's mask): several times slower per byte than
#: other pointwise operators, so priced at their own rate.
RANDOM = ("bernoulli", "uniform", "normal", "rand", "dropout", "multinomial", "exponential")


#: The operator classes the cost model is checked over (``benchmarks/cost_model.py``), finer
#: than :attr:`OpCount.kind` (which picks the calibrated rate).
CLASSES = ("matmul", "attention", "convolution", "normalisation", "pointwise", "random", "copy")

_COPIES = ("copy", "clone", "cat", "stack", "index", "embedding", "gather", "scatter", "pad")


def op_class(c: OpCount) -> str:
    """The class of one counted call (one of :data:`CLASSES`), by its kind and ATen name.

    Example:
        >>> op_class(OpCount("aten._scaled_dot_product_flash_attention_for_cpu.default",
        ...                  "mm", None, 1.0, 8))
        'attention'
        >>> op_class(OpCount("aten.native_layer_norm.default", "other", None, 0.0, 8))
        'normalisation'
        >>> op_class(OpCount("aten.cat.default", "other", None, 0.0, 8))
        'copy'
    """
    name = c.op.split(".")[1] if c.op.count(".") >= 1 else c.op
    if "attention" in name:
        return "attention"
    if c.kind == "conv":
        return "convolution"
    if c.kind == "mm":
        return "matmul"
    if c.kind == "random":
        return "random"
    if c.kind == "norm" or "norm" in name:
        return "normalisation"
    if any(k in name for k in _COPIES):
        return "copy"
    return "pointwise"


def _kind(func: Any, flops: float) -> OpKind:
    name = func.overloadpacket.__name__
    if flops <= 0:
        if "batch_norm" in name:  # the batch's statistics: dearer per byte than pointwise
            return "norm"
        return "random" if any(r in name for r in RANDOM) else "other"
    return "conv" if "conv" in name else "mm"


def _cpu_flash_attention_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    """FLOPs of CPU's fused attention, which ``torch.utils.flop_counter`` does not register
    for the CPU kernel (counted as 0 it was priced as a pointwise call by its bytes: 16x cheap
    on a Llama block, ``docs/BENCHMARKS.md``): its two batched matmuls, ``2 * B * H * Tq * Tk
    * (D + Dv)`` over the query's heads (key and value may have fewer: grouped-query attention,
    which torch 2.11's own formula refuses)."""
    b, h, tq, d = query.shape  # the CPU kernel takes (batch, heads, length, dim)
    tk, dv = key.shape[-2], value.shape[-1]
    return int(2 * b * h * tq * tk * (d + dv))


def _extra_flops() -> dict[Any, Callable[..., int]]:
    """FLOP formulas for operators ``torch.utils.flop_counter`` leaves out."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return {} if op is None else {op: _cpu_flash_attention_flops}


class _Counter(TorchDispatchMode):
    """Each operator call as ``(OpCount, op, index among the calls of that op)``."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import flop_registry

        super().__init__()
        self.registry = {**flop_registry, **_extra_flops()}
        self.calls: list[tuple[OpCount, Any, int]] = []
        self.seen: dict[Any, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        i = self.seen.get(func, 0)
        self.seen[func] = i + 1
        count = self.registry.get(func.overloadpacket)
        flops = float(count(*args, **kwargs, out_val=out)) if count is not None else 0.0
        moved, dtype = _tensor_bytes((args, kwargs))
        if getattr(func, "is_view", False):
            moved = 0
        else:
            moved += _tensor_bytes(out)[0]
        c = OpCount(str(func), _kind(func, flops), dtype, flops, moved)
        self.calls.append((c, func, i))
        return out

    def counts(self) -> list[OpCount]:
        return [c for c, _, _ in self.calls]


class _InputGrab:
    """Forward pre-hook (``with_kwargs=True``) that keeps a block's first inputs, keywords too,
    and the state the model called it under (autocast inside the model's forward, default
    dtype and device: :class:`~remat.engine.state.ForwardState`), to run the block alone as it ran."""

    def __init__(self, name: str, store: dict[str, Any]) -> None:
        self.name = name
        self.store = store

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        if self.name not in self.store:
            state = ForwardState([], preserve_rng_state=False)
            self.store[self.name] = (args, dict(kwargs), state)
