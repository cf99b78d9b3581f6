"""Selective checkpointing: save, recompute or offload each operator's output.

``create_selective_checkpoint_contexts(policy)`` returns the two dispatch
modes that :func:`remat.checkpoint` runs the forward and the recompute under
(its ``context_fn``).

* Forward (:class:`_SaveMode`): every ATen operator runs; the policy decides
  per call. ``SAVE`` keeps a detached alias of the output (and its version);
  ``CPU_OFFLOAD`` hands the output to the host stash of :mod:`remat.engine.offload`
  (on CPU-only setups it is kept as is); ``RECOMPUTE`` keeps nothing. The
  decisions are stored per operator, in call order.
* Recompute (:class:`_ServeMode`): the ``i``-th call of an operator is served
  from the ``i``-th stored decision: a saved or offloaded output is returned
  without running the operator, a recompute one runs again. A saved random
  operator also puts the RNG where the forward left it after that operator,
  so later random operators draw the same numbers as in forward.

Policies are called in forward with ``ctx.is_recompute=False`` and, when they
are functions, again in recompute with ``ctx.is_recompute=True``; a different
answer raises :class:`~remat.CheckpointError`. ``ctx.index`` tells how many
times this operator already ran in the current run (forward or this
recompute): a policy that wants "every second matmul" should use it instead of
a counter of its own, which would drift between forward and recompute.

An output the policy saves that the region then changes in place (``h = x @ w;
h.relu_()``, or an in-place op on a piece of it that does not share its version
counter, as the ``unsafe_split`` chunks of ``nn.GRU``'s gate products) would serve
the changed values to the recompute. The forward watches the storages of saved
outputs: under ``PREFER_SAVE`` such an output is recomputed instead (its value
dropped at the change), under ``MUST_SAVE`` recompute raises
:class:`~remat.CheckpointError` (as torch does for changes its version counter
sees; torch misses the others and gives silently wrong gradients).

Operators whose output aliases an input (views such as ``slice`` or
``transpose``, and in-place operators such as ``add_`` or ``bernoulli_``) are
always recomputed, whatever the policy answers (it is still asked, so a
function policy sees every operator and its ``ctx.index`` counts them). A
served view would alias the *forward's* tensor instead of the recomputed
base, so an in-place change through it (``t[:, :2].mul_(3)``) would land on
the wrong tensor and the gradients would be silently wrong (torch's selective
checkpointing has this bug); a served in-place operator would skip its
mutation of the recomputed tensor. Recomputing them costs nothing: a view
holds no new memory and an in-place operator's output is its input.

Saved outputs are dropped as the recompute hands them over (so the peak is
torch's): as in torch, a second backward over the region raises "Trying to
backward an extra time", also after ``retain_graph=True``. A backward that builds
a graph (``create_graph=True``) keeps them, because the graph it builds reaches
back into the region and the next backward recomputes it again: double
backward works (torch raises there). Offloaded outputs are kept for a second
backward after ``retain_graph=True`` (torch recomputes offloaded operators in
eager mode, so a second backward works there too) and dropped otherwise.

Around the region, saved-tensor hooks of the user's (``save_on_cpu``,
:func:`remat.offload`) see what the policy saves only with
``respect_saved_tensors_hooks=True`` (:func:`remat.checkpoint`); by default
(``None``, torch 2.14's) they do not, and the forward warns (``FutureWarning``,
torch's words) the first time the policy saves under them. Inside an enclosing
remat region (a nested checkpoint, a span) saved outputs always go to that region,
whatever the option says: it drops them in forward and its recompute brings them
back (:class:`_Passed`), so nothing bypasses anything and there is nothing to warn about.

Inside ``torch.compile`` the contexts are torch's own (the compiler knows how
to trace them); the offload policies then follow torch's compiled semantics.
"""

from __future__ import annotations

import enum
import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as _tuc
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as _no_modes

from ..policies import CheckpointPolicy, OpPolicy
from . import observe
from .bytes import data_address, element_bytes
from .errors import CheckpointError
from .offload import HostStash, shared_stash
from .state import host_state, tensor_state
from .torch_compat import user_saved_tensors_hooks

