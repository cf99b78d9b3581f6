"""``remat.verify``: does checkpointing change anything? One step with it, one without."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from .. import memory
from ..engine.bytes import fmt_bytes, storage_bytes
from ..engine.config import disable_checkpointing
from ..engine.tree import replace_tensors, tensors_in
from ..modules.modelinfo import (
    check_not_meta,
    counted_device,
    default_blocks,
    default_loss,
    device_of,
    graph_leaves,
    rng_state,
    set_rng_state,
)
from .diagnose import Diagnostic, diagnose_step
from .probe import StepProbe


@dataclasses.dataclass
class Difference:
    """One gradient, buffer or loss that differs between the two runs.

    Attributes:
        kind: ``"grad"``, ``"buffer"`` or ``"loss"``.
        name: parameter or buffer name (``"loss"`` for the loss).
        max_abs: largest absolute difference (``inf`` when one side is missing
            or shapes differ).
    """

    kind: str
    name: str
    max_abs: float


@dataclasses.dataclass
class Report:
    """What :func:`verify` found.

    Attributes:
        differences: everything that is not bitwise equal.
        compared: how many gradients, buffers and losses were compared.
        loss_checkpointed / loss_plain: the two losses.
        peak_bytes_checkpointed / peak_bytes_plain: what each step allocates at its
            peak above its start (forward, loss and backward: :mod:`remat.memory`).
        static_bytes: the parameters, buffers and inputs the steps start with (on the
            model's device); ``step_peak_checkpointed`` / ``step_peak_plain`` add them: the
            step peak as a budget counts it (:func:`remat.measure_peak` without an optimizer).
        diagnostics: boundary warnings about the model's checkpoints (a checkpoint that
            frees almost nothing, checkpointing that raises the peak, checkpoints nested
            twice, a loss head that dominates the peak), as :func:`remat.explain` gives.
            They do not make ``ok`` false: gradients can be right and memory not saved.
    """

    differences: list[Difference]
    compared: int
    loss_checkpointed: float
    loss_plain: float
    peak_bytes_checkpointed: int
    peak_bytes_plain: int
    diagnostics: list[Diagnostic] = dataclasses.field(default_factory=list)
    static_bytes: int = 0

    @property
    def step_peak_checkpointed(self) -> int:
        """The checkpointed step's peak in a budget's units: static bytes included."""
        return self.static_bytes + self.peak_bytes_checkpointed

    @property
    def step_peak_plain(self) -> int:
        """The plain step's peak in a budget's units: static bytes included."""
        return self.static_bytes + self.peak_bytes_plain

    @property
    def ok(self) -> bool:
        """True when every gradient, buffer and the loss are bitwise equal."""
        return not self.differences

    def __str__(self) -> str:
        head = (
            f"remat.verify: {'OK' if self.ok else 'DIFFERENCES FOUND'} "
            f"({self.compared} tensors compared)\n"
            f"  loss        checkpointed {self.loss_checkpointed:.6g}   plain {self.loss_plain:.6g}\n"
            f"  step peak   checkpointed {fmt_bytes(self.step_peak_checkpointed)}   "
            f"plain {fmt_bytes(self.step_peak_plain)}   (parameters, buffers and inputs "
            f"{fmt_bytes(self.static_bytes)} + what forward, loss and backward allocate: "
            "remat.measure_peak's step without an optimizer)"
        )
        warnings = "".join(f"\n{d}" for d in self.diagnostics)
        if self.ok:
            return head + warnings
        w = max(len(d.name) for d in self.differences)
        rows = [f"  {'kind':<7}{'name':<{w}}  max |diff|"]
        rows += [f"  {d.kind:<7}{d.name:<{w}}  {d.max_abs:.3e}" for d in self.differences]
        return head + "\n" + "\n".join(rows) + warnings


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    """None when equal (``torch.equal``, NaNs at the same places equal), else the max abs difference.

    A NaN on one side only counts as an infinite difference.
    """
    if a is None and b is None:
        return None
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    if torch.equal(a, b):
        return None
    if not (a.is_floating_point() or a.is_complex()):
        return float((a.double() - b.double()).abs().max())
    nan_a, nan_b = a.isnan(), b.isnan()
    if not torch.equal(nan_a, nan_b):
        return float("inf")
    if nan_a.any():
        a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
        if torch.equal(a, b):
            return None
    return float((a - b).abs().max())


def _same_loss(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _as_leaves(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``(args, kwargs)`` with every non-leaf input that requires grad detached into a leaf.

    The graph that produced such an input is not part of the model: a
    backward into it would fail the second time (its saved tensors are
    freed) and would leave gradients on tensors ``verify`` does not know.
    """
    found: list[torch.Tensor] = []
    tensors_in((args, kwargs), found)
    if all(t.is_leaf or not t.requires_grad for t in found):
        return args, kwargs
    new = [t if t.is_leaf or not t.requires_grad else t.detach().requires_grad_() for t in found]
    return replace_tensors((args, kwargs), new, [0])


def _input_leaves(args: Any, kwargs: Any) -> dict[str, torch.Tensor]:
    """Leaf tensors among the inputs that require grad: backward writes their ``.grad``."""
    found: list[torch.Tensor] = []
    tensors_in((args, kwargs), found)
    return {f"input[{i}]": t for i, t in enumerate(found) if t.is_leaf and t.requires_grad}


