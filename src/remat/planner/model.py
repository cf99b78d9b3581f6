"""The step model: the peak and the added time of one training step under a plan.

The step
--------
The model is of the default training loop, the step a user runs::

    optimizer.zero_grad()        # grads None (set_to_none=True, PyTorch's default)
    out = model(*args)           # forward
    loss = loss_fn(out)
    loss.backward()              # gradients created as backward reaches each parameter
    optimizer.step()             # optimizer state created on the first step

with ``out`` and ``loss`` alive until the end of the step, as local variables
of a loop are. ``set_to_none=False`` (gradients kept and zeroed in place, or
accumulated over micro-batches) is modelled too: the gradients are then part
of the static bytes. Bytes are tensor storage bytes on the model's device, as
:mod:`remat.memory` counts them and as ``torch.cuda.max_memory_allocated()``
reports them.

The peak of a step is the largest of

* ``static + grads_kept + opt_state + act(plan)``  (forward and backward of a
  later step; the first step has no optimizer state yet, so it is lower);
* ``static + grads_kept + end + opt_first``       (the first ``optimizer.step()``,
  which creates the state);
* ``static + grads_kept + opt_state + end + opt_later`` (every later ``step()``);

where ``static`` is the bytes of parameters, buffers and inputs, ``end`` the
bytes alive when backward returns (the gradients when they were created in it,
``out``, ``loss``), and ``opt_*`` the peaks measured inside ``optimizer.step()``.
Only ``act(plan)`` depends on the plan.

Activations
-----------
``act(plan)`` is measured from the step's start in contiguous windows that
cover the whole forward and backward: before the first block (``pre``); block
``i``'s forward, from its start to the next block's start (the last block's to
its end); from there to the last block's backward (``top``: head, loss, their
backward); block ``i``'s backward, from the first gradient of one of its
outputs to the first gradient of the previous block's outputs (block 0's to
the end of backward, which covers the gradients of the layers before the
blocks). The candidates are a chain of blocks run in order in forward and in
reverse order in backward (a transformer's layers). For block ``i`` and
decision ``d`` in ``keep``, ``recompute``, ``selective``, ``offload`` the
profile (:mod:`remat.planner.measure`) measures, with every block under ``d``:

* ``retained[i][d]``: bytes the block leaves alive for the rest of the
  step: what was allocated from its forward start to the next block's
  forward start (for the last block: to its own forward end). Measured up
  to the next block rather than to the block's end because what follows a
  block (a residual add, the loss) may free its output under ``keep`` while
  a selective cache holds it;
* ``fwd_excess[i][d]``: peak of its forward window above what was alive when it
  started;
* ``bwd_excess[i][d]``: peak of its backward window above what was alive when
  it started (recomputed activations and the block's new gradients live here), or
  above the start the model assumes (below) where more was alive; for the
  last block also the peak of the ``top`` window under ``d``;
* ``cost[i][d]``: the time (or FLOPs) the decision adds to a step; ``keep`` is 0;

and, once, under all-``keep``: ``fwd_start[i]`` / ``bwd_start[i]``, the bytes
alive when block ``i``'s forward / backward window starts, and ``top``.
Gradients created in backward are in these terms: they are the same under
every decision, since a block's parameters get their gradients in its
backward whatever the decision.

With ``saved(i) = sum_{j<=i} retained[j][keep] - retained[j][d_j]`` the
activation peak is the largest of

* ``pre``                                                (before the first block)
* ``fwd_start[i] - saved(i-1) + fwd_excess[i][d_i]``   (block ``i``'s forward)
* ``bwd_start[i] - saved(i) + bwd_excess[i][d_i]``     (block ``i``'s backward)
* ``top - saved(n)``

Every term is linear in one-hot decision variables ``x[i][d]``, so "minimise
``sum cost[i][d] x[i][d]`` subject to every term ``<= budget``" is a small
mixed-integer linear program, solved exactly by HiGHS through
``scipy.optimize.milp`` (extra ``remat[plan]``); :mod:`remat.planner.solve`
also has an exact dynamic program over blocks whose state is ``saved(i)``.

This is the chain formulation of Chen et al. 2016 ("Training Deep Nets with
Sublinear Memory Cost", arXiv:1604.06174) with per-block heterogeneous costs
as in Beaumont et al. (Rotor: "Optimal checkpointing for heterogeneous
chains", arXiv:1911.13214), solved as an integer program in the spirit of
Jain et al. 2020 (Checkmate, arXiv:1910.02653) at block rather than operator
granularity, with selective checkpointing and host offload as extra
per-block choices.

Not covered: blocks that are not a chain (skip connections across blocks
other than the residual stream), data-dependent shapes (the profile is valid
for the input shapes it was measured with), tensors the process holds that
are neither the model's nor the optimizer's nor the inputs, and allocator
fragmentation and caching on GPUs (the model counts tensor bytes, as
:mod:`remat.memory` does, i.e. ``max_memory_allocated``, not ``max_memory_reserved``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Sequence
from typing import Any

DECISIONS = ("keep", "recompute", "selective", "offload", "split")


@dataclasses.dataclass
class BlockCosts:
    """Measured costs of one candidate block (see the module docstring for the terms).

    ``bwd_grads`` is the bytes of gradients alive at the end of the block's backward
    window under ``keep`` (for the peak's breakdown), ``noise`` the spread of the
    timing samples of each decision's cost (for near-ties).

    Where an autocast region ends between the last block's forward and its backward
    (torch's mixed-precision recipe, or ``torch.autocast`` inside the model's
    ``forward``: :mod:`remat.planner.amp`), ``retained`` is what the block keeps into
    backward, ``exit_freed[d]`` what it also kept in forward until the region's end
    (autocast's cached casts of its weights, which only ``keep`` saves for backward),
    and the last block's ``pre_exit[d]`` the peak of the head and the loss before the
    end, as a forward term (see :func:`activation_terms`). ``exit_freed[d]`` also has the
    block's inputs that the model's code keeps until forward returns and that the block
    under ``d`` (``keep``, ``offload``) does not keep on the device (``held_to_end``):
    they die when forward returns, where a checkpoint holds them into backward. Both are
    empty when neither happens.

    ``offload_input`` is the bytes a span starting at this block frees on the device by
    keeping its input in host memory (:func:`span_segment`), measured on a device where
    nothing else holds that input once the block returns, whatever the block before does;
    0 elsewhere (such a span is not offered).

    ``held_to_end`` is the bytes of the block's inputs that the model's code keeps until
    forward returns and the kept block does not save (counted in ``exit_freed`` under
    ``keep`` and ``offload``): a checkpoint starting at this block holds them into backward.
    """

    name: str
    retained: dict[str, int]
    fwd_excess: dict[str, int]
    bwd_excess: dict[str, int]
    cost: dict[str, float]
    fwd_start: int
    bwd_start: int
    input_bytes: int = 0
    param_bytes: int = 0
    bwd_grads: int = 0
    noise: dict[str, float] = dataclasses.field(default_factory=dict)
    exit_freed: dict[str, int] = dataclasses.field(default_factory=dict)
    pre_exit: dict[str, int] = dataclasses.field(default_factory=dict)
    offload_input: int = 0
    held_to_end: int = 0


@dataclasses.dataclass
class Timeline:
    """Bytes at the window boundaries of one measured step (every block under one decision).

    Filled by :mod:`remat.planner.measure`; bytes are counted from the step's
    start. ``bwd_start[i]`` is ``None`` when block ``i``'s backward was never seen
    (its outputs need no gradient).
    """

    pre_peak: int = 0
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
    exit_freed: list[int] = dataclasses.field(default_factory=list)


def derive_blocks(
    names: Sequence[str],
    lines: dict[str, Timeline],
    costs: dict[str, dict[str, float]],
    noise: dict[str, dict[str, float]],
    input_bytes: Sequence[int],
    param_bytes: Sequence[int],
) -> list[BlockCosts]:
    """The per-block terms of the model from one measured timeline per uniform decision."""
    decisions = list(lines)
    keep = lines["keep"]
    n = len(names)
    out = []
    # bytes each uniform step saved up to this block: alive in forward, and in backward
    saved_f = dict.fromkeys(decisions, 0)
    saved = dict.fromkeys(decisions, 0)
    exited = keep.top_pre_peak is not None  # an autocast region ended before backward
    exit_freed = {d: t.exit_freed or [0] * n for d, t in lines.items()}
    for i, name in enumerate(names):
        retained, retained_f = {}, {}
        for d, t in lines.items():
            nxt = t.fwd_start[i + 1] if i + 1 < n else t.top_start
            retained_f[d] = nxt - t.fwd_start[i]
            retained[d] = retained_f[d] - exit_freed[d][i]
        bwd_excess = {}
        kb = keep.bwd_start[i]
        pre_exit = {}
        for d, t in lines.items():
            saved[d] += retained["keep"] - retained[d]
            saved_f[d] += retained_f["keep"] - retained_f[d]
            start = t.bwd_start[i]
            if kb is None or start is None:  # no backward window: never the binding term
                bwd_excess[d] = -(2**62)
                continue
            # Above the start the model assumes (keep's start less what was saved), not the
            # start measured under d: a selective cache may hold more then (the last block's
            # output, freed after the loss under keep), and a recomputed block whose last op
            # saved its output (ReLU) starts lower; both are the block's own and hold for any
            # plan, so the peak relative to the assumed start is exact.
            assumed = kb - saved[d]
            bwd_excess[d] = t.bwd_peak[i] - assumed
            if i == n - 1:  # the same for the head, the loss and their backward
                bwd_excess[d] = max(bwd_excess[d], t.top_peak - assumed)
        if i == n - 1 and exited:  # the head and the loss before the region's end
            pre_exit = {
                d: t.top_pre_peak + saved_f[d]
                for d, t in lines.items()
                if t.top_pre_peak is not None
            }
        out.append(
            BlockCosts(
                name=name,
                retained=retained,
                fwd_excess={d: t.fwd_peak[i] - t.fwd_start[i] for d, t in lines.items()},
                bwd_excess=bwd_excess,
                cost={d: max(0.0, costs[d][name] - costs["keep"][name]) for d in decisions},
                fwd_start=keep.fwd_start[i],
                bwd_start=kb if kb is not None else 0,
                input_bytes=input_bytes[i],
                param_bytes=param_bytes[i],
                bwd_grads=keep.bwd_grads[i],
                noise={d: noise[d][name] for d in decisions if name in noise.get(d, {})},
                exit_freed=(
                    {d: exit_freed[d][i] for d in decisions}
                    if exited and any(exit_freed[d][i] for d in decisions)
                    else {}
                ),
                pre_exit=pre_exit,
            )
        )
    return out


def equalize_costs(blocks: list[BlockCosts], signatures: Sequence[Any]) -> None:
    """Give blocks with the same signature (same class, parameter and buffer shapes, inputs)
    the same cost and noise per decision: the median over the group, in place.

    Identical layers cost the same; their timed costs differ only by noise, and
    without this a solver would pick among them by that noise, a different
    plan on every run.
    """
    groups: dict[Any, list[BlockCosts]] = {}
    for b, sig in zip(blocks, signatures):
        groups.setdefault(sig, []).append(b)
    for members in groups.values():
        if len(members) < 2:
            continue
        for d in members[0].cost:
            cost = statistics.median(b.cost[d] for b in members)
            noise = statistics.median(b.noise.get(d, 0.0) for b in members)
            for b in members:
                b.cost[d] = cost
                if d in b.noise:
                    b.noise[d] = noise


def predicted_peak(
    blocks: Sequence[BlockCosts],
    top: int,
    decisions: Sequence[str],
    pre: int = 0,
    spans: Sequence[Sequence[int]] = (),
) -> int:
    """Activation peak (bytes above the step's start) the model predicts for a plan."""
    return activation_terms(blocks, top, decisions, pre, spans)[0]


#: Decisions a block may take inside a span (the span's inner checkpointing of each block):
#: ``keep`` is one checkpoint over the whole span (Chen et al.'s segments), ``recompute``
#: and ``split`` checkpoint each block inside it as well (nested), ``selective`` runs each
#: block under the selective policy inside it: the policy's saved outputs are handed to the
#: span (dropped in forward, brought back by its recompute), so until backward reaches the
#: span only its input is kept, and from there its blocks are selective blocks.
SPAN_INNER = ("keep", "recompute", "selective", "split")


@dataclasses.dataclass(frozen=True)
class Segment:
    """A run of the chain with its own decisions: one block, or a span of blocks.

    Every activation term of a segment is ``term - s`` where ``s`` is what the
    segments before it saved, so a segment is summed up by ``peak`` (its largest
    ``term``), where that is, ``saved`` (what it saves for the segments after
    it) and ``cost``.
    """

    first: int
    last: int
    decision: str
    span: bool
    peak: int
    where: str
    saved: int
    cost: float


def block_segment(blocks: Sequence[BlockCosts], i: int, d: str) -> Segment:
    """Block ``i`` alone under ``d`` (see the module docstring for its two terms)."""
    b = blocks[i]
    saved = b.retained["keep"] - b.retained[d]
    fwd = b.fwd_start + b.fwd_excess[d]
    bwd = b.bwd_start - saved + b.bwd_excess[d]
    where = f"forward of {b.name!r}" if fwd >= bwd else f"backward of {b.name!r}"
    return Segment(i, i, d, False, max(fwd, bwd), where, saved, float(b.cost[d]))


def span_segment(
    blocks: Sequence[BlockCosts], a: int, z: int, d: str, offload: bool = False
) -> Segment:
    """Blocks ``a..z`` as one checkpointed region, each block checkpointed inside it as ``d``.

    In forward only the span's input is kept: block ``i``'s output lives only
    while block ``i+1`` runs. Backward of block ``z`` first recomputes blocks
    ``a..z-1`` (early stop before ``z``), which brings back the inputs of
    blocks ``a+1..z`` as the inner regions' inputs; from there each block's
    backward is that of a block checkpointed as ``d``. With ``R_j`` =
    ``retained[j][d]`` and ``s`` the bytes saved before the span:

    * forward of block ``i``: ``fwd_start[i] - s - sum_{j<i}(retained[j][keep] - R_j)
      - sum_{j<i-1} R_j + fwd_excess[i][d]`` (sums from ``a``);
    * recompute of block ``i < z`` (at block ``z``'s backward):
      ``bwd_start[z] - s_z - sum_{i<=j<z} R_j + fwd_excess[i][d]``, with ``s_z`` what
      blocks ``a..z`` under ``d`` alone would have saved;
    * backward of block ``i``: as block ``i`` alone under ``d``;
    * it saves ``sum_{a<=j<=z}(retained[j][keep] - R_j) + sum_{a<=j<z} R_j``;
    * it costs ``sum cost[j][d]`` plus blocks ``a..z-1`` once more (``cost[j][recompute]``).

    ``offload``: the span's input is kept in host memory until its own backward asks for
    it (``apply_span(offload_inputs=True, prefetch=False)``), which frees
    ``F = offload_input[a]`` on the device once block ``a`` returns (the profile offers
    ``F > 0`` only where nothing else holds it then): the forward terms of blocks
    ``a+1..z`` are lower by ``F``, the span saves ``F`` more for every segment after it
    (their forward and backward come before the span's backward, which brings the input
    back, so its own backward terms are unchanged), and it costs the two copies
    (:func:`input_offload_cost`).
    """
    freed = _freed(blocks, a, offload)
    if d == "keep":
        seg = _keep_span_segment(blocks, a, z, freed)
    elif d == "selective":
        seg = _selective_span_segment(blocks, a, z, freed)
    else:
        seg = _nested_span_segment(blocks, a, z, d, freed)
    if not offload:
        return seg
    return dataclasses.replace(seg, cost=seg.cost + input_offload_cost(blocks, a))


def _nested_span_segment(
    blocks: Sequence[BlockCosts], a: int, z: int, d: str, freed: int
) -> Segment:
    """Blocks ``a..z`` as one region, each checkpointed inside it as ``d`` (``recompute``,
    ``split``); see :func:`span_segment`."""
    peak, where = -(2**62), ""
    inner = 0  # what blocks a..i-1 under d alone would have saved
    for i in range(a, z + 1):
        b = blocks[i]
        dropped = sum(blocks[j].retained[d] for j in range(a, i - 1))
        v = b.fwd_start - inner - dropped + b.fwd_excess[d] - (freed if i > a else 0)
        if v > peak:
            peak, where = v, f"forward of {b.name!r}"
        inner += b.retained["keep"] - b.retained[d]
        v = b.bwd_start - inner + b.bwd_excess[d]
        if v > peak:
            peak, where = v, f"backward of {b.name!r}"
    bz = blocks[z]
    for i in range(a, z):
        tail = sum(blocks[j].retained[d] for j in range(i, z))
        v = bz.bwd_start - inner - tail + blocks[i].fwd_excess[d]
        if v > peak:
            peak, where = v, f"recompute of {blocks[i].name!r} in the span's backward"
    saved = inner + sum(blocks[j].retained[d] for j in range(a, z))
    cost = sum(blocks[j].cost[d] for j in range(a, z + 1)) + sum(
        blocks[j].cost.get("recompute", 0.0) for j in range(a, z)
    )
    return Segment(a, z, d, True, peak, where, saved + freed, float(cost))


def _freed(blocks: Sequence[BlockCosts], a: int, offload: bool) -> int:
    if not offload:
        return 0
    if blocks[a].offload_input <= 0:
        raise ValueError(
            f"a span from {blocks[a].name!r} cannot offload its input: the profile found it "
            "held by something else once the block returns (or it was measured on CPU, or "
            "without 'offload' among the decisions); drop the span's offload."
        )
    return blocks[a].offload_input


def input_offload_cost(blocks: Sequence[BlockCosts], a: int) -> float:
    """What offloading block ``a``'s input costs: its bytes at the per-byte cost of the
    ``offload`` decision (the median over blocks of ``cost[offload]`` per byte it moves to
    host memory, ``retained[keep] - retained[offload]``); 0 without that decision (FLOPs:
    copies do no arithmetic)."""
    rates = sorted(
        b.cost["offload"] / (b.retained["keep"] - b.retained["offload"])
        for b in blocks
        if "offload" in b.cost and b.retained.get("keep", 0) > b.retained.get("offload", 0)
    )
    if not rates:
        return 0.0
    return float(blocks[a].offload_input * rates[len(rates) // 2])


def _keep_span_segment(blocks: Sequence[BlockCosts], a: int, z: int, freed: int = 0) -> Segment:
    """Blocks ``a..z`` as one checkpointed region, the blocks plain inside it (``inner="keep"``).

    Forward is that of a span with ``recompute`` inside (every saved tensor dropped, only
    the span's input kept; ``R_j = retained[j][recompute]``, a block's input). Backward of
    block ``z`` recomputes blocks ``a..z`` at once with everything they save (early stop
    after the last tensor block ``z`` saves), so from there the blocks stand as in the
    ``keep`` line, block ``z`` as a block recomputed alone:

    * recompute of block ``i < z``: ``bwd_start[z] - saved + sum_{a<=j<i} retained[j][keep]
      + fwd_excess[i][keep]``;
    * backward of block ``z``: ``bwd_start[z] - (retained[z][keep] - R_z) +
      bwd_excess[z][recompute]``; of block ``i < z``: ``bwd_start[i] + bwd_excess[i][keep]``;
    * it saves ``sum_{a<=j<=z} retained[j][keep] - R_z`` and costs
      ``sum cost[j][recompute]`` (each block recomputed once).
    """
    peak, where = -(2**62), ""

    def see(v: int, at: str) -> None:
        nonlocal peak, where
        if v > peak:
            peak, where = v, at

    inner = 0
    for i in range(a, z + 1):
        b = blocks[i]
        dropped = sum(blocks[j].retained["recompute"] for j in range(a, i - 1))
        dropped += freed if i > a else 0
        see(b.fwd_start - inner - dropped + b.fwd_excess["recompute"], f"forward of {b.name!r}")
        inner += b.retained["keep"] - b.retained["recompute"]
    saved = inner + sum(blocks[j].retained["recompute"] for j in range(a, z))
    bz = blocks[z]
    restored = 0
    for i in range(a, z):
        b = blocks[i]
        see(
            bz.bwd_start - saved + restored + b.fwd_excess["keep"],
            f"recompute of {b.name!r} in the span's backward",
        )
        restored += b.retained["keep"]
    lone = bz.retained["keep"] - bz.retained["recompute"]
    held = blocks[a].held_to_end  # the span's input, which the keep line frees at forward's end
    see(bz.bwd_start - lone + bz.bwd_excess["recompute"] + held, f"backward of {bz.name!r}")
    for i in range(a, z):
        b = blocks[i]
        see(b.bwd_start + b.bwd_excess["keep"] + held, f"backward of {b.name!r}")
    cost = sum(blocks[j].cost["recompute"] for j in range(a, z + 1))
    return Segment(a, z, "keep", True, peak, where, saved + freed, float(cost))


def _selective_span_segment(
    blocks: Sequence[BlockCosts], a: int, z: int, freed: int = 0
) -> Segment:
    """Blocks ``a..z`` as one checkpointed region, each a selective region inside it
    (``inner="selective"``: the outputs the policy saves are handed to the span).

    With ``K_j``, ``S_j``, ``R_j`` = ``retained[j]`` under ``keep``, ``selective`` and
    ``recompute``: in forward a block holds its saved outputs until it returns and then
    leaves only its output (``R_j``, as a recomputed block); backward of block ``z`` first
    reruns blocks ``a..z`` under the policy (each brings back its input and its saved
    outputs: ``S_j``), and from there the blocks are selective blocks. With ``s`` the bytes
    saved before the span:

    * forward of block ``i``: ``fwd_start[i] - s - sum_{a<=j<i} K_j + R_{i-1} +
      fwd_excess[i][selective]`` (no ``R`` term for ``i = a``);
    * recompute of block ``j`` (at block ``z``'s backward): ``bwd_start[z] - s - saved +
      sum_{a<=k<j} S_k + fwd_excess[j][selective]``, ``j = a..z`` (block ``z`` runs up to
      its last saved output: its whole forward is the bound);
    * backward of block ``i``: as block ``i`` alone under ``selective``;
    * it saves ``sum_{a<=j<=z} K_j - R_z`` and costs ``sum cost[j][selective]`` plus
      blocks ``a..z`` once more (``cost[j][recompute]``).
    """
    peak, where = -(2**62), ""

    def see(v: int, at: str) -> None:
        nonlocal peak, where
        if v > peak:
            peak, where = v, at

    kept = 0  # sum_{a<=j<i} K_j
    inner = 0  # sum_{a<=j<=i} (K_j - S_j): what the blocks alone under selective save
    for i in range(a, z + 1):
        b = blocks[i]
        prev = blocks[i - 1].retained["recompute"] - freed if i > a else 0
        see(b.fwd_start - kept + prev + b.fwd_excess["selective"], f"forward of {b.name!r}")
        kept += b.retained["keep"]
        inner += b.retained["keep"] - b.retained["selective"]
        see(b.bwd_start - inner + b.bwd_excess["selective"], f"backward of {b.name!r}")
    saved = kept - blocks[z].retained["recompute"]
    base = blocks[z].bwd_start - saved
    restored = 0
    for j in range(a, z + 1):
        b = blocks[j]
        see(
            base + restored + b.fwd_excess["selective"],
            f"recompute of {b.name!r} in the span's backward",
        )
        restored += b.retained["selective"]
    cost = sum(blocks[j].cost["selective"] for j in range(a, z + 1)) + sum(
        blocks[j].cost["recompute"] for j in range(a, z + 1)
    )
    return Segment(a, z, "selective", True, peak, where, saved + freed, float(cost))


def layout(
    blocks: Sequence[BlockCosts], decisions: Sequence[str], spans: Sequence[Sequence[int]] = ()
) -> list[Segment]:
    """The segments of a plan: ``spans`` are ``(first, last)`` block indices, ascending and
    disjoint, or ``(first, last, 1)`` for a span whose input is offloaded (see
    :func:`span_segment`); the blocks inside a span take their ``decisions``."""
    starts = {int(sp[0]): int(sp[1]) for sp in spans}
    offloaded = {int(sp[0]) for sp in spans if len(sp) > 2 and sp[2]}
    out = []
    i = 0
    while i < len(blocks):
        if i in starts:
            z = starts[i]
            inner = {decisions[j] for j in range(i, z + 1)}
            if len(inner) != 1 or not inner <= set(SPAN_INNER):
                raise ValueError(
                    "a span's blocks must all be 'keep', all 'recompute', all 'selective' or "
                    f"all 'split', got "
                    f"{sorted(inner)} for blocks {i}..{z}; give the span's blocks one of these "
                    "decisions, or drop the span."
                )
            out.append(span_segment(blocks, i, z, decisions[i], i in offloaded))
            i = z + 1
        else:
            out.append(block_segment(blocks, i, decisions[i]))
            i += 1
    return out


def has_exit(blocks: Sequence[BlockCosts]) -> bool:
    """Whether some block keeps bytes in forward that it does not keep into backward (an
    autocast region ended before backward, or inputs the model keeps to forward's end):
    the step model then needs its two running sums."""
    return any(b.exit_freed or b.pre_exit for b in blocks)


def exit_view(blocks: Sequence[BlockCosts], safe: bool) -> list[BlockCosts]:
    """Terms in one running sum, for the solvers, where an autocast region ends before
    backward (:func:`has_exit`).

    What a block keeps in forward is ``retained + exit_freed`` and in backward
    ``retained``, so the exact forward terms (:func:`activation_terms`) subtract
    ``s_F``, what the blocks before saved in forward, and the backward terms ``s_B``:
    ``s_B - s_F = sum_{j} (exit_freed[j][d_j] - exit_freed[j][keep])``: the cached casts of
    the checkpointed blocks, less the inputs kept to forward's end that they hold. The dynamic program has one running sum, ``s_B``; its forward
    terms are here either ``safe`` (raised by ``sum_{j<i} max_d (exit_freed[j][d] -
    exit_freed[j][keep])``, never below the exact term, above it by the casts of the kept
    blocks before) or optimistic (``s_B`` as if it were ``s_F``: never above the exact
    term). :func:`remat.plan` solves the optimistic terms first: a plan they choose that
    meets the budget under the exact terms is optimal; otherwise it solves the safe ones.
    """
    out = []
    over = 0
    for b in blocks:
        nb = dataclasses.replace(b, fwd_start=b.fwd_start + (over if safe else 0))
        if b.exit_freed:
            keep = b.exit_freed.get("keep", 0)
            over += max(0, max(b.exit_freed.values()) - keep)
        if b.pre_exit:  # the last block: its forward-phase term as a backward one
            excess = dict(b.bwd_excess)
            for d, v in b.pre_exit.items():
                if d in excess:
                    excess[d] = max(excess[d], v - b.bwd_start + (over if safe else 0))
            nb.bwd_excess = excess
        out.append(nb)
    return out


def _exact_terms(
    blocks: Sequence[BlockCosts], top: int, decisions: Sequence[str], pre: int
) -> tuple[int, str]:
    """:func:`activation_terms` of a plan without spans, in two running sums (forward and
    backward: see :func:`exit_view`)."""
    saved_f = saved_b = 0
    peak, where = pre, "before the first block"
    for b, d in zip(blocks, decisions):
        fwd = b.fwd_start - saved_f + b.fwd_excess[d]
        if fwd > peak:
            peak, where = fwd, f"forward of {b.name!r}"
        x = b.exit_freed
        saved_f += b.retained["keep"] + x.get("keep", 0) - b.retained[d] - x.get(d, 0)
        saved_b += b.retained["keep"] - b.retained[d]
        bwd = b.bwd_start - saved_b + b.bwd_excess[d]
        if bwd > peak:
            peak, where = bwd, f"backward of {b.name!r}"
        if d in b.pre_exit and b.pre_exit[d] - saved_f > peak:
            peak = b.pre_exit[d] - saved_f
            where = "after the last block (head, loss and their backward)"
    if top - saved_b > peak:
        peak, where = top - saved_b, "after the last block (head, loss and their backward)"
    return peak, where


def activation_terms(
    blocks: Sequence[BlockCosts],
    top: int,
    decisions: Sequence[str],
    pre: int = 0,
    spans: Sequence[Sequence[int]] = (),
) -> tuple[int, str]:
    """The activation peak and where it falls (``"forward of 'x'"``, ``"backward of 'x'"``, ...).

    Where an autocast region ends before backward (:func:`has_exit`), a plan without
    spans is exact in two running sums, and a plan with spans is bounded by the safe
    single-sum terms of :func:`exit_view` (never low; high by the cached casts of kept
    blocks in forward terms).
    """
    if has_exit(blocks):
        if not spans:
            return _exact_terms(blocks, top, decisions, pre)
        blocks = exit_view(blocks, safe=True)
    saved = 0
    peak, where = pre, "before the first block"
    for seg in layout(blocks, decisions, spans):
        if seg.peak - saved > peak:
            peak, where = seg.peak - saved, seg.where
        saved += seg.saved
    if top - saved > peak:
        peak, where = top - saved, "after the last block (head, loss and their backward)"
    return peak, where


def predicted_cost(
    blocks: Sequence[BlockCosts], decisions: Sequence[str], spans: Sequence[Sequence[int]] = ()
) -> float:
    """Added time (or FLOPs) the model predicts for a plan."""
    if not spans:
        return float(sum(b.cost[d] for b, d in zip(blocks, decisions)))
    return float(sum(seg.cost for seg in layout(blocks, decisions, spans)))


@dataclasses.dataclass
class StepPeak:
    """The predicted peak of a training step, where it falls and what it is made of.

    Attributes:
        bytes: the peak (absolute: static bytes included).
        where: the phase (``"backward of 'layers.3'"``, ``"optimizer.step() (first step, ...)"``).
        breakdown: ``static`` (parameters, buffers, inputs), ``gradients``,
            ``optimizer`` (state) and ``activations`` (the rest: saved tensors,
            outputs, temporaries) at the peak; they add up to ``bytes``.
        movable: whether a plan can lower it (False in the optimizer step or
            before the first block).
    """

    bytes: int
    where: str
    breakdown: dict[str, int]
    movable: bool


#: The decisions whose region keeps the block's inputs until its backward (a checkpoint).
HOLD_INPUTS = ("recompute", "selective", "split")


def checkpointed_view(
    blocks: Sequence[BlockCosts], top: int, shared: int
) -> tuple[list[BlockCosts], int]:
    """The terms of plans with at least one checkpoint, when the model's forward makes
    ``shared`` bytes of tensors it passes to several blocks (an attention mask, rotary
    tables) that die when the forward returns under ``keep``.

    A checkpointed block keeps them as inputs until its backward, so they are alive in the
    backward of every block from the last down to the first checkpointed one. The uniform
    lines measured them inside the checkpointed decisions' backward terms; here they are
    in every backward term (``bwd_start``) and in ``top`` instead: exact for checkpointed
    blocks, high by ``shared`` for kept blocks before the first checkpoint (whose backward
    comes after it has been freed).
    """
    out = []
    for b in blocks:
        excess = dict(b.bwd_excess)
        for d in HOLD_INPUTS:
            if d in excess and excess[d] > -(2**62):
                excess[d] -= shared
        out.append(dataclasses.replace(b, bwd_start=b.bwd_start + shared, bwd_excess=excess))
    return out, top + shared


def plan_terms(
    prof: Any, decisions: Sequence[str], spans: Sequence[Sequence[int]] = ()
) -> tuple[Sequence[BlockCosts], int]:
    """The blocks and ``top`` the model uses for a plan (see :func:`checkpointed_view`)."""
    shared = int(getattr(prof, "shared_bytes", 0))
    if shared and (spans or any(d != "keep" for d in decisions)):
        return checkpointed_view(prof.blocks, prof.top, shared)
    return prof.blocks, prof.top


def step_peak(prof: Any, decisions: Sequence[str], spans: Sequence[Sequence[int]] = ()) -> StepPeak:
    """The peak of one step of the default loop under a plan (first and later steps).

    ``prof`` is a :class:`~remat.Profile`; ``spans`` as in :func:`layout`.
    """
    static = prof.static_bytes
    kept = prof.grad_bytes if prof.grads_kept else 0
    state = prof.optimizer_state_bytes
    blocks, top = plan_terms(prof, decisions, spans)
    act, where = activation_terms(blocks, top, decisions, prof.pre, spans)
    grads_at = _grads_at(prof, where)
    base = {"static": static, "gradients": kept, "optimizer": state}
    cands = [
        StepPeak(
            static + kept + state + act,
            where,
            {**base, "gradients": kept + grads_at, "activations": act - grads_at},
            where != "before the first block",
        )
    ]
    if prof.optimizer is not None:
        end_act = prof.end_bytes - prof.end_grads
        grads = kept + prof.end_grads
        first = prof.optimizer_first_bytes
        cands.append(
            StepPeak(
                static + kept + prof.end_bytes + first,
                "optimizer.step() of the first step (optimizer state created)",
                {
                    "static": static,
                    "gradients": grads,
                    "optimizer": min(state, first),
                    "activations": end_act + first - min(state, first),
                },
                False,
            )
        )
        later = prof.optimizer_later_bytes
        cands.append(
            StepPeak(
                static + kept + state + prof.end_bytes + later,
                "optimizer.step() of later steps",
                {**base, "gradients": grads, "activations": end_act + later},
                False,
            )
        )
    best = cands[0]
    for c in cands[1:]:  # a tie goes to what a plan can move
        if c.bytes > best.bytes:
            best = c
    return best


def _grads_at(prof: Any, where: str) -> int:
    """Gradient bytes alive at the end of the window ``where`` (created in this step)."""
    if where.startswith("backward of "):
        name = where[len("backward of ") :].strip("'")
        for b in prof.blocks:
            if b.name == name:
                return int(b.bwd_grads)
    if where.startswith("after the last block"):
        return int(prof.top_grads)
    return 0


def parse_budget(budget: int | float | str, static: int, unchecked: int) -> int:
    """Bytes from ``budget``: the absolute step peak it allows.

    Bytes are an int (``2**30``) or a size string: ``"1.5GiB"``, ``"512MiB"``,
    ``"18GB"``. Binary prefixes (``KiB``, ``MiB``, ``GiB``, ``TiB``) are powers
    of 1024; decimal ones (``KB``, ``MB``, ``GB``, ``TB``) powers of 1000, as
    in the SI (and in Hugging Face's ``max_memory``). A percentage ``"60%"``
    is ``static`` plus that share of what the unchecked step allocates above
    ``static`` (``unchecked - static``); it must be above ``0%``, and ``100%``
    or more is met by keeping every block.

    Example:
        >>> parse_budget("50%", 1000, 3000), parse_budget(2048, 0, 1), parse_budget("1.5KiB", 0, 1)
        (2000, 2048, 1536)
        >>> parse_budget("2GB", 0, 1), parse_budget("2GiB", 0, 1)
        (2000000000, 2147483648)
    """
    hint = (
        "Pass the step's peak in bytes (a positive int such as 2**30, or a size such as "
        "'1.5GiB' or '18GB'), or a percentage above 0% such as '60%' of what the unchecked "
        "step allocates above its static bytes."
    )
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(
            f"remat.plan: budget must be bytes (int) or a string, got {type(budget).__name__} "
            f"{budget!r}. {hint}"
        )
    if isinstance(budget, (int, float)):
        if isinstance(budget, float) and 0 < budget < 1:
            raise ValueError(
                f"remat.plan: budget={budget!r} is read as bytes (less than one); for a share "
                f"write it as a percentage string: budget='{budget * 100:g}%'."
            )
        if not math.isfinite(budget) or budget < 1:
            raise ValueError(f"remat.plan: budget must be >= 1 byte, got {budget!r}. {hint}")
        return int(budget)
    m = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*%\s*", budget)
    if m:
        pct = float(m.group(1))
        if not pct > 0:
            raise ValueError(
                f"remat.plan: budget percentage must be above 0%, got {budget!r}. {hint}"
            )
        return static + int(max(unchecked - static, 0) * pct / 100)
    m = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", budget, re.IGNORECASE)
    if m:
        unit = (m.group(2) or "B").upper()
        scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}.get(unit) or {
            "KIB": 2**10,
            "MIB": 2**20,
            "GIB": 2**30,
            "TIB": 2**40,
        }[unit]
        out = int(float(m.group(1)) * scale)
        if out < 1:
            raise ValueError(f"remat.plan: budget must be >= 1 byte, got {budget!r}. {hint}")
        return out
    raise ValueError(f"remat.plan: cannot read budget {budget!r}. {hint}")


def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
