"""The planner's vocabulary as types: decisions, spans, phases of a step, measured terms.

Nothing here computes a term of the step model (that is :mod:`.stepmodel`'s) or renders
text for people (:mod:`.render`'s); these are the values every other module of the
planner passes around. :class:`Decision` is a ``str`` enum, so a decision reads, compares,
hashes and serialises as its name (``Decision.KEEP == "keep"``).

Example:
    >>> from remat.planner.types import Decision, Phase, Span, Where, Window, WindowKind
    >>> Decision("selective"), Decision.KEEP == "keep"
    ('selective', True)
    >>> Span(0, 2, offloaded=True)
    Span(first=0, last=2, offloaded=True)
    >>> str(Where(Phase.BACKWARD, "layers.3")), Where(Phase.OPTIMIZER_FIRST).movable
    ("backward of 'layers.3'", False)
    >>> Window(WindowKind.BWD, 3).label, Window.parse("top")
    ('bwd:3', Window(kind=<WindowKind.TOP: 'top'>, block=-1))
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

from typing_extensions import Self

from ..engine.errors import PlanError
from ..measure.diagnose import Diagnostic, Kind

__all__ = [
    "BOUND",
    "DECISIONS",
    "FIT",
    "GROUP",
    "KEEP",
    "MAX",
    "MIN",
    "NEVER",
    "OFFLOAD",
    "RECOMPUTE",
    "SAME",
    "SELECTIVE",
    "SPAN_INNER",
    "SPLIT",
    "Measurements",
    "OptimizerTerms",
    "PeakPart",
    "PlanData",
    "ProfileData",
    "BlockCosts",
    "CostUnit",
    "Decision",
    "Fit",
    "Phase",
    "ScratchTerms",
    "Segment",
    "Span",
    "SpanKind",
    "SharedInput",
    "SharedTerms",
    "SpanLike",
    "StepPeak",
    "TIME",
    "Timeline",
    "Timer",
    "Where",
    "Window",
    "WindowKind",
    "as_decisions",
    "shared_inputs",
    "term_parts",
    "with_parts",
]

#: How ranks agree over a field (:mod:`remat.planner.distributed`): every rank must hold the
#: same value, or each number (of a dict, of a list) becomes its largest / smallest over the
#: ranks (bytes of the rank with the most, times of the slowest; a span input is offloaded
#: only where every rank found it free to move).
SAME = {"agree": "same"}
MAX = {"agree": "max"}
MIN = {"agree": "min"}


class Fit(enum.Enum):
    """What the fit along a varying size (:mod:`remat.planner.shapefit`) does with a numeric
    field (its ``metadata["fit"]``, beside how ranks agree over it)."""

    EXACT = "exact"  # a byte term: interpolated exactly between knots, checked to the byte
    BOUND = "bound"  # scratch inside operators: the larger of the knots around, never fitted
    TIME = "time"  # a time (or FLOPs), a float: interpolated, never checked


#: The fit of a field (:class:`Fit`), to join with how ranks agree (``MAX | FIT``).
FIT = {"fit": Fit.EXACT}
BOUND = {"fit": Fit.BOUND}
TIME = {"fit": Fit.TIME}

#: The cost measure of a profile (:func:`remat.profile`'s ``timer``): counted work priced
#: per device, timed steps, or FLOPs.
Timer = Literal["time", "measured", "flops"]

#: The unit of a profile's and a plan's costs: seconds, or FLOPs (``timer="flops"``).
CostUnit = Literal["s", "flop"]
#: How a profile's lines that hold activations were measured (``ProfileData.steps``).
Steps = Literal["uniform", "pairs", "singles"]

#: What a step's peak is made of (the keys of :attr:`StepPeak.breakdown`, in this order).
PeakPart = Literal["static", "gradients", "optimizer", "activations"]

#: A term that never binds: the backward term of a block whose backward was never seen.
NEVER = -(2**62)


class Decision(str, enum.Enum):
    """What a block does with its activations in a plan (:mod:`remat.planner.apply`)."""

    KEEP = "keep"
    """Plain: autograd keeps what it saves."""
    RECOMPUTE = "recompute"
    """Checkpointed: only the inputs kept, the rest recomputed in backward."""
    SELECTIVE = "selective"
    """Checkpointed with the matmul outputs saved (:func:`remat.policies.save_matmuls`)."""
    OFFLOAD = "offload"
    """Saved tensors kept in host memory until backward."""
    SPLIT = "split"
    """Checkpointed, each child with parameters checkpointed again inside it."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def holds_inputs(self) -> bool:
        """Whether the block's region keeps its inputs until its backward (a checkpoint)."""
        return self in (Decision.RECOMPUTE, Decision.SELECTIVE, Decision.SPLIT)


#: The decisions as names of their own, for the modules that spell many of them.
KEEP, RECOMPUTE, SELECTIVE, OFFLOAD, SPLIT = (
    Decision.KEEP,
    Decision.RECOMPUTE,
    Decision.SELECTIVE,
    Decision.OFFLOAD,
    Decision.SPLIT,
)

#: Every decision, in the order profiles measure them.
DECISIONS: tuple[Decision, ...] = tuple(Decision)


def as_decisions(values: Sequence[str]) -> list[Decision]:
    """Decisions from their names (``"keep"``) or from decisions: the one conversion, where a
    public function takes them (:meth:`remat.Profile.peak`, :func:`remat.profile`'s
    ``decisions``); below it they travel as :class:`Decision` s.

    Example:
        >>> as_decisions(["keep", Decision.RECOMPUTE])
        ['keep', 'recompute']
    """
    return [Decision(v) for v in values]

#: How the blocks of a span run inside it: ``keep`` is one checkpoint over the whole span
#: (Chen et al.'s segments); ``recompute`` and ``split`` checkpoint each block inside it as
#: well (nested); ``selective`` runs each block under the selective policy inside it (the
#: policy's saved outputs are handed to the span, dropped in forward and brought back by
#: its recompute).
SPAN_INNER: tuple[Decision, ...] = (
    Decision.KEEP,
    Decision.RECOMPUTE,
    Decision.SELECTIVE,
    Decision.SPLIT,
)