def _step(
    model: torch.nn.Module,
    args: Any,
    kwargs: Any,
    loss_fn: Callable[[Any], Any] | None,
    inputs: dict[str, torch.Tensor],
    probe: StepProbe | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor], float, int]:
    for p in model.parameters():
        p.grad = None
    for x in inputs.values():
        x.grad = None
    with memory.track() as t, probe if probe is not None else nullcontext():
        out = model(*args, **kwargs)
        if probe is not None:
            probe.stage("(loss)")
        loss = loss_fn(out) if loss_fn is not None else default_loss(out)
        # leaves outside the model and the inputs (a loss_fn's own parameter):
        # their .grad is put back after the backward, not compared
        known = {id(p) for _, p in model.named_parameters()} | {id(x) for x in inputs.values()}
        others = [x for x in graph_leaves(loss) if id(x) not in known] if loss.grad_fn else []
        others_grad = [x.grad for x in others]
        try:
            loss.backward()
        finally:
            for x, g in zip(others, others_grad):
                x.grad = g
        del out
    leaves = [*model.named_parameters(), *inputs.items()]
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in leaves}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return grads, buffers, float(loss.detach()), t.peak_bytes


def _buffer_owners(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified buffer name, module holding it)`` for every buffer slot."""
    return [
        (f"{prefix}.{k}" if prefix else k, m)
        for prefix, m in model.named_modules()
        for k in m._buffers
    ]


def verify(
    model: torch.nn.Module,
    *args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> Report:
    """Run one step with the model's checkpointing and one without; report what differs.

    Both steps start from the same RNG state (CPU, and every CUDA device when
    CUDA is in use), the same buffer values and no gradients. An input that
    requires grad but is not a leaf is detached into a leaf: the graph that
    made it is not run. Afterwards ``verify`` leaves no trace: the ``.grad``
    of every parameter, of every leaf input that requires grad and of any
    other leaf the loss reaches (a parameter of ``loss_fn``) is the tensor it
    was before, each buffer is
    the same tensor object with its old values (put back in its module if the
    forward replaced it), and the RNG state is as it was. Parameters and the
    training mode are not changed by a step and are left alone.

    Compared, bitwise (``torch.equal``; NaNs at the same places are equal):
    the loss, every parameter's gradient, the gradient of every input that
    requires grad (named ``input[i]``, numbered over the tensors in ``args``
    then ``kwargs``), and every buffer after the step (BatchNorm statistics,
    counters). Peak memory is measured
    with :func:`remat.memory.track` around forward, loss and backward, and printed as the
    step peak a budget counts (parameters, buffers and inputs added). The
    checkpointed step is also watched for boundary problems (``diagnostics``,
    printed with the report; see :func:`remat.explain`).

    Args:
        model: a model whose blocks use :func:`remat.checkpoint`, wrappers or a plan.
        *args: its inputs.
        loss_fn: turns the output into a scalar loss; default: the sum, in
            float32, of the sums of every floating tensor in the output
            (nested in tuples, lists, dicts, dataclasses) that requires grad.
        **kwargs: keyword inputs of the model.

    Returns:
        A :class:`Report`; ``report.ok`` is True when everything is bitwise equal.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: no ``loss_fn`` and no output tensor requires grad.

    Example:
        >>> import torch, remat
        >>> lin = torch.nn.Linear(8, 8)
        >>> class M(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = lin
        ...     def forward(self, x):
        ...         return remat.checkpoint(self.lin, x).relu()
        >>> remat.verify(M(), torch.randn(4, 8)).ok
        True
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"remat.verify: model must be an nn.Module, got {type(model).__name__}.")
    check_not_meta(
        model, (args, kwargs), "remat.verify",
        "; a plan made on the meta device applies to the materialized model",
    )  # fmt: skip
    rng = rng_state()
    args, kwargs = _as_leaves(args, kwargs)
    inputs = _input_leaves(args, kwargs)
    old_grads = {n: p.grad for n, p in [*model.named_parameters(), *inputs.items()]}
    owners = {n: (m, n.rpartition(".")[2]) for n, m in _buffer_owners(model)}
    old_buffers = {n: m._buffers[k] for n, (m, k) in owners.items()}
    old_values = {n: b.clone() for n, b in old_buffers.items() if b is not None}

    def restore_buffers() -> None:
        with torch.no_grad():
            for n, (m, k) in owners.items():
                m._buffers[k] = old_buffers[n]
                buf = old_buffers[n]
                if buf is not None:
                    buf.copy_(old_values[n])

    probe = StepProbe(model, default_blocks(model), f"<{type(model).__name__}>")
    try:
        set_rng_state(rng)
        g1, b1, l1, p1 = _step(model, args, kwargs, loss_fn, inputs, probe)
        restore_buffers()
        set_rng_state(rng)
        with disable_checkpointing():
            g2, b2, l2, p2 = _step(model, args, kwargs, loss_fn, inputs)
    finally:
        set_rng_state(rng)
        for n, p in [*model.named_parameters(), *inputs.items()]:
            p.grad = old_grads[n]
        restore_buffers()
    diffs = []
    for n in g1:
        d = _diff(g1[n], g2.get(n))
        if d is not None:
            diffs.append(Difference("grad", n, d))
    for n in b1:
        d = _diff(b1[n], b2.get(n))
        if d is not None:
            diffs.append(Difference("buffer", n, d))
    if not _same_loss(l1, l2):
        d = float("inf") if math.isnan(l1) or math.isnan(l2) else abs(l1 - l2)
        diffs.append(Difference("loss", "loss", d))
    try:
        diagnostics = diagnose_step(probe, model, peak_bytes=p1, plain_peak=p2)
    finally:
        probe.close()
    found: list[torch.Tensor] = []
    tensors_in((args, kwargs), found)
    device = counted_device(device_of(model, (args, kwargs)))
    static = storage_bytes([*model.parameters(), *model.buffers(), *found], device)
    return Report(diffs, len(g1) + len(b1) + 1, l1, l2, p1, p2, diagnostics, static)
