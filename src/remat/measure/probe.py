"""One training step under instrumentation: what is allocated where, what is kept and why.

:class:`StepProbe` is the observer of :mod:`remat.engine.observe` and gathers the
facts :func:`remat.explain` and the diagnostics (:mod:`remat.measure.diagnose`) read:

* **Allocations.** A dispatch mode sees every operator and records each new
  tensor storage (not the storage of one of the operator's inputs: views and
  in-place results are not new), with the operator, the module that ran it, its
  user source line (the innermost frame outside torch and remat's engine),
  shape, dtype and bytes, and the time it was allocated and freed (a weak
  reference to the storage, as :mod:`remat.memory` counts them). The probe's
  clock advances twice per operator, so that "alive at the peak" is exact.
* **Modules.** Global forward hooks keep the stack of modules running and
  count each module's calls in forward and in backward (recomputes).
* **Why a tensor is kept.** A saved-tensor hook under every other one sees
  what autograd keeps outside any checkpoint; the engine reports what its
  regions keep as inputs, what selective policies save and what goes to the
  host (:mod:`remat.engine.observe`). Torch's own checkpoint keeps its inputs the same
  way; its frames tell them apart.
* **Backward.** A function mode tags each autograd node made in forward with the
  module and line that made it, so that an allocation in backward is put on
  the module whose gradient it is; a recompute is put on its region.

Nothing here changes what the step computes: the hooks return the tensors
they are given, the modes call each operator once as it is.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..engine import observe
from ..engine.bytes import is_plain, storage_key
from ..engine.tree import tensors_in
from .records import UNKNOWN, Alloc, Nesting, PeakPoint, Reason, RegionStats, user_line

_TORCH_CHECKPOINT = os.path.abspath(torch.utils.checkpoint.__file__)
_graph_task = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node
_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_TAG = "remat.explain"  # key of the module/line tag in an autograd node's metadata
_LIFT_FRESH = torch.ops.aten.lift_fresh.default


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    __slots__ = ("alloc",)
    alloc: Alloc


class _Region:
    """One call of a region, as the probe sees it (implements :class:`~remat.engine.observe.RegionProbe`)."""

    __slots__ = ("probe", "label", "kind", "t0", "saved", "saved_old", "inputs", "open", "inside")

    def __init__(self, probe: StepProbe, label: str, kind: str) -> None:
        self.probe = probe
        self.label = label
        self.kind = kind
        self.t0 = probe.clock
        # by record, not by storage key: a dropped tensor dies in forward, and a later
        # one may get its storage's address
        self.saved: set[Alloc] = set()
        self.saved_old: set[Alloc] = set()
        self.inputs: set[Alloc] = set()
        self.open = True
        # started inside another region's forward: its inputs go to that region
        self.inside = bool(probe.active or probe.spans)

    def inputs_kept(self) -> None:
        if self.probe.pending is self:
            self.probe.pending = None

    def saw(self, x: torch.Tensor) -> None:
        a = self.probe.alloc_of(x)
        if a is None:
            return  # a parameter, or a tensor from before the step
        if a.born >= self.t0:
            self.saved.add(a)
        else:
            self.saved_old.add(a)

    def forward_end(self) -> None:
        if not self.open:
            return
        self.open = False
        probe = self.probe
        if probe.pending is self:
            probe.pending = None
        stack = probe.spans if self.kind == "span" else probe.active
        if self in stack:
            stack.remove(self)

    def recompute_start(self) -> None:
        self.probe.recomputing.append(self)
        self.probe.recomputes[self.label] = self.probe.recomputes.get(self.label, 0) + 1

    def recompute_end(self) -> None:
        stack = self.probe.recomputing
        if stack and stack[-1] is self:
            stack.pop()
        elif self in stack:
            stack.remove(self)


class _Recorder(TorchDispatchMode):
    """Records each new storage an operator returns (see the module docstring)."""

    def __init__(self, probe: StepProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        probe = self.probe
        probe.clock += 1
        out = func(*args, **kwargs)
        probe.clock += 1
        outs: list[torch.Tensor] = []
        if isinstance(out, torch.Tensor):
            outs.append(out)
        elif isinstance(out, (tuple, list)):
            tensors_in(out, outs)
        if outs:
            new = []
            inputs: set[int] | None = None
            for t in outs:
                if not is_plain(t) or t.is_meta:
                    continue
                st = t.untyped_storage()
                key = storage_key(st)
                known = probe.allocs.get(key)
                if known is not None and known.died is None:
                    continue
                if func is _LIFT_FRESH:
                    if not st.resizable():  # memory borrowed from NumPy
                        continue
                else:
                    if inputs is None:
                        inputs = set()
                        _storage_keys(args, inputs)
                        _storage_keys(kwargs.values(), inputs)
                    if key in inputs:
                        continue
                new.append((t, st, key))
            if new:
                probe.allocated(func, new)
        return out


def _storage_keys(args: Any, keys: set[int]) -> None:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.layout is torch.strided and not a.is_meta:
                keys.add(storage_key(a.untyped_storage()))
        elif isinstance(a, (list, tuple)):
            _storage_keys(a, keys)


class _Tagger(TorchFunctionMode):
    """Tags each autograd node made in forward with the module and line that made it."""

    def __init__(self, probe: StepProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _graph_task() != -1:
            return out
        tag = None
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                # the output's node and the untagged ones behind it: those a composite
                # operator made inside (F.linear on 3-d input: a view of an addmm)
                todo: list[Any] = [t.grad_fn]
                while todo:
                    node = todo.pop()
                    if node is None:
                        continue
                    meta = node.metadata
                    if _TAG in meta:
                        continue
                    if tag is None:
                        tag = (self.probe.module_label(), user_line(2, self.probe.boundary))
                    meta[_TAG] = tag
                    todo.extend(f for f, _ in node.next_functions)
        return out


def _is_torch_checkpoint_hook(hooks: Any) -> bool:
    """Whether saved-tensor hooks are torch's checkpoint's (forward or recompute)."""
    if hooks is None:
        return False
    qual = getattr(hooks[0], "__qualname__", "")
    return qual.startswith(("_checkpoint_hook.", "_recomputation_hook."))


def _in_torch_checkpoint() -> bool:
    """Whether the caller (a pack hook) runs inside ``torch.utils.checkpoint``'s own code."""
    f: Any = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return False
        if os.path.abspath(f.f_code.co_filename) == _TORCH_CHECKPOINT:
            return True
        f = f.f_back
    return False


