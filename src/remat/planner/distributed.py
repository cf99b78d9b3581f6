"""One plan for all ranks: the profile's numbers agreed across the processes of a job.

Under ``torch.distributed`` (DDP, FSDP2) every rank runs the same model on its
own shard of the batch. Each rank measures its own blocks, and timings (and,
with uneven batches, bytes) differ from rank to rank, so a planner run on each
rank alone would choose different plans: different step times, different peaks,
and collectives that may not line up. Here the ranks agree instead:

* :func:`agree_same` checks that every rank holds the same value (block names,
  decisions): every rank gathers every rank's value, so all of them raise
  together when one differs (a rank that raised alone would leave the others
  waiting in the next collective);
* :func:`agree_profile` replaces each number of a profile by its largest value
  over the ranks (``all_reduce`` with ``MAX`` on one flat tensor of bytes and
  one of times): bytes of the rank with the most, times of the slowest rank
  (a synchronous step runs at the pace of its slowest rank). After it, the
  profiles of all ranks are equal, so :func:`remat.plan` (deterministic)
  chooses the same plan on each of them;
* :func:`agree_max` / :func:`agree_min`: a few numbers (measured peaks,
  budgets) agreed the same way, so every rank takes the same branch.

All of them are collectives: every rank of the group must call them, in the
same order. Without an initialized process group (or with one rank) they
return their input unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._errors import PlanError


def active(distributed: bool | None = None) -> bool:
    """Whether to agree with other ranks: ``distributed=None`` means when a process group
    with more than one rank is initialized; ``False`` never; ``True`` requires one."""
    if distributed is False:
        return False
    up = dist.is_available() and dist.is_initialized()
    if distributed is True and not up:
        raise RuntimeError(
            "remat: distributed=True needs an initialized torch.distributed process group "
            "(torch.distributed.init_process_group, or run under torchrun)."
        )
    return up and dist.get_world_size() > 1


def _device() -> torch.device:
    """Where the backend reduces tensors: the current CUDA device for NCCL, else CPU."""
    backend = dist.get_backend()
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_same(value: Any, what: str) -> None:
    """Raise ``PlanError`` on every rank unless every rank passed an equal ``value``.

    ``value`` must be picklable and comparable with ``==``; ``what`` names it in the
    message.
    """
    if not active():
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    differ = [r for r, v in enumerate(gathered) if v != gathered[0]]
    if differ:
        raise PlanError(
            f"remat: the ranks disagree on {what}: rank 0 has {gathered[0]!r:.200}, rank "
            f"{differ[0]} has {gathered[differ[0]]!r:.200}. Every rank must plan the same model "
            "(same block names, same decisions to measure, inputs of the same shapes)."
        )


def _reduce(values: Sequence[float], dtype: torch.dtype, op: Any) -> list[Any]:
    if not active() or not values:
        return list(values)
    t = torch.tensor(list(values), dtype=dtype, device=_device())
    dist.all_reduce(t, op=op)
    return t.cpu().tolist()  # type: ignore[no-any-return]


def agree_max(values: Sequence[int]) -> list[int]:
    """The element-wise largest of ``values`` (ints, int64) over the ranks."""
    return [int(v) for v in _reduce([int(v) for v in values], torch.int64, dist.ReduceOp.MAX)]


def agree_min(values: Sequence[int]) -> list[int]:
    """The element-wise smallest of ``values`` (ints, int64) over the ranks."""
    return [int(v) for v in _reduce([int(v) for v in values], torch.int64, dist.ReduceOp.MIN)]


def agree_max_float(values: Sequence[float]) -> list[float]:
    """The element-wise largest of ``values`` (float64) over the ranks."""
    return [float(v) for v in _reduce([float(v) for v in values], torch.float64, dist.ReduceOp.MAX)]


#: The profile's fields that are bytes, and those that are times (or FLOPs).
_INT_FIELDS = (
    "top", "pre", "static_bytes", "grad_bytes", "optimizer_state_bytes",
    "optimizer_first_bytes", "optimizer_later_bytes", "end_bytes", "end_grads", "top_grads", "scratch_bytes",
    "shared_bytes",
)  # fmt: skip
_BLOCK_INTS = ("fwd_start", "bwd_start", "input_bytes", "param_bytes", "bwd_grads", "held_to_end")
_BLOCK_INT_DICTS = ("retained", "fwd_excess", "bwd_excess", "exit_freed", "pre_exit")
_BLOCK_FLOAT_DICTS = ("cost", "noise")


def profile_numbers(prof: Any) -> tuple[list[int], list[float]]:
    """The profile's bytes and times, flattened in a fixed order (see :func:`set_profile_numbers`)."""
    ints = [int(getattr(prof, f)) for f in _INT_FIELDS]
    floats = [float(prof.step_cost)]
    for b in prof.blocks:
        ints += [int(getattr(b, f)) for f in _BLOCK_INTS]
        for f in _BLOCK_INT_DICTS:
            d = getattr(b, f)
            ints += [int(d[k]) for k in sorted(d)]
        for f in _BLOCK_FLOAT_DICTS:
            d = getattr(b, f)
            floats += [float(d[k]) for k in sorted(d)]
    return ints, floats


def set_profile_numbers(prof: Any, ints: Sequence[int], floats: Sequence[float]) -> Any:
    """A copy of ``prof`` with the numbers of :func:`profile_numbers` replaced, in that order."""
    it, ft = iter(ints), iter(floats)
    out = dataclasses.replace(prof, **{f: next(it) for f in _INT_FIELDS})
    out.step_cost = next(ft)
    blocks = []
    for b in prof.blocks:
        nb = dataclasses.replace(b, **{f: next(it) for f in _BLOCK_INTS})
        for f in _BLOCK_INT_DICTS:
            setattr(nb, f, {k: next(it) for k in sorted(getattr(b, f))})
        for f in _BLOCK_FLOAT_DICTS:
            setattr(nb, f, {k: next(ft) for k in sorted(getattr(b, f))})
        blocks.append(nb)
    out.blocks = blocks
    return out


def structure(prof: Any) -> tuple[Any, ...]:
    """What must be the same on every rank before numbers can be combined."""
    return (
        [b.name for b in prof.blocks],
        list(prof.decisions),
        prof.cost_unit,
        prof.grads_kept,
        prof.optimizer,
        [
            tuple(sorted(getattr(b, f))) for b in prof.blocks for f in
            (*_BLOCK_INT_DICTS, *_BLOCK_FLOAT_DICTS)
        ],
    )  # fmt: skip


def agree_profile(prof: Any) -> Any:
    """The profile every rank plans with: each number the largest over the ranks.

    Raises ``PlanError`` on every rank when the ranks profiled different blocks or
    decisions. Returns ``prof`` itself without a process group of two or more ranks.
    """
    if not active():
        return prof
    agree_same(structure(prof), "the profiled blocks and decisions")
    ints, floats = profile_numbers(prof)
    out = set_profile_numbers(prof, agree_max(ints), agree_max_float(floats))
    # a span input is offered for offload only where every rank found it free to move
    for b, f in zip(out.blocks, agree_min([b.offload_input for b in prof.blocks])):
        b.offload_input = f
    return out
