"""``remat.explain``: what does a training step keep for backward, and why?

One step is run twice from the same state: once with checkpointing disabled,
for its peak alone, then instrumented (:class:`remat.measure.probe.StepProbe`). At the
end of the instrumented forward (the loss computed, backward not started) every
tensor storage allocated during the step and still alive is listed with the
module and operator that made it, its shape, dtype, bytes and source line, and
why it is alive (:class:`~remat.measure.probe.Reason`). The rows add up to what
:func:`remat.memory.track` counts alive at that moment above what existed before
the step: a storage is one row however many tensors view it. Then backward runs
and the step's peak is located. The boundary diagnostics of
:mod:`remat.measure.diagnose` are computed from the same step.

JAX answers "what is saved?" with ``print_saved_residuals``; this is that for
PyTorch, checkpoints included.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from .. import memory
from ..engine.bytes import fmt_bytes
from ..engine.config import disable_checkpointing
from ..engine.tree import tensors_in
from ..modules.modelinfo import (
    BufferSnapshot,
    check_grad_enabled,
    check_not_meta,
    default_blocks,
    graph_leaves,
    loss_of,
    rng_state,
    set_rng_state,
)
from .diagnose import Diagnostic, diagnose_step
from .probe import StepProbe
from .records import UNKNOWN, Alloc, Reason, RegionStats

__all__ = ["Explanation", "KeptTensor", "Peak", "diagnose", "explain"]

#: Rows of the tensor table that ``str(explanation)`` shows (the largest; JSON has all).
TOP = 25


@dataclasses.dataclass(frozen=True)
class KeptTensor:
    """One storage alive at the end of forward.

    Attributes:
        module: the module that made it (``<Model>`` for the model's own code,
            ``(loss)`` for the loss computed from its output).
        op: the ATen operator that allocated it (``aten.addmm.default``).
        shape: its shape when allocated.
        dtype: its dtype (``None`` for the row of bytes explain did not see made).
        device: ``"cpu"``, ``"cuda:0"``, ...
        bytes: the storage's bytes.
        line: ``file.py:123``, the innermost source line outside torch and remat.
        reason: why it is alive (:class:`remat.explain` docstring).
        kept_by: who keeps it: the module that saved it, or the checkpoint whose input it is.
    """

    module: str
    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    device: str
    bytes: int
    line: str
    reason: Reason
    kept_by: str

    def to_dict(self) -> dict[str, Any]:
        """The JSON row: ``module``, ``op``, ``shape``, ``dtype``, ``bytes``, ``line``,
        ``reason`` and ``device``, ``kept_by``."""
        return {
            "module": self.module,
            "op": self.op,
            "shape": list(self.shape),
            "dtype": None if self.dtype is None else _dtype(self.dtype),
            "bytes": self.bytes,
            "line": self.line,
            "reason": self.reason.value,
            "device": self.device,
            "kept_by": self.kept_by,
        }


@dataclasses.dataclass(frozen=True)
class Peak:
    """Where the step's peak falls.

    Attributes:
        bytes: the step's peak (bytes alive allocated during the step, as
            :func:`remat.memory.track` counts them; forward, loss and backward).
        plain_bytes: the same step's peak under :func:`remat.disable_checkpointing`
            (remat's checkpoints and wrappers run plain; ``torch.utils.checkpoint`` calls
            in the model still checkpoint).
        phase: ``"forward"`` or ``"backward"``.
        module: the module running then (in backward: whose gradient was computed).
        op: the operator that reached it.
        line: its source line.
        recompute_of: the checkpoint being recomputed then, if any.
    """

    bytes: int
    plain_bytes: int
    phase: str
    module: str
    op: str
    line: str
    recompute_of: str | None

    def describe(self) -> str:
        """One line: how much, in which phase, where."""
        if self.recompute_of:
            where = f"recomputing {self.recompute_of}"
            if self.module != self.recompute_of:
                where += f" (in {self.module})"
        elif self.phase == "backward":
            where = f"gradient of {self.module}" if self.module != UNKNOWN else "no known module"
        else:
            where = self.module
        at = f"{_op(self.op)} at {self.line}" if self.line else _op(self.op)
        return (
            f"{fmt_bytes(self.bytes)} in {self.phase}, {where}: {at} "
            f"(without checkpointing: {fmt_bytes(self.plain_bytes)})"
        )


@dataclasses.dataclass
class Explanation:
    """What :func:`explain` found: every tensor alive at the end of forward, and why.

    Attributes:
        model: the model's class (or the function's) name.
        tensors: one row per storage alive at the end of forward, in allocation order.
        total_bytes: the bytes :func:`remat.memory.track` counts alive at the end of
            forward above what existed before the step; the rows add up to it.
        peak: where the step's peak falls, and the peak without checkpointing.
        regions: each checkpoint (by the module it covers): calls, inputs kept, bytes dropped.
        diagnostics: boundary warnings (:mod:`remat.measure.diagnose`), each naming the module
            and what to do.
        blocks: the model's repeated blocks (per-module totals are shown per block).
        compiled: the modules whose forward is compiled (``torch.compile``: a compiled
            plan's blocks, ``module.compile()``): they ran eagerly in the steps explained
            (torch.compile runs frames eagerly while a dispatch mode is active, and the
            tracker is one), so their rows are eager's; the table says so.
    """

    model: str
    tensors: list[KeptTensor]
    total_bytes: int
    peak: Peak
    regions: list[RegionStats]
    diagnostics: list[Diagnostic]
    blocks: tuple[str, ...] = ()
    compiled: tuple[str, ...] = ()

    @property
    def by_reason(self) -> dict[Reason, int]:
        """Bytes per reason, largest first."""
        out: dict[Reason, int] = {}
        for t in self.tensors:
            out[t.reason] = out.get(t.reason, 0) + t.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def by_module(self) -> dict[str, int]:
        """Bytes per module that made them (full names), largest first."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.module] = out.get(t.module, 0) + t.bytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def _group(self, module: str) -> str:
        for b in self.blocks:
            if module == b or module.startswith(b + "."):
                return b
        return module

    def table(self, top: int | None = TOP) -> str:
        """The report as text; ``top``: how many tensor rows (the largest), ``None`` for all."""
        n = len(self.tensors)
        lines = [
            f"remat explain: {self.model}: one training step",
            "",
            f"Alive at the end of forward: {fmt_bytes(self.total_bytes)} in {n} "
            f"tensor{'s' if n != 1 else ''} (allocated during the step; "
            f"{self.total_bytes:,} bytes)",
        ]
        lines += ["", "  by reason"]
        count: dict[Reason, int] = {}
        for t in self.tensors:
            count[t.reason] = count.get(t.reason, 0) + 1
        for reason, b in self.by_reason.items():
            lines.append(f"    {reason.value:<18}{fmt_bytes(b):>11}  {_n(count[reason])}")
        groups: dict[str, list[int]] = {}
        for t in self.tensors:
            sums = groups.setdefault(self._group(t.module), [0, 0])
            sums[0] += t.bytes
            sums[1] += 1
        width = max([len(name) for name in groups] + [16])
        lines += ["", "  by module" + (" (a block with its submodules)" if self.blocks else "")]
        for name, (b, c) in groups.items():  # in the order they ran
            share = 100 * b / self.total_bytes if self.total_bytes else 0.0
            lines.append(f"    {name:<{width}}  {fmt_bytes(b):>11}  {share:5.1f}%  {_n(c)}")
        rows = sorted(self.tensors, key=lambda t: -t.bytes)
        shown = rows if top is None else rows[:top]
        if shown:
            title = "  tensors"
            if len(shown) < n:
                title += f" (the {len(shown)} largest of {n}; --all or --json FILE for every one)"
            lines += ["", title]
            lines += _tensor_rows(shown)
        lines += ["", f"Peak of the step: {self.peak.describe()}"]
        lines.append(
            "  (what the step allocates above its start; a budget's step peak also counts the "
            "parameters, buffers and inputs it starts with: remat.measure_peak)"
        )
        if self.regions:
            lines += ["", "  checkpoints"]
            w = max(len(r.label) for r in self.regions)
            for r in self.regions:
                dropped = "?" if r.dropped_bytes < 0 else fmt_bytes(r.dropped_bytes)
                lines.append(
                    f"    {r.label:<{w}}  {r.kind:<10} {r.calls:>3} call{'s' if r.calls != 1 else ' '}"
                    f"  keeps {fmt_bytes(r.input_bytes):>10} of inputs, drops {dropped:>10}"
                )
        if self.diagnostics:
            lines += [""]
            lines += [str(d) for d in self.diagnostics]
        else:
            lines += ["", "No boundary warnings."]
        if self.compiled:
            lines += [
                "",
                f"Compiled: {_span_text(self.compiled)} ran eagerly here (torch.compile runs "
                "eagerly under the tracker, a dispatch mode): these rows are eager's. "
                "remat.measure_peak measures a compiled plan's blocks at the allocator.",
            ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain values: ``tensors``, ``total_bytes``, ``by_module``,
        ``by_reason``, ``peak``, ``regions``, ``diagnostics``."""
        return {
            "model": self.model,
            "tensors": [t.to_dict() for t in self.tensors],
            "total_bytes": self.total_bytes,
            "by_module": self.by_module,
            "by_reason": {r.value: b for r, b in self.by_reason.items()},
            "peak": dataclasses.asdict(self.peak),
            "regions": [dataclasses.asdict(r) for r in self.regions],
            "diagnostics": [d.to_dict() for d in self.diagnostics],
        }

    def to_json(self, indent: int | None = 1) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)


def _compiled_modules(model: nn.Module | None) -> tuple[str, ...]:
    """The names of ``model``'s modules whose forward is compiled: a compiled plan's
    (an instance ``forward`` marked ``remat_compiled``) or ``module.compile()``'s."""
    if model is None:
        return ()
    return tuple(
        n
        for n, m in model.named_modules()
        if getattr(m.__dict__.get("forward"), "remat_compiled", False)
        or getattr(m, "_compiled_call_impl", None) is not None
    )


def _span_text(names: tuple[str, ...]) -> str:
    """``names`` for a line of text: the first and last of many."""
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]} ({len(names)})"