_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
_OFFLOAD = (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)
#: Operators selective checkpointing neither asks the policy about nor stores: torch's own
#: set (the same object, so an op added to either is ignored by both).
SAC_IGNORED_OPS: set[Any] = _tuc.SAC_IGNORED_OPS
_SEEDED = torch.Tag.nondeterministic_seeded


class SelectiveCheckpointContext:
    """What a selective-checkpointing policy is told about the current call.

    Attributes:
        is_recompute: ``False`` in forward, ``True`` in recompute.
        index: how many times this operator ran before in the current run of
            the region (forward, or the current recompute).
        op_output: the operator's output in forward; ``None`` in recompute.

    Example:
        >>> import remat
        >>> ctx = remat.SelectiveCheckpointContext(is_recompute=False)
        >>> ctx.is_recompute, ctx.index
        (False, 0)
    """

    __slots__ = ("is_recompute", "index", "op_output")

    def __init__(self, *, is_recompute: bool, index: int = 0, op_output: Any = None) -> None:
        self.is_recompute = is_recompute
        self.index = index
        self.op_output = op_output


class _Kind(enum.Enum):
    RECOMPUTE = 0
    SAVE = 1
    OFFLOAD = 2


def _kind(policy: Any, func: Any) -> _Kind:
    if policy is True or policy is False:
        return _Kind.SAVE if policy else _Kind.RECOMPUTE
    if policy in _SAVE:
        return _Kind.SAVE
    if policy in _OFFLOAD:
        return _Kind.OFFLOAD
    if policy in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE):
        return _Kind.RECOMPUTE
    raise TypeError(
        f"selective checkpointing: the policy returned {policy!r} for {func}; return a "
        "remat.CheckpointPolicy member (or a bool: True saves, False recomputes)."
    )


@functools.cache
def _answers(on_match: Any, otherwise: Any) -> tuple[_Kind, bool, _Kind, bool]:
    """An :class:`OpPolicy`'s two answers as (kind, whether it prefers to save), each."""
    return (
        _kind(on_match, None),
        on_match is CheckpointPolicy.PREFER_SAVE,
        _kind(otherwise, None),
        otherwise is CheckpointPolicy.PREFER_SAVE,
    )


#: OpPolicy objects made from op lists, by the ops (a list is made into one at every call)
_LIST_POLICIES: dict[tuple[Any, ...], OpPolicy] = {}


def _list_policy(ops: Sequence[Any]) -> OpPolicy:
    key = tuple(ops)
    try:
        found = _LIST_POLICIES.get(key)
    except TypeError:  # an unhashable entry: checked (and refused) below
        found, key = None, ()
    if found is None:
        _check_ops(ops)
        found = OpPolicy(ops)
        if key:
            if len(_LIST_POLICIES) >= 256:
                _LIST_POLICIES.clear()
            _LIST_POLICIES[key] = found
    return found