@dataclasses.dataclass(frozen=True)
class Span:
    """Blocks ``first..last`` (indices, inclusive) as one checkpointed region; ``offloaded``:
    its input is kept in host memory until its own backward asks for it.

    It unpacks to its bounds: ``first, last = span``.
    """

    first: int
    last: int
    offloaded: bool = False

    def __iter__(self) -> Iterator[int]:
        yield self.first
        yield self.last

    @classmethod
    def of(cls, span: SpanLike) -> Span:
        """A span from a :class:`Span`, ``(first, last)`` or ``(first, last, offloaded)``."""
        if isinstance(span, Span):
            return span
        return cls(int(span[0]), int(span[1]), bool(span[2]) if len(span) > 2 else False)


#: A span as the step model's functions take it: a :class:`Span`, or ``(first, last)``.
SpanLike = Span | Sequence[int]


class SpanKind(enum.IntEnum):
    """A row of the chain's segment table: one block, a span, or a span whose input is
    offloaded."""

    BLOCK = 0
    SPAN = 1
    OFFLOADED = 2


class Phase(enum.Enum):
    """Where in a training step a term (or the peak) falls."""

    BEFORE_BLOCKS = "before the first block"
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    AFTER_BLOCKS = "after the last block (head, loss and their backward)"
    BEFORE_BLOCKS_BACKWARD = "backward of the layers before the first block"
    OPTIMIZER_FIRST = "optimizer.step() of the first step (optimizer state created)"
    OPTIMIZER_LATER = "optimizer.step() of later steps"


class WindowKind(enum.Enum):
    """The kinds of window a measured step is cut into, in the order they run; the phases of
    the step (:class:`Phase`) the step model's terms fall in are made of them: ``PRE`` is
    :attr:`Phase.BEFORE_BLOCKS`, ``FWD`` and ``BWD`` a block's :attr:`Phase.FORWARD` and
    :attr:`Phase.BACKWARD`, ``TOP`` :attr:`Phase.AFTER_BLOCKS`, ``POST``
    :attr:`Phase.BEFORE_BLOCKS_BACKWARD`, ``OPT`` the optimizer's step (first or later)."""

    PRE = "pre"  # before the first block's forward
    FWD = "fwd"  # a block's forward, and the model's code up to the next block
    TOP = "top"  # after the last block returned: head, loss and their backward
    BWD = "bwd"  # a block's backward
    POST = "post"  # the backward of the layers before the first block
    OPT = "opt"  # the optimizer's step
    END = "end"  # backward has returned (nothing is measured in it)


#: The kinds of window that belong to one block.
_PER_BLOCK = (WindowKind.FWD, WindowKind.BWD)


@dataclasses.dataclass(frozen=True)
class Window:
    """One window of the measured step: its kind, and for a block's forward or backward the
    block (its index in call order; ``-1`` otherwise).

    :attr:`label` names it in a profiler's events (:func:`~remat.planner.scratch.mark_window`)
    and :meth:`parse` reads such a name back: the one place a window is read from text."""

    kind: WindowKind
    block: int = -1

    def __post_init__(self) -> None:
        if (self.kind in _PER_BLOCK) != (self.block >= 0):
            raise ValueError(
                f"Window: a {self.kind.value!r} window takes a block index >= 0 exactly when it "
                f"is a block's forward or backward, got block={self.block}."
            )

    @property
    def label(self) -> str:
        """The window's name in a profiler's events: ``"fwd:3"``, ``"top"``."""
        return f"{self.kind.value}:{self.block}" if self.block >= 0 else self.kind.value

    @classmethod
    def parse(cls, label: str) -> Window:
        """The window :attr:`label` names."""
        kind, _, block = label.partition(":")
        return cls(WindowKind(kind), int(block) if block else -1)


@dataclasses.dataclass(frozen=True)
class Where:
    """A phase of the step, and the block it belongs to (forward, backward, recompute)."""

    phase: Phase
    block: str = ""

    def __str__(self) -> str:
        if self.phase is Phase.FORWARD:
            return f"forward of {self.block!r}"
        if self.phase is Phase.BACKWARD:
            return f"backward of {self.block!r}"
        if self.phase is Phase.RECOMPUTE:
            return f"recompute of {self.block!r} in the span's backward"
        return self.phase.value

    @property
    def movable(self) -> bool:
        """Whether a checkpointing plan can lower a peak here (not before the blocks, nor in
        the optimizer step)."""
        return self.phase not in (
            Phase.BEFORE_BLOCKS,
            Phase.BEFORE_BLOCKS_BACKWARD,
            Phase.OPTIMIZER_FIRST,
            Phase.OPTIMIZER_LATER,
        )


@dataclasses.dataclass
class BlockCosts:
    """Measured terms of one candidate block, per decision (the step model's input).

    The terms are defined in :mod:`remat.planner.stepmodel` (which derives them from the
    measured :class:`Timeline` s): ``retained[d]`` what the block leaves alive for the rest
    of the step, ``fwd_excess[d]`` / ``bwd_excess[d]`` the peaks of its forward / backward
    window above their starts, ``cost[d]`` the time (or FLOPs) the decision adds, and, under
    all-``keep``, ``fwd_start`` / ``bwd_start`` the bytes alive when its windows start.

    ``bwd_grads`` is the bytes of gradients alive at the end of the block's backward
    window under ``keep`` (for the peak's breakdown), ``noise`` the spread of the
    timing samples of each decision's cost (for near-ties).

    Where an autocast region ends between the last block's forward and its backward
    (:mod:`remat.planner.amp`), ``retained`` is what the block keeps into backward,
    ``exit_freed[d]`` what it also kept in forward until the region's end (autocast's
    cached casts of its weights, and the block inputs the model keeps to forward's end
    that the block under ``d`` does not keep on the device: ``held_to_end``), and the last
    block's ``pre_exit[d]`` the peak of the head and the loss before the end. Both are empty
    when neither happens.

    ``offload_input`` is the bytes a span starting at this block frees on the device by
    keeping its input in host memory, measured on a device where nothing else holds that
    input once the block returns; 0 elsewhere (such a span is not offered).

    ``held_to_end`` is the bytes of the block's inputs that the model's code keeps until
    forward returns and the kept block does not save: a checkpoint starting at this block
    holds them into backward.

    ``fwd_scratch`` / ``bwd_scratch`` are the most memory one operator of the block's forward
    / backward window allocates and frees inside (scratch, which the allocator counts and
    the tensor bytes do not: :mod:`remat.planner.scratch`), measured with every block kept.

    ``fwd_tail`` is the peak, above ``fwd_start``, of the part of the block's forward window
    after the block returned (the model's code before the next block), every block kept
    (``NEVER``: not measured): where a tensor handed to several blocks dies there
    (:class:`SharedInput`), a plan that holds it adds its bytes to this part only.
    """

    name: str = dataclasses.field(metadata=SAME)
    retained: dict[Decision, int] = dataclasses.field(metadata=MAX | FIT)
    fwd_excess: dict[Decision, int] = dataclasses.field(metadata=MAX | FIT)
    bwd_excess: dict[Decision, int] = dataclasses.field(metadata=MAX | FIT)
    cost: dict[Decision, float] = dataclasses.field(metadata=MAX | TIME)
    fwd_start: int = dataclasses.field(metadata=MAX | FIT)
    bwd_start: int = dataclasses.field(metadata=MAX | FIT)
    input_bytes: int = dataclasses.field(default=0, metadata=MAX | FIT)
    param_bytes: int = dataclasses.field(default=0, metadata=MAX | FIT)
    bwd_grads: int = dataclasses.field(default=0, metadata=MAX | FIT)
    noise: dict[Decision, float] = dataclasses.field(default_factory=dict, metadata=MAX | TIME)
    exit_freed: dict[Decision, int] = dataclasses.field(default_factory=dict, metadata=MAX | FIT)
    pre_exit: dict[Decision, int] = dataclasses.field(default_factory=dict, metadata=MAX | FIT)
    offload_input: int = dataclasses.field(default=0, metadata=MIN | FIT)
    held_to_end: int = dataclasses.field(default=0, metadata=MAX | FIT)
    fwd_scratch: int = dataclasses.field(default=0, metadata=MAX | BOUND)
    bwd_scratch: int = dataclasses.field(default=0, metadata=MAX | BOUND)
    fwd_tail: int = dataclasses.field(default=NEVER, metadata=MAX | FIT)

    def __post_init__(self) -> None:
        for f in ("retained", "fwd_excess", "bwd_excess", "cost", "noise", "exit_freed",
                  "pre_exit"):  # fmt: skip
            d = getattr(self, f)
            if any(not isinstance(k, Decision) for k in d):
                setattr(self, f, {Decision(k): v for k, v in d.items()})

    @property
    def decisions(self) -> list[Decision]:
        """The decisions this block was measured under (and may take)."""
        return [d for d in self.retained if d in self.cost]