def _n(count: int) -> str:
    return f"{count:>5} tensor" + ("s" if count != 1 else "")


def _dtype(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _op(op: str) -> str:
    """``aten.addmm.default`` -> ``addmm``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else op


def _reason_text(t: KeptTensor) -> str:
    if t.reason is Reason.REGION_INPUT:
        return f"input of {t.kept_by}"
    if t.reason is Reason.SELECTIVE:
        return f"selective save in {t.kept_by}"
    return t.reason.value


def _tensor_rows(rows: list[KeptTensor]) -> list[str]:
    cells = [
        (
            t.module,
            _op(t.op),
            "x".join(str(d) for d in t.shape) or "scalar",
            "?" if t.dtype is None else _dtype(t.dtype),
            fmt_bytes(t.bytes),
            t.line or "-",
            _reason_text(t),
        )
        for t in rows
    ]
    head = ("module", "op", "shape", "dtype", "bytes", "line", "why kept")
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]
    out = []
    for c in [head, *cells]:
        parts = [
            c[i].rjust(widths[i]) if i == 4 else c[i].ljust(widths[i]) for i in range(len(c) - 1)
        ]
        out.append("    " + "  ".join(parts) + "  " + c[-1])
    return out


def _kept(probe: StepProbe, outputs: list[torch.Tensor], total: int) -> list[KeptTensor]:
    for t in outputs:
        a = probe.alloc_of(t)
        if a is not None:
            a.because(Reason.OUTPUT, "the caller")
    rows = [_row(a) for a in probe.alive()]
    missing = total - sum(r.bytes for r in rows)
    if missing:  # storages explain did not see made (sparse, tensor subclasses)
        rows.append(
            KeptTensor("", "", (), None, "", missing, "", Reason.OTHER, "not seen by explain")
        )
    return rows


def _row(a: Alloc) -> KeptTensor:
    reason, keeper = a.primary() if a.reasons else (Reason.OTHER, "")
    return KeptTensor(a.module, a.op, a.shape, a.dtype, a.device, a.nbytes, a.line, reason, keeper)


class _Step:
    """Runs the step (forward, loss, backward) the same way each time and leaves no trace:
    gradients, buffers and the RNG are put back as they were."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        loss_fn: Callable[[Any], torch.Tensor] | None,
        model: nn.Module | None,
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.loss_fn = loss_fn
        self.rng = rng_state()
        self.buffers = BufferSnapshot(model) if model is not None else None

    def run(self, probe: StepProbe | None) -> tuple[int, int, list[KeptTensor]]:
        """One step: (its peak, bytes alive at the end of forward, the rows when probed)."""
        set_rng_state(self.rng)
        kept: list[KeptTensor] = []
        with memory.track() as tracker, probe if probe is not None else nullcontext():
            out = self.fn(*self.args, **self.kwargs)
            if probe is not None:
                probe.stage("(loss)")
            loss = loss_of(out, self.loss_fn, "remat.explain")
            forward_bytes = tracker.current_bytes
            if probe is not None:
                outputs: list[torch.Tensor] = []
                tensors_in(out, outputs)
                kept = _kept(probe, [*outputs, loss], forward_bytes)
            # the caller's loop holds the output (its logits) through backward: so does this
            leaves = graph_leaves(loss) if loss.grad_fn is not None else []
            old = [x.grad for x in leaves]
            for x in leaves:
                x.grad = None
            try:
                loss.backward()
            finally:
                for x, g in zip(leaves, old):
                    x.grad = g
            del out, loss
        return tracker.peak_bytes, forward_bytes, kept

    def restore(self) -> None:
        if self.buffers is not None:
            self.buffers.restore()
        set_rng_state(self.rng)


def _name(model_or_fn: Any) -> str:
    if isinstance(model_or_fn, nn.Module):
        return type(model_or_fn).__name__
    return getattr(model_or_fn, "__name__", None) or type(model_or_fn).__name__


#: what plans a model on the meta device, said when explain is given one
_META_INSTEAD = (
    "; to plan a model on the meta device from its shapes, call remat.profile or "
    "remat.auto_checkpoint with meta inputs (the plan's table says where its peak falls)"
)


def _run(
    model_or_fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    where: str,
) -> Explanation:
    if not callable(model_or_fn):
        raise TypeError(
            f"{where}: model_or_fn must be an nn.Module or a function, got "
            f"{type(model_or_fn).__name__}. Pass the model first and its inputs after it: "
            f"{where}(model, *inputs)."
        )
    check_grad_enabled(where)
    model = model_or_fn if isinstance(model_or_fn, nn.Module) else None
    check_not_meta(model, (args, kwargs), where, _META_INSTEAD)
    name = _name(model_or_fn)
    blocks = default_blocks(model) if model is not None else []
    step = _Step(model_or_fn, args, kwargs, loss_fn, model)
    probe = StepProbe(model, blocks, f"<{name}>")
    try:
        with disable_checkpointing():
            plain_peak, _, _ = step.run(None)
        step.restore()
        peak, forward_bytes, kept = step.run(probe)
    finally:
        step.restore()
    try:
        p = probe.peak
        diagnostics = diagnose_step(probe, model, peak_bytes=peak, plain_peak=plain_peak)
        return Explanation(
            model=name,
            tensors=kept,
            total_bytes=forward_bytes,
            peak=Peak(
                peak,
                plain_peak,
                "backward" if p.backward else "forward",
                p.module,
                p.op,
                p.line,
                p.recompute_of,
            ),
            regions=probe.region_stats(),
            diagnostics=diagnostics,
            blocks=tuple(blocks),
            compiled=_compiled_modules(model),
        )
    finally:
        probe.close()


def explain(
    model_or_fn: Callable[..., Any],
    *args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> Explanation:
    """Run one training step and report every tensor kept for backward, and why.

    The step is ``out = model_or_fn(*args, **kwargs)``, the loss (``loss_fn(out)``,
    else the model's own ``loss``, else the sum of its floating outputs), and
    backward. At the end of forward (loss computed, backward not started), every
    tensor storage allocated during the step and still alive is one row: the
    module that made it, the operator, shape, dtype, bytes, source line and why
    it is alive:

    * ``not checkpointed``: autograd saved it for backward outside any checkpoint;
    * ``region input``: a checkpoint keeps it to recompute from (remat's or torch's);
    * ``selective save``: a selective-checkpointing policy saved it;
    * ``offloaded``: kept in host memory until backward (on CPU: kept as it is);
    * ``output``: the forward returned it (the loss, the logits);
    * ``other``: held by a Python reference (a cache, a module attribute).

    The rows add up to the bytes :func:`remat.memory.track` counts alive then
    (``total_bytes``). Then backward runs and the step's peak is located (phase,
    module, operator, line, the checkpoint being recomputed), next to the peak of
    the same step with checkpointing disabled. Boundary diagnostics name the
    module and the fix: a checkpoint that frees almost nothing, checkpointing that
    raises the peak, checkpoints nested twice over a module (Hugging Face's own
    gradient checkpointing left on under remat's), a loss head whose peak no
    checkpoint can lower.

    Both steps start from the same RNG state and buffer values; afterwards every
    gradient, buffer and the RNG are as they were.

    Args:
        model_or_fn: a model, or a function of the inputs (its modules are named
            by their class).
        *args: the inputs.
        loss_fn: turns the output into a scalar loss.
        **kwargs: keyword inputs of the model.

    Returns:
        An :class:`Explanation`: prints as a table, ``.to_json()``.

    Raises:
        TypeError: ``model_or_fn`` is not callable.
        RuntimeError: called under ``torch.no_grad()``.
        ValueError: no ``loss_fn`` and no output requires grad.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        >>> report = remat.explain(model, torch.randn(4, 8))
        >>> [(t.module, t.reason.value) for t in report.tensors if t.bytes == 4 * 32 * 4]
        [('0', 'not checkpointed'), ('1', 'not checkpointed')]
        >>> report.total_bytes == sum(t.bytes for t in report.tensors)
        True
    """
    return _run(model_or_fn, args, kwargs, loss_fn, "remat.explain")


def diagnose(
    model_or_fn: Callable[..., Any],
    *args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **kwargs: Any,
) -> list[Diagnostic]:
    """The boundary diagnostics of :func:`explain` alone (the same two steps).

    For callers that show them next to something else (the planner's table).

    Example:
        >>> import torch, remat
        >>> from remat.measure.explain import diagnose
        >>> lin = torch.nn.Linear(8, 8)
        >>> fn = lambda x: remat.checkpoint(lin, x * 2).sum()  # keeps the input lin saves
        >>> [d.kind.value for d in diagnose(fn, torch.randn(4, 8, requires_grad=True))]
        ['frees almost nothing']
    """
    return _run(model_or_fn, args, kwargs, loss_fn, "remat diagnose").diagnostics
