"""A decision's uniform line from steps that hold two blocks under it at a time.

A profile measures, per decision, one step with every block under it (its *line*: a
:class:`~remat.planner.types.Timeline`). Under ``keep`` that step is the unchecked one: the
step that does not fit, for the user the planner exists for. Where a profile cannot be made
from shapes (the model reads tensor values, or a process group runs it) and its batch is too
small to fit from smaller batches (:mod:`remat.planner.shaped`), the lines of the decisions
that hold activations (``keep``, ``selective``, ``split``) are assembled instead from *pair
steps*: step ``i`` (``1 <= i < n``) runs blocks ``i - 1`` and ``i`` under the decision and
every other block recomputed, so it holds what the recomputed line holds and two blocks'
activations, not the whole model's.

Block ``i``'s terms come from step ``i`` (block 0's from step 1), where the block before it
is under the same decision as in the uniform line (what it saves of block ``i``'s input is
the same), and block ``i``'s own window is measured as it is in that line:

- forward: what the block leaves alive (from its window's start to the next's), its peak and
  its tail above its window's start; the uniform line's window starts are their running sum
  from the first block's start (the same in every step);
- backward: the bytes at the start of block ``i``'s backward in step ``i``, plus, for every
  block before it, what it holds into backward in the uniform line less what it held in step
  ``i`` (*holds into backward*: what it left alive in forward, less what died as forward
  returned: its inputs the model's code held (``held_to_end``), the outputs the head freed
  (``Timeline.outputs_freed``) and the casts an autocast region's end freed
  (``Timeline.exit_freed``)); its peak and gradients above that start as measured;
- the head (``top``) from the last step, above the uniform line's start of it.

The pair effects the step model reads from the uniform ``keep`` step
(:class:`~remat.planner.probes.InputFrees`) are read in the pair step that has the pair
under ``keep``: what block ``i + 1`` frees of block ``i``'s output in step ``i + 1``, block
``i``'s inputs held to the end of forward in step ``i``.

A storage handed to several blocks (a mask or rotary tables each layer receives, a bias one
block returns to the next) is held into backward by the recomputed blocks of a pair step,
where the uniform ``keep`` line may free it as forward returns. Where it lives with every
block kept is read in one forward whose saved tensors are recorded and dropped
(:func:`~remat.planner.probes.keep_lifetimes`: :class:`KeptShared`), and the ``keep`` line's
backward windows and its last window after the model's return (which pair steps record
apart: ``Timeline.top_ret_peak``, and from the end of an autocast region after it, the
loop's: ``Timeline.top_mid_peak``) count it as there; one that dies in a forward window
with every block kept (T5's position bias, as the encoder returns) leaves that window's
block that much less alive. With an autocast region that ends inside the model's forward
(before its return) too, the model is not profiled from pair steps (:class:`NotPaired`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .types import Decision, Timeline

if TYPE_CHECKING:
    from .solve import Profile

#: The decisions whose lines are assembled from pair steps (the others hold no more than
#: their inputs on the device: ``recompute``, and ``offload`` once its copies are done).
PAIRED = (Decision.KEEP, Decision.SELECTIVE, Decision.SPLIT)


class NotPaired(Exception):
    """A model whose lines pair steps cannot assemble (the reason in its message)."""


def pair_patterns(
    n: int, d: Decision, fixed: dict[int, Decision], single: bool = False
) -> list[list[Decision]]:
    """The decisions of the blocks in each pair step of ``d`` for ``n`` blocks: step ``i``
    (``i = 1 .. n - 1``, the list's ``i - 1``-th) has blocks ``i - 1`` and ``i`` under ``d``,
    every other block recomputed, but the blocks of ``fixed`` (index to decision: a block
    that changes its input in place is kept in every line). ``single``: step ``i`` (``i =
    0 .. n - 1``) has block ``i`` alone under ``d`` (see :func:`single_steps`).

    Example:
        >>> [[x.value[0] for x in p] for p in pair_patterns(3, Decision.KEEP, {})]
        [['k', 'k', 'r'], ['r', 'k', 'k']]
        >>> [[x.value[0] for x in p] for p in pair_patterns(2, Decision.KEEP, {}, single=True)]
        [['k', 'r'], ['r', 'k']]
    """
    out = []
    for i in range(0 if single else 1, n):
        under = (i,) if single else (i - 1, i)
        pattern = [d if j in under else Decision.RECOMPUTE for j in range(n)]
        for j, fx in fixed.items():
            pattern[j] = fx
        out.append(pattern)
    return out


def pair_peak(prof: Profile) -> int:
    """The largest predicted peak of the pair steps of ``prof``'s decisions (those that a
    profile from pair steps ran; single steps' where ``prof.steps`` says so), by the step
    model.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
        >>> prof = remat.profile(model, torch.randn(4, 8), timer="flops")
        >>> pair_peak(prof) >= prof.floor_bytes  # a selective cache may hold more than keep
        True
    """
    n = len(prof.blocks)
    fixed = {i: Decision.KEEP for i, b in enumerate(prof.blocks) if set(b.cost) == {"keep"}}
    peaks = [
        prof.peak(
            [x.value if x.value in b.cost else "recompute" for x, b in zip(pattern, prof.blocks)]
        ).bytes
        for d in PAIRED
        if d.value in prof.decisions
        for pattern in pair_patterns(n, d, fixed, prof.steps == "singles")
    ]
    return max(peaks, default=prof.unchecked_peak_bytes)


def step_of(i: int, single: bool = False) -> int:
    """The pair step (its index in :func:`pair_patterns`' list) whose block ``i`` is the
    measured one: the step of blocks ``i - 1`` and ``i``, block 0's the step of blocks 0 and 1
    (``single``: block ``i``'s own step).

    Example:
        >>> [step_of(i) for i in range(4)], [step_of(i, single=True) for i in range(4)]
        ([0, 0, 1, 2], [0, 1, 2, 3])
    """
    return i if single else max(i, 1) - 1


def single_steps(saved: dict[Role, int], fixed: dict[int, Decision]) -> bool:
    """Whether a model's lines may be assembled from *single* steps (block ``i`` alone under
    the decision, one block's activations above the recomputed line instead of two): where
    no block saves for backward a storage a later block receives (``saved``: by role, the
    first place that saved it with every block kept, :func:`~.probes.keep_lifetimes`; a
    storage handed to several blocks counted where it lives as :class:`KeptShared` says)
    and no block changes its input in place (``fixed``). A pair step exists for what the
    block before saves of a block's input (a ReLU's output, a tanh's that the next block
    receives): with none, the block before is recomputed in block ``i``'s single step and
    block ``i``'s terms are those of the pair (on 21 families of
    ``tests/planner/test_paired.py``; ResNet's and the tuple blocks' are such pairs).

    Example:
        >>> single_steps({(1, 0): 0}, {}), single_steps({(1, 0): 1, (2, 0): -1}, {})
        (False, True)
    """
    if fixed:
        return False
    return not any(0 <= place < role[0] for role, place in saved.items())


Role = tuple[int, int]


@dataclasses.dataclass
class PairStep:
    """One pair step's record: its timeline, and per block what died as forward returned of
    what it left alive (its inputs the model's code held to then: ``held_to_end``, from
    :class:`~remat.planner.probes.InputFrees`, the storages handed to several blocks left
    out); and, by role (:class:`~remat.planner.probes.SharedArgs`), the bytes of those
    storages alive as each block's backward started (``alive_bwd``) and as the model's
    forward returned (``alive_return``)."""

    line: Timeline
    held_to_end: list[int]
    alive_bwd: list[dict[Role, int]] = dataclasses.field(default_factory=list)
    alive_return: dict[Role, int] = dataclasses.field(default_factory=dict)
    #: by role, the forward window each died in (``n``: as the forward returned)
    died: dict[Role, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class KeptShared:
    """Where the storages handed to several blocks live with every block kept (from
    :func:`~remat.planner.probes.keep_lifetimes`): by role, their bytes, the first place
    that saved each for backward (a block's index, -1 before the blocks, ``n`` after them)
    and those alive as the model's forward returned (its output or state holds them)."""

    n: int
    nbytes: dict[Role, int]
    saved: dict[Role, int]
    held: set[Role]
    #: by role, the forward window each died in (``n``: as the forward returned)
    died: dict[Role, int] = dataclasses.field(default_factory=dict)

    def dies_in(self, r: Role) -> int | None:
        """The forward window role ``r``'s storage dies in with every block kept (``n``: as
        the forward returns; ``None``: it lives into backward)."""
        if not self.dead(r):
            return None
        return self.died.get(r, self.n)

    def early(self) -> list[Role]:
        """The roles whose storages die before the forward returns."""
        return [r for r in self.nbytes if self.window(r) < self.n]

    def alive_bwd(self, i: int) -> int:
        """Their bytes alive as block ``i``'s backward starts: held, or saved by a block at
        or before ``i`` (or before the blocks)."""
        return sum(
            b for r, b in self.nbytes.items() if r in self.held or self.saved.get(r, self.n) <= i
        )

    def alive_return(self) -> int:
        """Their bytes alive once the model's forward returned: held, or saved anywhere."""
        return sum(b for r, b in self.nbytes.items() if r in self.held or r in self.saved)

    def late(self, alive: dict[Role, int], before: int | None = None) -> int:
        """The bytes of ``alive`` (a pair step's, by role) but those of roles that die
        with every block kept in a forward window before ``before`` (default: before the
        forward returns), which the running sums of the windows have dead already."""
        end = self.n if before is None else before
        return sum(b for r, b in alive.items() if self.window(r) >= end)

    def window(self, r: Role) -> int:
        """The forward window role ``r``'s storage dies in with every block kept (``n``: as
        the forward returns or later)."""
        w = self.dies_in(r)
        return self.n if w is None else w

    def dead(self, r: Role) -> bool:
        """Whether role ``r``'s storage dies as the forward returns (nothing saved it)."""
        return r not in self.held and r not in self.saved


def _next_start(t: Timeline, i: int) -> int:
    return t.fwd_start[i + 1] if i + 1 < len(t.fwd_start) else t.top_start


def _left(t: Timeline, i: int) -> int:
    """What block ``i`` left alive in forward in ``t``: its window's start to the next's."""
    return _next_start(t, i) - t.fwd_start[i]


def _into_backward(s: PairStep, i: int) -> int:
    """What block ``i`` holds into backward in step ``s`` (see the module docstring)."""
    t = s.line
    out = _left(t, i) - s.held_to_end[i]
    if t.exit_freed:
        out -= t.exit_freed[i]
    if i < len(t.outputs_freed):
        out -= t.outputs_freed[i]
    return out


def assemble(
    steps: Sequence[PairStep], kept: KeptShared | None = None, single: bool = False
) -> Timeline:
    """The uniform line of the decision whose pair steps (in :func:`pair_patterns`' order)
    are ``steps`` (see the module docstring).

    Example (two blocks: the one pair step is the uniform line):
        >>> t = Timeline(fwd_start=[10, 30], fwd_peak=[40, 60], top_start=50, top_peak=70,
        ...              bwd_start=[45, 60], bwd_peak=[55, 75], bwd_grads=[4, 2],
        ...              input_bytes=[8, 8], outputs_freed=[0], fwd_tail=[30, 50])
        >>> assemble([PairStep(t, [0, 0])]) == t
        True
    """
    first = steps[0].line
    n = len(first.fwd_start)
    mine = [steps[step_of(i, single)] for i in range(n)]
    v = dataclasses.replace(
        first,
        fwd_start=[0] * n,
        fwd_peak=[0] * n,
        fwd_tail=[0] * n if first.fwd_tail else [],
        bwd_start=[None] * n,
        bwd_peak=[0] * n,
        bwd_grads=[0] * n,
        outputs_freed=[mine[i].line.outputs_freed[i] for i in range(n - 1)]
        if first.outputs_freed
        else [],
        exit_freed=[mine[i].line.exit_freed[i] for i in range(n)] if first.exit_freed else [],
    )
    # with every block kept, a storage handed to several blocks that dies in block w's
    # window, where block w's pair step holds it on (its recomputed blocks): block w leaves
    # that much less alive (its window's peaks as measured: the storage dies after them)
    dying = [0] * n
    if kept is not None:
        for r in kept.early():
            w = kept.window(r)
            if mine[w].died.get(r) != w:
                dying[w] += kept.nbytes[r]
    start = first.fwd_start[0]
    for i, s in enumerate(mine):
        t = s.line
        v.fwd_start[i] = start
        v.fwd_peak[i] = start + t.fwd_peak[i] - t.fwd_start[i]
        if v.fwd_tail:
            v.fwd_tail[i] = start + t.fwd_tail[i] - t.fwd_start[i]
        start += _left(t, i) - dying[i]
    last = mine[-1].line
    v.top_start = start
    v.top_peak = start + last.top_peak - last.top_start
    if last.top_pre_peak is not None and last.exit_freed:
        # the window's peak after the autocast region ended: the casts each line's blocks
        # cached died there
        v.top_peak -= sum(v.exit_freed) - sum(last.exit_freed)
    v.top_grads = last.top_grads
    v.top_pre_peak = None if last.top_pre_peak is None else start + last.top_pre_peak - last.top_start
    v.top_ret_peak = v.top_mid_peak = None
    if kept is not None and last.top_ret_peak is not None:
        # the storages handed to several blocks die as forward returns unless a kept block
        # saved them, where the pair step's recomputed blocks hold them on
        gone = kept.late(mine[-1].alive_return) - kept.alive_return()
        if last.top_mid_peak is not None:  # an autocast region ended after the return
            assert v.top_pre_peak is not None
            pre = max(last.top_ret_peak, last.top_mid_peak - gone)
            v.top_pre_peak = start + pre - last.top_start
            v.top_peak -= gone
        else:
            pre, post = last.top_ret_peak, max(last.top_peak, last.top_ret_peak)
            v.top_peak = max(start + pre - last.top_start, start + post - last.top_start - gone)
    # under the decision, in its line (the storages it kills with every block kept, dead)
    held = [_into_backward(s, i) - dying[i] for i, s in enumerate(mine)]
    for i, s in enumerate(mine):
        t = s.line
        b = t.bwd_start[i]
        if b is None:
            continue
        # the blocks before i: what they hold in the uniform line less in this step
        others = sum(held[j] - _into_backward(s, j) for j in range(i))
        if kept is not None:  # the storages handed to several blocks: as with every block
            # kept (those dead before the forward returned: in the windows' sums above)
            others += kept.alive_bwd(i) - kept.late(s.alive_bwd[i], before=i)
        v.bwd_start[i] = b + others
        v.bwd_peak[i] = b + others + t.bwd_peak[i] - b
        v.bwd_grads[i] = t.bwd_grads[i]
    v.end_bytes, v.end_grads = first.end_bytes, first.end_grads
    v.post_peak = first.post_peak
    return v