class StepProbe:
    """Instrumentation of one step (see the module docstring); use as a context manager.

    Args:
        model: the model, whose module names label what it allocates (``None``
            for a function: modules are then named by their class).
        blocks: names of the model's repeated blocks (where the loss head starts).
        root: the label of code outside every module, before :meth:`stage`.
    """

    def __init__(self, model: nn.Module | None, blocks: list[str], root: str) -> None:
        self.names: dict[int, str] = {}
        if model is not None:
            for name, m in model.named_modules():
                self.names.setdefault(id(m), name or root)
        self.root = root
        self.base = root
        self.blocks = tuple(blocks)
        self.clock = 0
        self.current = 0
        self.allocs: dict[int, Alloc] = {}
        self.order: list[Alloc] = []
        self.peak: PeakPoint = PeakPoint(0, False, root, "", "", None, None)
        self.peak_at = 0
        self.stack: list[str] = []
        self.calls: dict[str, list[int]] = {}  # module -> [forward calls, backward calls]
        self.spanned: set[str] = set()
        self.pending: _Region | None = None
        self.span_input = False
        self.active: list[_Region] = []  # checkpoint regions whose forward runs
        self.spans: list[_Region] = []
        self.recomputing: list[_Region] = []
        self.regions: list[_Region] = []
        self.recomputes: dict[str, int] = {}
        self.nestings: dict[tuple[str, str], Nesting] = {}
        self.head_start: int | None = None  # clock when the last block's forward ended
        self.head_end: int | None = None  # clock of backward's first allocation not in the head
        self.first_call: dict[str, int] = {}  # module -> clock of its first forward call
        self._head: frozenset[str] | None = None
        self.boundary: Any = None  # the frame that runs the step (see user_line)
        self._exit = ExitStack()

    # -- context ---------------------------------------------------------------------
    def __enter__(self) -> StepProbe:
        self.boundary = sys._getframe(1)
        stack = self._exit
        try:
            mod = torch.nn.modules.module
            stack.enter_context(
                mod.register_module_forward_pre_hook(self._pre)  # type: ignore[arg-type]
            )
            stack.enter_context(mod.register_module_forward_hook(self._post, always_call=True))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, _identity))
            stack.enter_context(observe.observing(self))
            stack.enter_context(_Tagger(self))
            stack.enter_context(_Recorder(self))
        except BaseException:
            stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._exit.close()

    def stage(self, label: str) -> None:
        """Label code outside every module from now on (``"(loss)"`` after the model returned)."""
        self.base = label

    def close(self) -> None:
        """Drop the weak references to storages (their callbacks no longer reach the probe)."""
        for a in self.order:
            a.ref = None
        self.allocs = {}
        self.boundary = None

    # -- labels ----------------------------------------------------------------------
    def module_label(self) -> str:
        return self.stack[-1] if self.stack else self.base

    def _name(self, module: nn.Module) -> str:
        name = self.names.get(id(module))
        if name is None:
            name = self.names[id(module)] = type(module).__name__
        return name

    def in_block(self, label: str) -> bool:
        return any(label == b or label.startswith(b + ".") for b in self.blocks)

    def head_labels(self) -> frozenset[str]:
        """The loss head's labels: modules first called after the last block's forward, the
        model's own code (the root) and the loss; empty without blocks. Known once forward
        is over (cached from the first call in backward on)."""
        if self._head is not None:
            return self._head
        start = self.head_start
        if start is None:
            head: frozenset[str] = frozenset()
        else:
            late = {m for m, c in self.first_call.items() if c >= start}
            head = frozenset(late | {self.root, "(loss)"})
        if _graph_task() != -1:
            self._head = head
        return head

    # -- module hooks ----------------------------------------------------------------
    def _pre(self, module: nn.Module, args: Any) -> None:
        name = self._name(module)
        backward = _graph_task() != -1
        counts = self.calls.get(name)
        if counts is None:
            counts = self.calls[name] = [0, 0]
        counts[1 if backward else 0] += 1
        if not backward:
            self.first_call.setdefault(name, self.clock)
            if self.spans:
                self.spanned.add(name)
            if self.active and _is_torch_checkpoint_hook(_top_hooks(False)):
                outer = self.active[-1].label
                key = (name, outer)
                if key not in self.nestings and not any(
                    n.outer == outer and n.how.startswith("torch") for n in self.nestings.values()
                ):
                    self.nestings[key] = Nesting(
                        name, outer, "torch.utils.checkpoint inside remat's checkpoint"
                    )
        self.stack.append(name)

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.stack:
            name = self.stack.pop()
            if _graph_task() == -1 and name in self.blocks:
                self.head_start = self.clock

    # -- allocations -----------------------------------------------------------------
    def allocated(self, func: Any, new: list[tuple[torch.Tensor, Any, int]]) -> None:
        backward = _graph_task() != -1
        node_name = None
        line = None
        recompute_of = self.recomputing[-1].label if self.recomputing else None
        if not backward or recompute_of is not None:
            module = self.module_label() if self.stack or not backward else recompute_of
        else:
            node: Any = _current_node()
            tag = None if node is None else node.metadata.get(_TAG)
            node_name = None if node is None else node.name()
            module, line = tag if tag is not None else (UNKNOWN, "")
        if line is None:
            line = user_line(3, self.boundary)
        assert module is not None
        if backward and self.head_end is None and module not in self.head_labels():
            self.head_end = self.clock
        op = str(func)
        for t, st, key in new:
            a = Alloc(key, st.nbytes(), t, op, module, line)
            a.born = self.clock
            a.backward = backward
            ref = _StorageRef(st, self._freed)
            ref.alloc = a
            a.ref = ref
            self.allocs[key] = a
            self.order.append(a)
            self.current += a.nbytes
        if self.current > self.peak.bytes:
            self.peak = PeakPoint(self.current, backward, module, op, line, recompute_of, node_name)
            self.peak_at = self.clock

    def _freed(self, ref: _StorageRef) -> None:
        a = ref.alloc
        if a.died is None:
            a.died = self.clock
            self.current -= a.nbytes

    def alloc_of(self, t: torch.Tensor) -> Alloc | None:
        """The record of ``t``'s storage when it was allocated during the step and is alive."""
        if not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.is_meta:
            return None
        a = self.allocs.get(storage_key(t.untyped_storage()))
        return a if a is not None and a.died is None else None

    # -- what is kept ----------------------------------------------------------------
    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        if _graph_task() != -1:
            return x
        a = self.alloc_of(x)
        if a is None:
            return x
        region = self.pending
        if region is not None:
            region.inputs.add(a)
            a.because(Reason.REGION_INPUT, region.label)
        elif self.span_input and self.spans:
            span = self.spans[-1]
            span.inputs.add(a)
            a.because(Reason.REGION_INPUT, span.label)
        elif _in_torch_checkpoint():
            a.because(Reason.REGION_INPUT, f"{self.module_label()} (torch.utils.checkpoint)")
        else:
            a.because(Reason.NOT_CHECKPOINTED, self.module_label())
        return x

    # -- the observer (remat.engine.observe.Observer) ---------------------------------------
    def region_start(self, kind: str, fn: Callable[..., Any]) -> _Region:
        label = self.module_label()
        backward = _graph_task() != -1
        region = _Region(self, label, kind)
        if kind == "span":
            self.spans.append(region)
        else:
            if backward and not self.recomputing:
                self._nested(label, "an outer reentrant checkpoint", "recomputed by it in backward")
            elif not backward and self.active:
                self._nested(label, self.active[-1].label, "remat checkpoint inside another")
            elif not backward and _is_torch_checkpoint_hook(_top_hooks(False)):
                self._nested(label, "torch.utils.checkpoint", "remat inside torch's checkpoint")
            if not backward:
                self.active.append(region)
        if not backward:
            self.regions.append(region)
            self.pending = region
        return region

    def _nested(self, inner: str, outer: str, how: str) -> None:
        self.nestings.setdefault((inner, outer), Nesting(inner, outer, how))

    def keeping_input(self, on: bool) -> None:
        self.span_input = on

    def kept(self, tensors: list[torch.Tensor], how: str) -> None:
        if _graph_task() != -1:
            return
        if how == "input":  # a wrapper's copies of buffers, for its recompute
            reason, keeper = Reason.REGION_INPUT, self.module_label()
        else:
            reason = Reason.SELECTIVE if how == "selective" else Reason.OFFLOADED
            keeper = self.active[-1].label if self.active else self.module_label()
        for t in tensors:
            a = self.alloc_of(t)
            if a is not None:
                a.because(reason, keeper)

    def offloaded(self, source: torch.Tensor, host: torch.Tensor) -> None:
        if _graph_task() != -1:
            return
        a = self.alloc_of(host)
        if a is None:
            return
        src = self.alloc_of(source)
        if src is not None and src is not a:  # the host copy shows what it holds
            a.op, a.module, a.line, a.shape, a.dtype = (
                src.op,
                src.module,
                src.line,
                src.shape,
                src.dtype,
            )
        a.because(Reason.OFFLOADED, self.module_label())

    # -- results ---------------------------------------------------------------------
    def alive(self) -> Iterator[Alloc]:
        """The storages allocated during the step and alive now, in allocation order."""
        for a in self.order:
            if a.died is None:
                yield a

    def region_stats(self) -> list[RegionStats]:
        """Each region label's calls, what it dropped and what it kept (forward calls only)."""
        stats: dict[tuple[str, str], RegionStats] = {}
        for r in self.regions:
            s = stats.get((r.label, r.kind))
            if s is None:
                s = stats[(r.label, r.kind)] = RegionStats(r.label, r.kind)
            s.calls += 1
            s.nested = s.nested or r.inside
            if r.kind == "reentrant":
                s.dropped_bytes = -1
            elif s.dropped_bytes >= 0:
                s.dropped_bytes += sum(a.nbytes for a in r.saved)
            s.saved_input_bytes += sum(a.nbytes for a in r.saved_old)
            s.input_bytes += sum(a.nbytes for a in r.inputs)
            s.extra_input_bytes += sum(
                a.nbytes
                for a in r.inputs
                if a not in r.saved_old
                and all(reason is not Reason.NOT_CHECKPOINTED for reason, _ in a.reasons)
            )
        for s in stats.values():
            s.recomputes = self.recomputes.get(s.label, 0)
        return list(stats.values())


# The probe's saved-tensor hooks only observe and shadow the hooks under them: marked as
# checkpoint's own with nothing under them (remat.engine.torch_compat), a selective region run
# under the probe neither warns about them nor routes what it saves through them.
setattr(StepProbe._pack, "_checkpoint_internal", True)  # noqa: B010
setattr(StepProbe._pack, "_user_hooks", None)  # noqa: B010


def _identity(x: Any) -> Any:
    return x