@functools.cache
def _aliases_input(func: Any) -> bool:
    """Whether ``func`` returns a view of, or writes into, one of its inputs."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _alias(t: torch.Tensor) -> torch.Tensor:
    # A detached alias made with view tracking on, so that it shares the version
    # counter and autograd can treat it like the original output.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


_MUTATION_FLAG = (
    "allow_cache_entry_mutation=True silences this check but does not make it safe: the "
    "recompute is then served the changed values, and gradients computed from them are wrong "
    "(as in torch); use it only when backward does not depend on the change."
)


class _Saved:
    """A saved output: detached aliases of the op's output tensors and their versions.

    ``written`` is set when the forward wrote into the output's storage through a
    tensor that may not share its version counter (see :meth:`_SaveMode._protect`).
    """

    __slots__ = ("value", "versions", "rng", "written")

    def __init__(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self.value: Any = _alias(out)
            self.versions: Any = out._version
        else:
            self.value = [(_alias(o) if isinstance(o, torch.Tensor) else o) for o in out]
            self.versions = [(o._version if isinstance(o, torch.Tensor) else None) for o in out]
        self.rng: tuple[Any, ...] | None = None
        self.written = False

    def tensors(self) -> list[torch.Tensor]:
        """The saved tensors."""
        vals = [self.value] if isinstance(self.value, torch.Tensor) else self.value
        return [v for v in vals if isinstance(v, torch.Tensor)]

    def get(self, func: Any, allow_mutation: bool) -> Any:
        if isinstance(self.value, torch.Tensor):
            return self._one(self.value, self.versions, func, allow_mutation)
        vals = [
            self._one(v, ver, func, allow_mutation) if isinstance(v, torch.Tensor) else v
            for v, ver in zip(self.value, self.versions)
        ]
        return tuple(vals)

    def _one(self, v: torch.Tensor, version: int, func: Any, allow_mutation: bool) -> torch.Tensor:
        if not allow_mutation and (v._version != version or self.written):
            _mutated(func, version, v, self.written)
        return _alias(v)

    @property
    def ptrs(self) -> list[int]:
        """The storages of the saved tensors (watched for writes inside the region)."""
        return [
            data_address(t)
            for t in self.tensors()
            if t.layout is torch.strided and t.numel()
        ]


class _Passed:
    """A saved output handed to the region this one is nested in (a span, an outer
    checkpoint): packed by that region's saved-tensor hook, which keeps nothing in
    forward and puts the value back when its recompute reaches this operator again.

    Without it the cache would stay alive until backward although the enclosing
    region drops everything else its blocks save: a span of selective blocks then
    held each block's cache *and* recomputed the blocks. The values served are the
    enclosing recompute's, so a change of the forward's output after the region
    cannot reach them; a change inside the region is seen as for :class:`_Saved`
    (``written``; the version counter, also in the enclosing recompute).
    """

    __slots__ = ("packed", "versions", "single", "unpack", "ptrs", "held", "rng", "written")

    def __init__(self, out: Any, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> None:
        self.single = isinstance(out, torch.Tensor)
        outs = [out] if self.single else list(out)
        # aliases, not the outputs: an output holds its graph node (see _Offloaded)
        aliases = [_alias(o) if isinstance(o, torch.Tensor) else o for o in outs]
        self.packed = [pack(a) if isinstance(a, torch.Tensor) else a for a in aliases]
        # held until the region's forward ends: the storages are watched by address
        # (:meth:`_SaveMode._protect`), which must not be handed to another tensor meanwhile
        self.held: list[Any] | None = aliases
        self.versions = [o._version if isinstance(o, torch.Tensor) else None for o in outs]
        self.ptrs = [
            data_address(o)
            for o in outs
            if isinstance(o, torch.Tensor) and o.layout is torch.strided and o.numel()
        ]
        self.unpack = unpack
        self.rng: tuple[Any, ...] | None = None
        self.written = False

    def release(self) -> None:
        """The region's forward ended: from now on only the enclosing region keeps it."""
        self.held = None

    def get(self, func: Any, allow_mutation: bool) -> Any:
        vals = []
        for p, ver in zip(self.packed, self.versions):
            if ver is None:
                vals.append(p)
                continue
            v = self.unpack(p)
            if not allow_mutation and (v._version != ver or self.written):
                _mutated(func, ver, v, self.written)
            vals.append(_alias(v))
        return vals[0] if self.single else tuple(vals)