@dataclasses.dataclass(frozen=True)
class SharedInput:
    """Tensors (their storages) handed to the blocks ``consumers`` that die in forward with
    every block kept, in the forward window ``dies`` (block ``dies``'s, after it returned;
    ``dies == n``, the number of blocks: after the last block, as forward returns): a
    position bias the first block of a stack makes and the others receive, a mask the model
    passes to a few blocks. A checkpoint of any consumer holds them into its backward, so
    under a plan they are alive, once, from ``dies`` on and in every backward window from
    the last consumer's down to the first checkpointed consumer's.

    ``key`` spells the consumers and ``dies`` (``"1,2,3>8"``): the profile keeps the bytes of
    every such tensor by it (tensors with the same consumers and death add up).

    Example:
        >>> g = SharedInput.of("1,2,3>8", 65536)
        >>> g.consumers, g.dies, g.key
        ((1, 2, 3), 8, '1,2,3>8')
    """

    consumers: tuple[int, ...]
    dies: int
    bytes: int

    @property
    def key(self) -> str:
        return f"{','.join(map(str, self.consumers))}>{self.dies}"

    @classmethod
    def of(cls, key: str, nbytes: int) -> SharedInput:
        blocks, _, dies = key.partition(">")
        return cls(tuple(int(j) for j in blocks.split(",")), int(dies), int(nbytes))


def shared_inputs(groups: dict[str, int]) -> list[SharedInput]:
    """The :class:`SharedInput` s of a profile's ``shared.inputs`` (:class:`SharedTerms`), in
    key order."""
    return [SharedInput.of(k, v) for k, v in sorted(groups.items()) if v]


