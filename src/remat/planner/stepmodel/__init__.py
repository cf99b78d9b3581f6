"""The step model: every term of the peak and of the added time of one training step.

This package is the one home of the model (:mod:`.derive`: the per-block terms;
:mod:`.segments`: blocks and spans; :mod:`.peak`: the step's peak, cost and attribution;
:mod:`.allocator`: the scratch inside operators in the window it happens in;
:mod:`.budget`: budgets; :mod:`.schedule` and :mod:`.stage`: a pipeline stage's step, one
microbatch's terms priced at every moment of its schedule): the per-block terms derived from the measured timelines (corrections for pair effects included), the segments a plan is cut into (one
running-sum accumulator per kind of segment, which the reference evaluation and the chain
dynamic program both read), the peak of a step and where it falls, the cost of a plan and
what each block saves and adds. Nothing else in the planner writes a formula of the model.

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
outputs to the first gradient of the previous block's outputs (block 0's to the
first gradient of one of its inputs); from there to the end of backward
(``post``: the backward of the layers before the blocks, where every block's
activations are freed whatever the plan; without a gradient for block 0's inputs,
or where some block's backward comes later, block 0's window runs to the end). The candidates are a chain of blocks run in order in forward and in
reverse order in backward (a transformer's layers). For block ``i`` and
decision ``d`` the profile (:mod:`remat.planner.measure`) measures one
:class:`~remat.planner.types.Timeline` with every block under ``d``, from which
:func:`derive_blocks` makes:

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
  above the start the model assumes where more was alive; for the
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
* ``post``                     (the backward of the layers before the first block)
* ``fwd_start[i] - saved(i-1) + fwd_excess[i][d_i]``   (block ``i``'s forward)
* ``bwd_start[i] - saved(i) + bwd_excess[i][d_i]``     (block ``i``'s backward)
* ``top - saved(n)``

Every term is linear in one-hot decision variables ``x[i][d]``, so "minimise
``sum cost[i][d] x[i][d]`` subject to every term ``<= budget``" is a small
mixed-integer linear program (:mod:`remat.planner.perblock`). Spans of blocks
(:func:`span_segments`) cut the chain into segments whose terms are ``term - s``,
``s`` what the segments before saved: the chain dynamic program
(:mod:`remat.planner.chain`) plans over them.

This is the chain formulation of Chen et al. 2016 ("Training Deep Nets with
Sublinear Memory Cost", arXiv:1604.06174) with per-block heterogeneous costs
as in Beaumont et al. (Rotor: "Optimal checkpointing for heterogeneous
chains", arXiv:1911.13214), solved as an integer program in the spirit of
Jain et al. 2020 (Checkmate, arXiv:1910.02653) at block rather than operator
granularity, with selective checkpointing and host offload as extra
per-block choices.

Tensors handed to several blocks
--------------------------------
A tensor the blocks receive that dies in forward with every block kept (T5's position
bias: the first block of a stack makes it, the others receive it and return it again) is
held into backward by a checkpoint of any receiver, once however many hold it: alive after
the window it dies in under ``keep`` and in the backward of every block from the last
down to the first receiver that holds it (``Profile.shared.inputs``,
:class:`~remat.planner.types.SharedInput`; a mask the model's own code makes and passes to
every block is ``shared.bytes``, :func:`checkpointed_view`). "Once if any" is not linear in
the decisions, so the profile's terms count it once per holding receiver (a bound: never
low, exact with one holder), :func:`step_peak` takes the extra copies back (exact for plans
without spans; with spans the bound), and :func:`solver_terms` also gives terms that count
it by its last receiver only (never high, when it dies in its last receiver's window or as
forward returns), which :func:`remat.plan` solves first: a plan they choose that fits under
the exact terms is optimal.

Not covered: blocks that are not a chain (skip connections across blocks
other than the residual stream), data-dependent shapes (the profile is valid
for the input shapes it was measured with), tensors the process holds that
are neither the model's nor the optimizer's nor the inputs, and allocator
fragmentation and caching on GPUs (the model counts tensor bytes, as
:mod:`remat.memory` does, i.e. ``max_memory_allocated``, not ``max_memory_reserved``).
"""

from __future__ import annotations

from .allocator import allocator_peak, with_scratch
from .budget import budget_of, check_budget, is_share, parse_budget, share_note, smallest_share
from .derive import HELD_LINES, derive_blocks, equalize_costs
from .peak import (
    Terms,
    activation_terms,
    attribution,
    block_share,
    checkpointed_view,
    exit_view,
    has_exit,
    head_bytes,
    plan_terms,
    predicted_cost,
    predicted_peak,
    solver_terms,
    step_peak,
    unchecked_peak,
)
from .record import located, profile_data
from .segments import (
    BlockTerms,
    block_segment,
    block_terms,
    input_offload_cost,
    layout,
    options,
    span_segment,
    span_segments,
)

__all__ = [
    "HELD_LINES",
    "BlockTerms",
    "Terms",
    "activation_terms",
    "allocator_peak",
    "attribution",
    "block_segment",
    "block_share",
    "block_terms",
    "budget_of",
    "check_budget",
    "checkpointed_view",
    "derive_blocks",
    "equalize_costs",
    "exit_view",
    "has_exit",
    "head_bytes",
    "input_offload_cost",
    "is_share",
    "layout",
    "located",
    "options",
    "parse_budget",
    "plan_terms",
    "predicted_cost",
    "predicted_peak",
    "profile_data",
    "share_note",
    "smallest_share",
    "solver_terms",
    "span_segment",
    "span_segments",
    "step_peak",
    "unchecked_peak",
    "with_scratch",
]