class _Hooked(_Passed):
    """A saved output routed through the user's saved-tensor hooks around the region
    (``respect_saved_tensors_hooks=True``): packed by them in forward (``save_on_cpu``
    copies it to host memory), unpacked when the recompute reaches the operator.

    A change in place after the region is caught, as in torch, by the version counter of
    what the pack hook returned when that is a tensor (a hook that keeps the tensor
    itself); a change inside the region as for :class:`_Saved` (``written``).
    """

    __slots__ = ("packed_versions",)

    def __init__(self, out: Any, pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> None:
        super().__init__(out, pack, unpack)
        self.packed_versions = [
            p._version if isinstance(p, torch.Tensor) else None for p in self.packed
        ]

    def get(self, func: Any, allow_mutation: bool) -> Any:
        vals = []
        for p, ver, pver in zip(self.packed, self.versions, self.packed_versions):
            if ver is None:  # not a tensor
                vals.append(p)
                continue
            if not allow_mutation and pver is not None and p._version != pver:
                _mutated(func, pver, p, self.written)
            v = self.unpack(p)
            if not allow_mutation and self.written:
                _mutated(func, v._version, v, True)
            vals.append(_alias(v))
        return vals[0] if self.single else tuple(vals)


def _mutated(func: Any, version: int, v: torch.Tensor, written: bool) -> None:
    how = (
        f"(version {version} -> {v._version})"
        if v._version != version
        else "(through a tensor sharing its storage but not its version counter, such "
        "as a chunk of unsafe_split, as in nn.GRU)"
    )
    raise CheckpointError(
        "selective checkpointing: Tensor cached during selective activation checkpoint "
        f"has been mutated: the output of {func} that the policy saved was modified in "
        f"place after it was saved {how}, so recompute would read changed values. Make "
        "the in-place op out-of-place (e.g. x = x.relu() instead of x.relu_()), have "
        "the policy recompute this op, or answer CheckpointPolicy.PREFER_SAVE for it "
        f"(an output changed in place is then recomputed). {_MUTATION_FLAG}"
    )


class _Offloaded:
    """Outputs kept in host memory by an offload policy: a snapshot of the op's output.

    On a device the host copy is taken asynchronously; an in-place change of the
    output later in the region first waits for that copy (:meth:`protect`), and the
    region's end waits for all of them, so the copy always holds the op's own
    output and the recompute, which re-applies the in-place ops, gets it. On CPU
    the output is kept as it is: :meth:`protect` clones it before a change inside
    the region; a change after the region is caught by its version counter.
    """

    __slots__ = (
        "tickets",
        "is_tensor",
        "stash",
        "single",
        "rng",
        "versions",
        "cloned",
        "__weakref__",
    )

    def __init__(self, out: Any, stash: HostStash) -> None:
        self.stash = stash
        self.single = isinstance(out, torch.Tensor)
        outs = [out] if self.single else list(out)
        self.is_tensor = [isinstance(o, torch.Tensor) for o in outs]
        # An alias (same storage and version counter, no graph): the op output holds its
        # graph node, which (through the region) holds this entry; held as it is, the
        # region's graph outlived its last reference.
        self.tickets = [stash.put(_alias(o)) if t else o for o, t in zip(outs, self.is_tensor)]
        self.versions = [o._version if isinstance(o, torch.Tensor) else None for o in outs]
        self.cloned = [False] * len(outs)
        self.rng: tuple[Any, ...] | None = None
        # Once consumed by backward (or the graph is freed) the host buffers go back to the
        # pool; tensors kept on the host are released by their byte count (not held here).
        kept = [
            element_bytes(tk) if isinstance(tk, torch.Tensor) else tk
            for tk, t in zip(self.tickets, self.is_tensor)
            if t
        ]
        weakref.finalize(self, _release_all, stash, kept)

    def protect(self, i: int) -> None:
        """Output ``i`` is about to be changed in place inside the region: keep its value."""
        tk = self.tickets[i]
        if isinstance(tk, torch.Tensor):
            if not self.cloned[i]:
                with torch.no_grad(), _no_modes():
                    clone = tk.clone()
                self.tickets[i] = clone
                self.cloned[i] = True
                self.versions[i] = clone._version
        else:
            self.stash.settle(tk)

    def settle(self) -> None:
        """The region ends: later changes of the outputs must not race their copies out."""
        for tk, t in zip(self.tickets, self.is_tensor):
            if t:
                self.stash.settle(tk)

    def get(self, func: Any, allow_mutation: bool) -> Any:
        vals = []
        for i, (tk, t) in enumerate(zip(self.tickets, self.is_tensor)):
            if not t:
                vals.append(tk)
                continue
            v = self.stash.get(tk)
            if isinstance(tk, torch.Tensor):
                # kept on the host as it is: a change after the region would be served
                if not allow_mutation and v._version != self.versions[i]:
                    raise CheckpointError(
                        "selective checkpointing: Tensor cached during selective activation "
                        f"checkpoint has been mutated: the output of {func} that the policy "
                        f"offloaded was modified in place after its region (version "
                        f"{self.versions[i]} -> {v._version}), so recompute would read changed "
                        "values. Make the in-place op out-of-place or have the policy "
                        f"recompute this op. {_MUTATION_FLAG}"
                    )
                # a clone made before a change inside the region must stay as it is: the
                # recompute changes what it is served again
                v = v.clone() if self.cloned[i] else _alias(v)
            vals.append(v)
        return vals[0] if self.single else tuple(vals)


def _release_all(stash: HostStash, tickets: list[Any]) -> None:
    for tk in tickets:
        stash.release(tk)


#: A cache entry of an operator the policy recomputes (the planner's FLOPs count reads it).
RECOMPUTE_ENTRY = object()
_CONSUMED = object()


def _backward_keeps_graph() -> bool:
    """Whether the backward running now retains its graph (True outside backward)."""
    if torch._C._current_graph_task_id() == -1:
        return True
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


#: torch 2.14's words (code matches on them) when saved outputs are already used up.
_EXTRA_BACKWARD = (
    "Trying to backward an extra time. You are only allowed to backward once on any region "
    "computed under selective activation checkpoint."
)
#: torch 2.14's words when a selective region saves under the user's saved-tensor hooks.
_HOOKS_BYPASSED = (
    "A saved_tensors_hooks context (e.g. save_on_cpu) is active around a selective activation "
    "checkpoint region. Tensors that SAC saves currently bypass these hooks, but a future "
    "release will route them through the hooks like any other saved tensor. Silence this "
    "warning and choose the behavior explicitly by passing "
    "respect_saved_tensors_hooks=True|False to remat.checkpoint (True: what the policy saves "
    "goes through the hooks, to host memory under save_on_cpu or remat.offload)."
)


def _rng_after(out: Any) -> tuple[Any, ...]:
    """RNG state right after a random operator: CPU and the output's device."""
    dev = None
    t = (
        out
        if isinstance(out, torch.Tensor)
        else next((o for o in out if isinstance(o, torch.Tensor)), None)
    )
    if t is not None and t.device.type not in ("cpu", "meta"):
        mod = torch.get_device_module(t.device.type)
        with mod.device(t.device):
            dev = (mod, t.device, mod.get_rng_state())
    return (host_state(torch.get_rng_state(), dev is None), dev)


def _set_rng(state: tuple[Any, ...]) -> None:
    cpu, dev = state
    torch.set_rng_state(tensor_state(cpu))
    if dev is not None:
        mod, device, s = dev
        with mod.device(device):
            mod.set_rng_state(s)


class _Store:
    """Decisions and kept outputs of one region, shared by its two modes."""

    __slots__ = ("entries", "answers", "stash")

    def __init__(self) -> None:
        self.entries: dict[Any, list[Any]] = {}
        self.answers: dict[Any, list[_Kind]] = {}
        self.stash: HostStash | None = None


class _SaveMode(TorchDispatchMode):
    """Forward mode: run every operator and keep what the policy says."""

    def __init__(self, policy: Callable[..., Any], store: _Store) -> None:
        super().__init__()
        self.policy = policy
        self.store = store
        # (ops, their kind, whether they prefer to save, the kind of the rest, ...)
        self.fast: tuple[frozenset[Any], _Kind, bool, _Kind, bool] | None = None
        if isinstance(policy, OpPolicy):
            self.fast = (policy.ops, *_answers(policy.on_match, policy.otherwise))
        self.offloaded: dict[int, tuple[_Offloaded, int]] = {}  # storage -> (entry, output)
        # storage -> (the op's entries, index, entry, whether it prefers to save)
        self.saved: dict[int, tuple[list[Any], int, Any, bool]] = {}
        #: (pack, unpack) of the remat region this one is nested in, set by the engine
        #: before each forward: saved outputs are handed to it (:class:`_Passed`)
        self.enclosing: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None
        #: checkpoint's ``respect_saved_tensors_hooks`` (torch 2.14's attribute name), set
        #: by the engine before each forward
        self.respect_saved_tensors_hooks: bool | None = None
        #: the user's saved-tensor hooks around the region, outside an enclosing one
        self.user_hooks: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None
        self.warned = False
        self.passed: list[_Passed] = []

    def __enter__(self) -> _SaveMode:
        self.offloaded = {}
        self.saved = {}
        self.passed = []
        self.warned = False
        self.user_hooks = None if self.enclosing is not None else user_saved_tensors_hooks()
        return super().__enter__()  # type: ignore[no-any-return]

    def _through_user_hooks(self) -> bool:
        """Whether a saved output goes through the user's hooks (there are some); by
        default it does not, and the first one saved says so (torch 2.14's warning)."""
        respect = self.respect_saved_tensors_hooks
        if respect is None and not self.warned:
            self.warned = True
            warnings.warn(_HOOKS_BYPASSED, FutureWarning, stacklevel=2)
        return bool(respect)

    def __exit__(self, *exc: Any) -> None:
        entries = list(self.offloaded.values()) if self.offloaded else ()
        self.offloaded = {}
        self.saved = {}  # a change after the region is seen by the version counter
        if self.passed:
            for p in self.passed:
                p.release()
            self.passed = []
        super().__exit__(*exc)
        for entry, _ in entries:  # outside the mode: nothing here is a forward operator
            entry.settle()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (self.offloaded or self.saved) and _writes_input(func):
            self._protect(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in SAC_IGNORED_OPS:
            return out
        entries = self.store.entries.get(func)
        if entries is None:
            entries = self.store.entries[func] = []
        if self.fast is not None:
            ops, on_match, prefer_match, otherwise, prefer_other = self.fast
            kind, prefer = (on_match, prefer_match) if func in ops else (otherwise, prefer_other)
        else:
            ctx = SelectiveCheckpointContext(is_recompute=False, index=len(entries), op_output=out)
            answer = self.policy(ctx, func, *args, **kwargs)
            kind = _kind(answer, func)
            prefer = answer is CheckpointPolicy.PREFER_SAVE
            self.store.answers.setdefault(func, []).append(kind)
        if kind is _Kind.RECOMPUTE or not _has_tensor(out) or _aliases_input(func):
            entries.append(RECOMPUTE_ENTRY)
            return out
        if kind is _Kind.SAVE:
            entry: Any
            if self.enclosing is not None:
                entry = _Passed(out, *self.enclosing)
                self.passed.append(entry)
            elif self.user_hooks is not None and self._through_user_hooks():
                entry = _Hooked(out, *self.user_hooks)
                self.passed.append(entry)
            else:
                entry = _Saved(out)
            watch = (entries, len(entries), entry, prefer)
            for ptr in entry.ptrs:
                self.saved[ptr] = watch
        else:
            if self.store.stash is None:
                self.store.stash = shared_stash()
            entry = _Offloaded(out, self.store.stash)
            outs = [out] if isinstance(out, torch.Tensor) else list(out)
            for i, o in enumerate(outs):
                if isinstance(o, torch.Tensor) and o.layout is torch.strided and o.numel():
                    self.offloaded[data_address(o)] = (entry, i)
        if _SEEDED in func.tags:
            entry.rng = _rng_after(out)
        entries.append(entry)
        return out

    def _protect(self, func: Any, args: Any, kwargs: Any) -> None:
        """Before ``func`` writes into a kept output, keep the output's value (offloaded), or
        recompute the output instead (saved, ``PREFER_SAVE``), or mark it changed (saved,
        ``MUST_SAVE``: recompute raises).

        By storage, not by version counter: a tensor can share an output's storage but not
        its version counter (the chunks of ``unsafe_split``, which ``nn.GRU`` adds to in place).
        """
        schema = func._schema
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor) and t.layout is torch.strided and t.numel():
                    ptr = data_address(t)
                    hit = self.offloaded.pop(ptr, None)
                    if hit is not None:
                        hit[0].protect(hit[1])
                    saved = self.saved.pop(ptr, None)
                    if saved is not None:
                        self._changed(*saved)

    def _changed(self, entries: list[Any], index: int, entry: Any, prefer: bool) -> None:
        """A saved output is about to be changed in place inside the region."""
        if not prefer:
            entry.written = True
            return
        if entries[index] is entry:  # recompute it: the saved value would be the changed one
            entries[index] = RECOMPUTE_ENTRY
        for ptr in entry.ptrs:  # the entry's other outputs are no longer watched
            self.saved.pop(ptr, None)


class _ObservedSaveMode(_SaveMode):
    """The forward mode under :func:`remat.explain`: tells the observer what the policy keeps.

    Picked once per region (:func:`create_selective_checkpoint_contexts`), so that
    the mode of a run without an observer does no work for it.
    """

    def __init__(self, policy: Callable[..., Any], store: _Store, observer: Any) -> None:
        super().__init__(policy, store)
        self.observer = observer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        entries = self.store.entries.get(func)
        n = 0 if entries is None else len(entries)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        entries = self.store.entries.get(func)
        if entries is not None and len(entries) > n:
            entry = entries[-1]
            if isinstance(entry, _Saved):
                self.observer.kept(entry.tensors(), "selective")
            elif isinstance(entry, _Offloaded):
                stash = entry.stash
                kept = [stash.host_tensor(tk) for tk, t in zip(entry.tickets, entry.is_tensor) if t]
                self.observer.kept([k for k in kept if k is not None], "offloaded")
        return out


@functools.cache
def _writes_input(func: Any) -> bool:
    """Whether ``func`` writes into one of its arguments (in-place and ``out=`` ops)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def _has_tensor(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    return isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out)


class _ServeMode(TorchDispatchMode):
    """Recompute mode: serve kept outputs, run the rest again."""

    remat_internal = True  # the recompute detaches below the modes under it (nonreentrant)

    def __init__(self, policy: Callable[..., Any], store: _Store, allow_mutation: bool) -> None:
        super().__init__()
        self.policy = None if isinstance(policy, OpPolicy) else policy
        self.store = store
        self.allow_mutation = allow_mutation
        self.counts: dict[Any, int] = {}
        #: whether the backward running this recompute builds a graph (``create_graph``),
        #: set by the engine before each recompute; then saved outputs are kept
        self.backward_builds_graph = False
        self.keeps_graph = True

    def __enter__(self) -> _ServeMode:
        self.counts = {}
        # offloaded outputs (remat's own policies; torch recomputes those ops in eager, so
        # a second backward works there) are kept for a backward that retains the graph
        self.keeps_graph = _backward_keeps_graph()
        return super().__enter__()  # type: ignore[no-any-return]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        i = self.counts.get(func, 0)
        self.counts[func] = i + 1
        entries = self.store.entries.get(func)
        if entries is None or i >= len(entries):
            where = "" if entries is None else f" invocation index {i}"
            raise CheckpointError(
                f"selective checkpointing: {func}{where} encountered during backward but not "
                f"found in storage: it ran {i + 1} time(s) in recompute but "
                f"{0 if entries is None else len(entries)} time(s) in forward. The region must "
                "run the same operators in recompute; check for code that depends on global "
                "state changed between forward and backward."
            )
        entry = entries[i]
        if self.policy is not None:
            ctx = SelectiveCheckpointContext(is_recompute=True, index=i)
            kind = _kind(self.policy(ctx, func, *args, **kwargs), func)
            was = self.store.answers[func][i]
            if kind is not was:
                raise CheckpointError(
                    f"selective checkpointing: the policy answered {kind.name} for call #{i} of "
                    f"{func} in recompute but {was.name} in forward. A policy must answer the "
                    "same in both; base it on the operator, its arguments and ctx.index, not on "
                    "a counter of your own (see remat.SelectiveCheckpointContext)."
                )
        if entry is RECOMPUTE_ENTRY:
            return func(*args, **kwargs)
        if entry is _CONSUMED:
            raise CheckpointError(
                f"{_EXTRA_BACKWARD} The output of {func} that the policy saved was used up by "
                "an earlier backward (retain_graph=True keeps the graph, not what selective "
                "checkpointing saved). Run the forward again before each backward, or "
                "checkpoint this region without a policy (remat.checkpoint recomputes it in "
                "every backward)."
            )
        out = entry.get(func, self.allow_mutation)
        if not (self.keeps_graph if isinstance(entry, _Offloaded) else self.backward_builds_graph):
            entries[i] = _CONSUMED
        if entry.rng is not None:
            _set_rng(entry.rng)
        return out


def _check_ops(ops: Any) -> None:
    for op in ops:
        if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
            hint = (
                f" Please update the OpOverloadPacket to a specific OpOverload: use {op}.default "
                f"(or another overload) instead of {op}."
                if isinstance(op, torch._ops.OpOverloadPacket)
                else " Use ATen overloads such as torch.ops.aten.mm.default."
            )
            raise ValueError(
                "create_selective_checkpoint_contexts: Expected op in `op_list` to be an "
                f"OpOverload but got: {op!r} of type {type(op).__name__}.{hint}"
            )


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Callable[..., Any] | Sequence[Any],
    allow_cache_entry_mutation: bool = False,
) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """Make a ``context_fn`` result for :func:`remat.checkpoint` that saves some op outputs.

    Args:
        policy_fn_or_list: either a list of ATen operator overloads
            (``torch.ops.aten.mm.default``), meaning "save these, recompute the
            rest", or a function ``policy(ctx, op, *args, **kwargs)`` returning
            a :class:`CheckpointPolicy` (or a bool: ``True`` saves). The
            function is called in forward and again in recompute with
            ``ctx.is_recompute=True`` and must answer the same; use
            ``ctx.index`` (calls of this op so far in this run) to count ops.
        allow_cache_entry_mutation: allow in-place changes of saved outputs
            (by default they raise :class:`CheckpointError` in recompute). As in
            torch, the recompute is then served the changed values: gradients
            that depend on them are wrong, so pass ``True`` only when backward
            does not (the change is undone, or only shapes are read).

    Returns:
        The forward and recompute contexts.

    Raises:
        ValueError: a listed op is not an ATen overload (torch's message; an
            ``OpOverloadPacket`` such as ``torch.ops.aten.mm`` names the fix).
        TypeError: ``policy_fn_or_list`` is neither a function nor a list.

    Example:
        >>> import functools, torch, remat
        >>> ops = [torch.ops.aten.mm.default]
        >>> ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts, ops)
        >>> w = torch.randn(8, 8, requires_grad=True)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = remat.checkpoint(lambda a: torch.mm(a, w).sin(), x, context_fn=ctx_fn)
        >>> y.sum().backward()
    """
    if isinstance(policy_fn_or_list, (list, tuple)):
        policy: Callable[..., Any] = _list_policy(policy_fn_or_list)
    elif isinstance(policy_fn_or_list, (set, frozenset)):
        _check_ops(policy_fn_or_list)
        policy = OpPolicy(policy_fn_or_list)
    elif callable(policy_fn_or_list):
        policy = policy_fn_or_list
    else:
        raise TypeError(
            "create_selective_checkpoint_contexts: policy_fn_or_list must be either a function "
            f"or a list of ops. Got {type(policy_fn_or_list).__name__} {policy_fn_or_list!r}; "
            "pass a policy function (ctx, op, *args, **kwargs) -> CheckpointPolicy, or a list "
            "such as [torch.ops.aten.mm.default]."
        )
    if torch.compiler.is_compiling():
        torch_policy = policy
        return _tuc.create_selective_checkpoint_contexts(  # type: ignore[no-any-return]
            torch_policy, allow_cache_entry_mutation
        )
    store = _Store()
    obs = observe.current()
    save = _SaveMode(policy, store) if obs is None else _ObservedSaveMode(policy, store, obs)
    return save, _ServeMode(policy, store, allow_cache_entry_mutation)