@dataclasses.dataclass
class Timeline:
    """Bytes at the window boundaries of one measured step (every block under one decision).

    Filled by :mod:`remat.planner.probes`; bytes are counted from the step's start.
    ``bwd_start[i]`` is ``None`` when block ``i``'s backward was never seen (its outputs
    need no gradient).
    """

    pre_peak: int = 0
    #: The peak after the first block's backward (the backward of the layers before the
    #: blocks), from the first gradient of one of its inputs; ``None``: not seen (no input of
    #: the first block needs a gradient: block 0's backward window runs to the end).
    post_peak: int | None = None
    fwd_start: list[int] = dataclasses.field(default_factory=list)
    fwd_peak: list[int] = dataclasses.field(default_factory=list)
    top_start: int = 0
    top_peak: int = 0
    top_grads: int = 0
    bwd_start: list[int | None] = dataclasses.field(default_factory=list)
    bwd_peak: list[int] = dataclasses.field(default_factory=list)
    bwd_grads: list[int] = dataclasses.field(default_factory=list)
    end_bytes: int = 0
    end_grads: int = 0
    input_bytes: list[int] = dataclasses.field(default_factory=list)
    #: Where the caller's (or the model's) autocast region ended between the last block's
    #: forward and its backward (:mod:`remat.planner.amp`): the peak of the ``top`` window
    #: before the end (``None``: no region ended there; ``top_peak`` is then the whole
    #: window's, else the part after the end), and per block the bytes allocated in its
    #: forward window that the end freed (autocast's cached casts of its weights).
    top_pre_peak: int | None = None
    #: The ``top`` window's peak up to the model's forward return (after an autocast region's
    #: end where one ended before it), where a pair step recorded it (``None``: not recorded;
    #: ``top_peak`` is the whole window's either way).
    top_ret_peak: int | None = None
    #: Where a pair step recorded the model's return (``top_ret_peak``) and an autocast
    #: region ended after it (the loop's region, around forward and loss): the ``top``
    #: window's peak between the two (``top_pre_peak`` is then the larger of the two parts
    #: before the region's end, as a uniform step records it). ``None``: not recorded.
    top_mid_peak: int | None = None
    exit_freed: list[int] = dataclasses.field(default_factory=list)
    #: Per block but the last, the bytes of its outputs that the next block did not receive
    #: (the blocks are not one chain there: two towers), alive when the last block returns
    #: and dead when the block's backward starts (the model's head used them and freed
    #: them). Empty: not recorded.
    outputs_freed: list[int] = dataclasses.field(default_factory=list)
    #: Per block, the peak of its forward window after it returned (the model's code before
    #: the next block; the last block's window ends as it returns: its whole window's
    #: peak). Empty: not recorded.
    fwd_tail: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of the chain with its own decisions: one block, or a span of blocks.

    Every activation term of a segment is ``term - s`` where ``s`` is what the segments
    before it saved, so a segment is summed up by ``peak`` (its largest ``term``), where
    that is, ``saved`` (what it saves for the segments after it) and ``cost``.
    """

    first: int
    last: int
    decision: Decision
    kind: SpanKind
    peak: int
    where: Where
    saved: int
    cost: float

    @property
    def span(self) -> bool:
        """Whether the segment is a span (of two or more blocks)."""
        return self.kind is not SpanKind.BLOCK


@dataclasses.dataclass
class StepPeak:
    """The predicted peak of a training step, where it falls and what it is made of.

    Attributes:
        bytes: the peak (absolute: static bytes included).
        at: the phase (and block) where it falls.
        breakdown: ``static`` (parameters, buffers, inputs), ``gradients``,
            ``optimizer`` (state) and ``activations`` (the rest: saved tensors,
            outputs, temporaries) at the peak; they add up to ``bytes``.
    """

    bytes: int
    at: Where
    breakdown: dict[PeakPart, int]

    @property
    def where(self) -> str:
        """The phase in words (``"backward of 'layers.3'"``)."""
        return str(self.at)

    @property
    def movable(self) -> bool:
        """Whether a plan can lower it (not in the optimizer step nor before the blocks)."""
        return self.at.movable


@dataclasses.dataclass
class Measurements:
    """What :func:`remat.profile` measures: the whole raw record of its steps, before the
    step model reads terms from it (:func:`remat.planner.stepmodel.profile_data`).

    Attributes:
        names: the candidate blocks, in call order.
        decisions: the decisions measured.
        lines: per decision, the timeline of a step with every block under it.
        costs / noise: per decision and block, the median time (or FLOPs) of the block's
            forward and backward, and half the range of its samples.
        param_bytes: per block, its parameters' and buffers' bytes.
        signatures: per block, what makes two blocks the same layer (equal costs).
        freed: per block, the bytes of its output that the next block (kept) frees as it
            runs, and for the last block what the head frees.
        head_freed: per line whose step saw it (``keep``, ``offload``, ``selective``), the
            bytes of the last block's output that the head freed by the end of forward (under
            ``selective``: those its cache does not hold).
        held_to_end: per decision of :data:`~remat.planner.stepmodel.HELD_LINES`, per
            block, its inputs alive when its window ends that die when forward returns.
        offload_inputs: per block, the bytes of its input nothing else holds once it
            returns, whatever the block before does (0: not offered).
        held_before: per block, the bytes of its input that the ``offload`` line freed (the
            last block's: as the forward returned) but a kept or selective block before holds.
        mutating: blocks that change one of their input tensors in place.
        splittable: blocks with two or more children with parameters.
        shared_inputs: tensors handed to blocks that die in forward with every block kept
            (:class:`SharedInput`, by :attr:`SharedInput.key`).
        timer: the cost measure of ``costs`` (``"time"``, ``"measured"``, ``"flops"``).
        keep_cost: the time of a whole step with every block kept (0 with ``"flops"``).
        grad_bytes: bytes of the gradients at the memory steps' start.
        shared_bytes: bytes of the block inputs several blocks share (:class:`InputFrees`'s).
        optimizer: the optimizer's class name (``None``: none).
        optimizer_first_bytes / optimizer_later_bytes / optimizer_state_bytes: peaks inside
            the first and a later ``optimizer.step()``, and the state's bytes (a profile
            groups these as :class:`OptimizerTerms`, the shared ones as :class:`SharedTerms`).
        static_bytes: parameters, buffers, inputs (and DDP's buckets).
        grads_kept: whether the loop keeps its gradients (``set_to_none=False``).
        input_shapes: shapes of the tensor inputs.
        device: the device measured (from shapes: the one the meta tensors stand for).
        from_shapes: measured on meta tensors.
        compiled: the blocks compiled, each decision a partitioner budget, bytes the
            allocator's (:mod:`remat.planner.compiled`).
        steps: how the lines of the decisions that hold activations were measured:
            ``"uniform"``, ``"pairs"`` or ``"singles"`` (:mod:`remat.planner.grouped`).
        torch_version: the torch that ran the steps.
        chained / kept_outputs: as :class:`ProfileData` has them.
        scratch: the scratch inside operators per window of the step
            (:func:`~remat.planner.scratch.window_scratch`'s record; ``None``: not measured).
    """

    names: list[str]
    decisions: list[Decision]
    lines: dict[Decision, Timeline]
    costs: dict[Decision, dict[str, float]]
    noise: dict[Decision, dict[str, float]]
    param_bytes: list[int]
    signatures: list[object]
    freed: list[int]
    held_to_end: dict[Decision, list[int]]
    offload_inputs: list[int]
    held_before: list[int]
    mutating: set[str]
    splittable: set[str]
    shared_inputs: dict[str, int] = dataclasses.field(default_factory=dict)
    head_freed: dict[Decision, int] = dataclasses.field(default_factory=dict)
    timer: Timer = "time"
    keep_cost: float = 0.0
    grad_bytes: int = 0
    shared_bytes: int = 0
    optimizer: str | None = None
    optimizer_first_bytes: int = 0
    optimizer_later_bytes: int = 0
    optimizer_state_bytes: int = 0
    static_bytes: int = 0
    grads_kept: bool = False
    input_shapes: list[list[int]] = dataclasses.field(default_factory=list)
    device: str = ""
    from_shapes: bool = False
    compiled: bool = False
    steps: Steps = "uniform"
    torch_version: str = ""
    chained: list[bool] = dataclasses.field(default_factory=list)
    kept_outputs: list[bool] = dataclasses.field(default_factory=list)
    scratch: dict[Window, int] | None = None


@dataclasses.dataclass(frozen=True)
class ScratchTerms:
    """The scratch inside operators of a profile's step: the most memory one operator
    allocates and frees before it returns, which the allocator counts and :mod:`remat.memory`
    cannot (:mod:`remat.planner.scratch`). Each block's own windows are
    :attr:`BlockCosts.fwd_scratch` and :attr:`BlockCosts.bwd_scratch`.

    A kernel sizes its workspace by thresholds of its own: the shape fit bounds these terms
    (the larger of the sizes around, :attr:`Fit.BOUND`) and never fits them.

    Attributes:
        bytes: the largest of the step's forward and backward (every window's).
        located: whether it was measured per window of the step (``pre``, ``top``, ``post``
            and each block's): the step model then adds to each term the largest scratch of
            its window (:func:`~remat.planner.stepmodel.with_scratch`); otherwise ``bytes``
            to every term (profiles written before it was located).
        pre / top: the largest of one operator before the first block / between the last
            block's forward and its backward (head, loss and their backward).
        post: the largest in :attr:`ProfileData.post`'s window (the backward of the layers
            before the first block).
    """

    bytes: int = dataclasses.field(default=0, metadata=MAX | BOUND)
    located: bool = dataclasses.field(default=False, metadata=SAME)
    pre: int = dataclasses.field(default=0, metadata=MAX | BOUND)
    top: int = dataclasses.field(default=0, metadata=MAX | BOUND)
    post: int = dataclasses.field(default=0, metadata=MAX | BOUND)


@dataclasses.dataclass(frozen=True)
class OptimizerTerms:
    """The optimizer step of a profile's loop (all 0 without one).

    Attributes:
        name: the optimizer's class name, or ``None`` (no optimizer step modelled).
        state_bytes: the optimizer's state after its first step.
        first_bytes / later_bytes: peak bytes allocated inside the first / a later
            ``optimizer.step()`` (state creation included).
    """

    name: str | None = dataclasses.field(default=None, metadata=SAME)
    state_bytes: int = dataclasses.field(default=0, metadata=MAX | FIT)
    first_bytes: int = dataclasses.field(default=0, metadata=MAX | FIT)
    later_bytes: int = dataclasses.field(default=0, metadata=MAX | FIT)


@dataclasses.dataclass(frozen=True)
class SharedTerms:
    """Tensors handed to blocks that die in forward with every block kept, which a
    checkpointed block holds into its backward instead: one phenomenon, recorded in two
    disjoint parts by how the step model counts them.

    Attributes:
        bytes: those the model's forward makes and passes to two or more blocks (an attention
            mask, rotary tables), that die when the forward returns: a checkpointed block
            keeps them until its backward, and every later block's backward has them too
            (:func:`~remat.planner.stepmodel.checkpointed_view`).
        inputs: the bytes of the other storages handed to blocks that die in forward, by
            :attr:`SharedInput.key` (the blocks that received them and where they die; one
            block's input that dies in its own window is in that block's terms): a checkpoint
            of any of those blocks holds them into its backward, once however many do.
            :attr:`groups` reads them.
    """

    bytes: int = dataclasses.field(default=0, metadata=MAX | FIT)
    inputs: dict[str, int] = dataclasses.field(default_factory=dict, metadata=MAX | FIT)

    @property
    def groups(self) -> list[SharedInput]:
        """:attr:`inputs` as :class:`SharedInput` s (:func:`shared_inputs`)."""
        return shared_inputs(self.inputs)


#: Metadata of a :class:`ProfileData` field that holds a group of its terms
#: (:class:`ScratchTerms`, :class:`OptimizerTerms`, :class:`SharedTerms`): what reads the terms
#: by their metadata (the shape fit, the ranks' agreement) reads the group's fields as well,
#: named ``"<group>.<field>"`` (:func:`term_parts`).
GROUP = {"group": True}

#: The fields of profiles written before their terms were grouped, by group and field.
_FLAT = {
    "scratch_bytes": ("scratch", "bytes"),
    "scratch_located": ("scratch", "located"),
    "pre_scratch": ("scratch", "pre"),
    "top_scratch": ("scratch", "top"),
    "post_scratch": ("scratch", "post"),
    "optimizer": ("optim", "name"),
    "optimizer_state_bytes": ("optim", "state_bytes"),
    "optimizer_first_bytes": ("optim", "first_bytes"),
    "optimizer_later_bytes": ("optim", "later_bytes"),
    "shared_bytes": ("shared", "bytes"),
    "shared_inputs": ("shared", "inputs"),
}


@dataclasses.dataclass
class ProfileData:
    """The measured terms of a model's training step: what :func:`remat.plan` reads.

    Bytes are on the model's device (everything on CPU), as :mod:`remat.memory` counts them.
    :class:`remat.Profile` adds the step model's answers (the peak of a plan, the floor).

    The terms of one phenomenon are grouped (fields with :data:`GROUP` metadata): the
    scratch inside operators (``scratch``), the optimizer step (``optim``) and the tensors
    handed to blocks that a checkpoint holds (``shared``). Every numeric field, grouped or
    not, says how ranks agree over it and what the shape fit does with it (fits it exactly,
    bounds it, or times: :class:`Fit`).

    Attributes:
        blocks: one :class:`BlockCosts` per candidate block, in call order.
        top: peak bytes (from the step's start) between the last block's forward and
            its backward (all ``keep``).
        pre: peak bytes before the first block's forward.
        decisions: the decisions that were measured.
        cost_unit: ``"s"`` or ``"flop"``.
        input_shapes: shapes of the tensor inputs the profile is valid for.
        device: where it was measured.
        torch_version: the torch it was measured with.
        step_cost: cost of one whole step with every block kept, in ``cost_unit``
            (so that ``1 + plan.predicted_overhead_s / step_cost`` is a predicted time ratio).
        static_bytes: parameters, buffers and inputs.
        grad_bytes: the gradients of one step.
        grads_kept: ``True`` when the step starts with its gradients allocated
            (``zero_grad(set_to_none=False)``, gradient accumulation).
        optim: the optimizer step (:class:`OptimizerTerms`: its name, state and peaks).
        end_bytes / end_grads: bytes alive when backward returns (from the step's
            start), and how many of them are gradients.
        top_grads: gradient bytes alive at the end of the ``top`` window.
        chained: for each block but the last, whether the next block received a tensor
            this one returned (no code of the model between them): the blocks a span
            may join. Empty (not recorded): no spans.
        scratch: the scratch inside operators (:class:`ScratchTerms`: the largest, and
            per window of the step where it was located); :attr:`scratch_bytes` is its
            largest.
        post: the peak (from the step's start) of the backward of the layers before the
            first block, once the first block's backward is done (the blocks' activations
            are freed by then, whatever the plan: a term no plan moves); 0 where block 0's
            backward window runs to the end of backward (profiles before it was split, or
            no input of the first block needs a gradient).
        kept_outputs: for each block, whether the model's own code still referenced its
            output when the block after next started (a skip connection, a list of hidden
            states): a span may not hold it and the two blocks after it together (it would
            refuse the model at run time). Seen in one forward without gradients, where
            only the model's code keeps tensors. Empty: not recorded (no such limit).
        shared: tensors handed to blocks that die in forward with every block kept
            (:class:`SharedTerms`): a checkpointed block holds them into its backward.
        from_shapes: measured from shapes alone (a model on the meta device,
            :mod:`remat.planner.meta`), for ``device``: every tensor's bytes as on it, the
            scratch inside operators not seen (0 unless measured since, ``scratch.located``).
        compiled: each block compiled on its own, a decision the partitioner's budget
            (:mod:`remat.planner.regional`); every byte term the allocator's, scratch inside
            kernels included (``scratch`` is empty).
        steps: how the lines of ``keep``, ``selective`` and ``split`` were measured: in
            ``"uniform"`` steps (every block under the decision), or assembled from
            ``"pairs"`` or ``"singles"`` (two blocks, or one, under it: a real model whose
            unchecked step is not run, :mod:`remat.planner.grouped`).
    """

    blocks: list[BlockCosts]
    top: int = dataclasses.field(metadata=MAX | FIT)
    decisions: list[Decision] = dataclasses.field(metadata=SAME)
    cost_unit: CostUnit = dataclasses.field(metadata=SAME)
    input_shapes: list[list[int]] = dataclasses.field(metadata=SAME)
    device: str = ""
    torch_version: str = ""
    step_cost: float = dataclasses.field(default=0.0, metadata=MAX | TIME)
    pre: int = dataclasses.field(default=0, metadata=MAX | FIT)
    static_bytes: int = dataclasses.field(default=0, metadata=MAX | FIT)
    grad_bytes: int = dataclasses.field(default=0, metadata=MAX | FIT)
    grads_kept: bool = dataclasses.field(default=False, metadata=SAME)
    optim: OptimizerTerms = dataclasses.field(default_factory=OptimizerTerms, metadata=GROUP)
    end_bytes: int = dataclasses.field(default=0, metadata=MAX | FIT)
    end_grads: int = dataclasses.field(default=0, metadata=MAX | FIT)
    top_grads: int = dataclasses.field(default=0, metadata=MAX | FIT)
    chained: list[bool] = dataclasses.field(default_factory=list, metadata=SAME)
    scratch: ScratchTerms = dataclasses.field(default_factory=ScratchTerms, metadata=GROUP)
    kept_outputs: list[bool] = dataclasses.field(default_factory=list, metadata=SAME)
    shared: SharedTerms = dataclasses.field(default_factory=SharedTerms, metadata=GROUP)
    post: int = dataclasses.field(default=0, metadata=MAX | FIT)
    from_shapes: bool = dataclasses.field(default=False, metadata=SAME)
    compiled: bool = dataclasses.field(default=False, metadata=SAME)
    steps: Steps = dataclasses.field(default="uniform", metadata=SAME)

    def __post_init__(self) -> None:
        self.decisions = [Decision(d) for d in self.decisions]
        self.blocks = [b if isinstance(b, BlockCosts) else BlockCosts(**b) for b in self.blocks]
        # a group read from JSON is a dict
        if isinstance(self.optim, dict):
            self.optim = OptimizerTerms(**self.optim)
        if isinstance(self.scratch, dict):
            self.scratch = ScratchTerms(**self.scratch)
        if isinstance(self.shared, dict):
            self.shared = SharedTerms(**self.shared)

    @property
    def scratch_bytes(self) -> int:
        """The largest scratch inside operators of the step (``scratch.bytes``; the name
        profiles had before the scratch terms were grouped, kept for code that reads it)."""
        return self.scratch.bytes

    @property
    def step_start(self) -> dict[PeakPart, int]:
        """What a later step starts with, by part: ``static`` (parameters, buffers, inputs),
        ``gradients`` (kept ones: ``grads_kept``) and ``optimizer`` (its state); the step
        model's one formula of it (:attr:`static_step_bytes` is their sum)."""
        return {
            "static": self.static_bytes,
            "gradients": self.grad_bytes if self.grads_kept else 0,
            "optimizer": self.optim.state_bytes,
        }

    @property
    def static_step_bytes(self) -> int:
        """Bytes a later step starts with: static, kept gradients, optimizer state."""
        return sum(self.step_start.values())

    @property
    def spans_may_join(self) -> list[bool]:
        """``chained`` for every pair of neighbours (all ``False`` when not recorded)."""
        n = max(len(self.blocks) - 1, 0)
        return list(self.chained) if len(self.chained) == n else [False] * n

    @property
    def outputs_kept(self) -> list[bool] | None:
        """``kept_outputs`` when recorded for every block, else ``None`` (no limit)."""
        ok = len(self.kept_outputs) == len(self.blocks)
        return list(self.kept_outputs) if ok and self.blocks else None

    def to_json(self) -> str:
        """Plain JSON, each group of terms an object of its own (``"scratch": {"bytes": ...}``)."""
        data = dataclasses.asdict(self)
        if not self.compiled:  # eager profiles read as before
            del data["compiled"]
        if self.steps == "uniform":  # profiles of uniform steps read as before
            del data["steps"]
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Self:
        """Read a profile written by :meth:`to_json`, or by a version that wrote every term
        at the top (``"scratch_bytes"``, ``"optimizer"``, ``"shared_inputs"``, ...): those
        are read into their groups."""
        data = json.loads(text)
        for flat, (group, name) in _FLAT.items():
            if flat in data:
                data.setdefault(group, {})[name] = data.pop(flat)
        return cls(**data)

    def save(self, path: str) -> None:
        """Write the profile to ``path`` as JSON."""
        with open(path, "w") as fh:
            fh.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> Self:
        """Read a profile saved with :meth:`save`."""
        with open(path) as fh:
            return cls.from_json(fh.read())


def _groups(prof: ProfileData) -> list[str]:
    return [f.name for f in dataclasses.fields(prof) if f.metadata.get("group")]


def term_parts(prof: ProfileData) -> list[tuple[str, Any]]:
    """The dataclasses that hold ``prof``'s terms, each with the prefix of their names: the
    profile itself (``""``), each of its groups (:data:`GROUP`: ``"scratch."``) and each block
    (``"blocks.0."``: its name), in that order. No number of a group is named as one of
    :class:`BlockCosts`, so a block named as a group (``"shared"``) names no term twice.

    Example:
        >>> from remat.planner.types import ProfileData, term_parts
        >>> prof = ProfileData(blocks=[], top=0, decisions=[], cost_unit="s", input_shapes=[])
        >>> [prefix for prefix, _ in term_parts(prof)]
        ['', 'optim.', 'scratch.', 'shared.']
    """
    return [
        ("", prof),
        *((f"{g}.", getattr(prof, g)) for g in _groups(prof)),
        *((f"{b.name}.", b) for b in prof.blocks),
    ]


P = TypeVar("P", bound=ProfileData)


def with_parts(prof: P, make: Callable[[str, Any], Any]) -> P:
    """A copy of ``prof`` with each part of :func:`term_parts` replaced by ``make(prefix,
    part)``, called in that order (the profile's own first: a copy of it with its fields
    replaced, whose groups and blocks are then replaced in turn)."""
    made = [make(prefix, part) for prefix, part in term_parts(prof)]
    groups = _groups(prof)
    n = 1 + len(groups)
    return dataclasses.replace(  # type: ignore[no-any-return]
        made[0], **dict(zip(groups, made[1:n])), blocks=made[n:]
    )


@dataclasses.dataclass(init=False)
class PlanData:
    """One decision per candidate block, with what the step model predicts for it.

    Bytes are absolute: the peak of one training step of the default loop
    (parameters, buffers, inputs, gradients, optimizer state and activations).
    ``predicted_peak_bytes`` counts tensor storages, as :mod:`remat.memory` measures
    them; the allocator (``torch.cuda.max_memory_allocated()``) also counts the
    scratch memory operators free before they return, at most ``scratch_bytes`` more.
    A plan keeps ``predicted_peak_bytes + scratch_bytes`` within ``budget_bytes`` (the
    scratch counted in the window of the step it happens in).
    :class:`remat.Plan` adds the table (``str(plan)``) and :meth:`~remat.Plan.apply`.

    Attributes:
        decisions: block name -> ``keep`` / ``recompute`` / ``selective`` / ``offload`` /
            ``split`` (:class:`Decision`).
        predicted_peak_bytes: predicted peak of a step under this plan (first and
            later steps).
        predicted_overhead_s: predicted added time per step (FLOPs when the
            profile was made with ``timer="flops"``; see ``cost_unit``).
        unchecked_peak_bytes: predicted peak with every block kept.
        budget_bytes: the budget the plan was made for.
        saved_bytes: block name -> bytes the decision saves at the peak.
        added_cost: block name -> time (or FLOPs) the decision adds.
        cost_unit: ``"s"`` or ``"flop"``.
        static_bytes: parameters, buffers and inputs.
        peak_at: where the predicted peak falls, in words (``"backward of 'layers.0'"``,
            ``"optimizer.step() of the first step (optimizer state created)"``, ...).
        breakdown: the peak split into ``static``, ``gradients``, ``optimizer``
            and ``activations``.
        peak_movable: ``False`` when no plan can lower the peak (it is in the
            optimizer step or before the first block).
        block_spans: each region that spans consecutive blocks, as a :class:`Span`
            (indices into ``decisions``' order, and whether its input is offloaded): one
            checkpointed region whose blocks run inside it as their decision says
            (``keep``: plain, one checkpoint over the span as in Chen et al.'s segments;
            ``recompute`` or ``split``: checkpointed inside it too; ``selective``: the
            policy's saved outputs handed to the span). The spans are stored only so;
            :attr:`spans` and :attr:`offloaded_spans` render their names.
        spans: (read-only) ``[first, last]`` block names of each of ``block_spans``; as
            an argument (and in the JSON), the spans by these names.
        scratch_bytes: what scratch inside operators adds to the predicted peak (at most
            ``Profile.scratch.bytes``, the largest): each term of the step model with the
            largest scratch of its window, the largest of them is ``predicted_peak_bytes +
            scratch_bytes``, which the plan keeps within the budget.
        offloaded_spans: (read-only) the spans (of ``spans``) whose input is kept in host
            memory until their own backward asks for it (on a device:
            ``apply_span(offload_inputs=True, prefetch=False)``); as an argument (and in
            the JSON), those spans by their names.
        peak_phase: the phase of the step where the peak falls (``peak_at`` in words).
        block_share: the share of the unchecked step's activations the blocks keep
            (:func:`~remat.planner.stepmodel.block_share`); the table names the blocks
            with it and warns when it is small. ``None``: not known.
        diagnostics: boundary warnings that apply to this plan on its model
            (:class:`remat.Diagnostic`: a block the plan checkpoints that is checkpointed
            already, a peak in the loss head that no plan of the blocks lowers); the
            table prints them under the blocks.
        scratch_unknown: planned from shapes alone (``Profile.from_shapes``) with no scratch
            inside operators measured: ``predicted_peak_bytes`` is the tensors' peak and the
            allocator's adds what the device's kernels take; the table says so.
        compiled: each block compiled on its own at the partitioner's budget its decision
            means (:mod:`remat.planner.regional`); :meth:`~remat.Plan.apply` compiles them.
    """

    decisions: dict[str, Decision]
    predicted_peak_bytes: int
    predicted_overhead_s: float
    unchecked_peak_bytes: int
    budget_bytes: int
    saved_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    added_cost: dict[str, float] = dataclasses.field(default_factory=dict)
    cost_unit: CostUnit = "s"
    static_bytes: int = 0
    peak_at: str = ""
    breakdown: dict[PeakPart, int] = dataclasses.field(default_factory=dict)
    peak_movable: bool = True
    scratch_bytes: int = 0
    peak_phase: Phase | None = None
    block_share: float | None = None
    diagnostics: list[Diagnostic] = dataclasses.field(default_factory=list)
    scratch_unknown: bool = False
    compiled: bool = False
    block_spans: list[Span] = dataclasses.field(default_factory=list)

    # Written out (not generated) so that it takes the spans by name, as plans made before
    # they were stored as Spans were built and read (positional arguments as then); names
    # given win over ``block_spans`` (``dataclasses.replace(plan, spans=[])`` drops them).
    def __init__(
        self,
        decisions: Mapping[str, str],
        predicted_peak_bytes: int,
        predicted_overhead_s: float,
        unchecked_peak_bytes: int,
        budget_bytes: int,
        saved_bytes: dict[str, int] | None = None,
        added_cost: dict[str, float] | None = None,
        cost_unit: CostUnit = "s",
        static_bytes: int = 0,
        peak_at: str = "",
        breakdown: dict[PeakPart, int] | None = None,
        peak_movable: bool = True,
        spans: Sequence[Sequence[str]] | None = None,
        scratch_bytes: int = 0,
        offloaded_spans: Sequence[Sequence[str]] | None = None,
        peak_phase: Phase | str | None = None,
        block_share: float | None = None,
        diagnostics: Sequence[Diagnostic | dict[str, str]] = (),
        scratch_unknown: bool = False,
        block_spans: Sequence[Span] = (),
        compiled: bool = False,
    ) -> None:
        bad = sorted(str(d) for d in decisions.values() if d not in _NAMES)
        if bad:
            raise PlanError(
                f"Plan: unknown decisions {bad}; expected {[d.value for d in Decision]}."
            )
        self.decisions = {n: Decision(d) for n, d in decisions.items()}
        self.predicted_peak_bytes = predicted_peak_bytes
        self.predicted_overhead_s = predicted_overhead_s
        self.unchecked_peak_bytes = unchecked_peak_bytes
        self.budget_bytes = budget_bytes
        self.saved_bytes = {} if saved_bytes is None else saved_bytes
        self.added_cost = {} if added_cost is None else added_cost
        self.cost_unit = cost_unit
        self.static_bytes = static_bytes
        self.peak_at = peak_at
        self.breakdown = {} if breakdown is None else breakdown
        self.peak_movable = peak_movable
        self.scratch_bytes = scratch_bytes
        self.peak_phase = Phase[peak_phase] if isinstance(peak_phase, str) else peak_phase
        self.block_share = block_share
        self.diagnostics = [
            d if isinstance(d, Diagnostic) else Diagnostic(Kind[d["kind"]], d["module"], d["message"])
            for d in diagnostics
        ]
        self.scratch_unknown = scratch_unknown
        self.compiled = compiled
        if spans is None and offloaded_spans is None:
            self.block_spans = list(block_spans)
        else:
            self.block_spans = self._spans_named(spans or [], offloaded_spans or [])

    def _spans_named(
        self, spans: Sequence[Sequence[str]], offloaded: Sequence[Sequence[str]]
    ) -> list[Span]:
        """The :class:`Span` s of spans given by their first and last blocks' names (those
        whose first block starts one of ``offloaded`` with their input offloaded)."""
        index = {n: i for i, n in enumerate(self.decisions)}
        moved = {first for first, _ in offloaded}
        unknown = sorted({n for sp in spans for n in sp if n not in index})
        if unknown:
            raise PlanError(
                f"Plan: spans name blocks {unknown} that have no decision; name a span by its "
                "first and last blocks, both keys of decisions."
            )
        return [Span(index[a], index[z], a in moved) for a, z in spans]

    @property
    def spans(self) -> list[list[str]]:
        """``[first, last]`` block names of each span (:attr:`block_spans`, rendered)."""
        names = list(self.decisions)
        return [[names[sp.first], names[sp.last]] for sp in self.block_spans]

    @property
    def offloaded_spans(self) -> list[list[str]]:
        """``[first, last]`` block names of each span whose input is offloaded."""
        names = list(self.decisions)
        return [[names[sp.first], names[sp.last]] for sp in self.block_spans if sp.offloaded]

    def members(self, span: Span) -> list[str]:
        """The names of the blocks of ``span`` (one of :attr:`block_spans`), in order."""
        return list(self.decisions)[span.first : span.last + 1]

    def to_json(self) -> str:
        """Plain JSON (no pickle): the spans by their blocks' names, as plans always wrote
        them."""
        data = dataclasses.asdict(self)
        del data["block_spans"]
        data["spans"] = self.spans
        data["offloaded_spans"] = self.offloaded_spans
        data["peak_phase"] = None if self.peak_phase is None else self.peak_phase.name
        data["diagnostics"] = [
            {"kind": d.kind.name, "module": d.module, "message": d.message}
            for d in self.diagnostics
        ]
        keys = _PLAN_JSON + (("compiled",) if self.compiled else ())  # eager: as before
        return json.dumps({k: data[k] for k in keys}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Self:
        """Read a plan written by :meth:`to_json` (the JSON text; a file: :meth:`load`).

        Raises:
            PlanError: the text is not JSON (the path of a file: says to call
                :meth:`load`), or has fields or decisions this version does not know.
        """
        try:
            data = json.loads(text)
        except ValueError as e:
            hint = (
                f" {text!r} is a file: read it with Plan.load({text!r})."
                if len(text) < 4096 and os.path.isfile(text)
                else " Pass the text Plan.to_json() wrote, or a file's path to Plan.load(path)."
            )
            raise PlanError(f"Plan.from_json: the text is not JSON ({e}).{hint}") from None
        if not isinstance(data, dict):
            raise PlanError(
                f"Plan.from_json: expected a JSON object, got {type(data).__name__}; pass the "
                "text Plan.to_json() wrote."
            )
        unknown = sorted(set(data) - set(_PLAN_JSON) - {"compiled"})
        if unknown:
            raise PlanError(
                f"Plan.from_json: unknown fields {unknown}; the JSON was not written by "
                "Plan.to_json of this remat version."
            )
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan to ``path`` as JSON (:meth:`to_json`); :meth:`load` reads it back."""
        with open(path, "w") as fh:
            fh.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Self:
        """Read a plan from a JSON file written by :meth:`save` (or ``remat plan --json``).

        Example:
            >>> import os, tempfile, remat
            >>> plan = remat.Plan(decisions={"blocks.0": "recompute"}, predicted_peak_bytes=1,
            ...                   predicted_overhead_s=0.0, unchecked_peak_bytes=2, budget_bytes=1)
            >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
            >>> plan.save(path)
            >>> remat.Plan.load(path) == plan
            True

        Raises:
            OSError: the file cannot be read (``FileNotFoundError`` when it is missing).
            PlanError: the file is not a plan's JSON, naming the file.
        """
        with open(path) as fh:
            text = fh.read()
        try:
            return cls.from_json(text)
        except PlanError as e:
            raise PlanError(
                f"Plan.load({os.fspath(path)!r}): {str(e).removeprefix('Plan.from_json: ')}"
            ) from None


_NAMES = {d.value for d in Decision}

#: The fields of a plan's JSON, in the order :meth:`PlanData.to_json` writes them.
_PLAN_JSON = (
    "decisions",
    "predicted_peak_bytes",
    "predicted_overhead_s",
    "unchecked_peak_bytes",
    "budget_bytes",
    "saved_bytes",
    "added_cost",
    "cost_unit",
    "static_bytes",
    "peak_at",
    "breakdown",
    "peak_movable",
    "spans",
    "scratch_bytes",
    "offloaded_spans",
    "peak_phase",
    "block_share",
    "diagnostics",
    "scratch_unknown",
)
