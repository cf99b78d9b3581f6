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
  (a synchronous step runs at the pace of its slowest rank). Which fields agree how is
  said by each field's metadata in :mod:`remat.planner.types` (``SAME``, ``MAX``,
  ``MIN``; a field without it is the rank's own: the device, the input shapes). After it, the
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
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..engine.errors import PlanError
from .types import Fit, ProfileData, term_parts, with_parts

P = TypeVar("P", bound=ProfileData)


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


def _fields(obj: Any, kind: str) -> list[tuple[str, bool]]:
    """The fields of a dataclass that agree by ``kind`` (their ``metadata["agree"]``), each
    with whether its numbers are floats (times, FLOPs: ``metadata["fit"]`` is
    :attr:`~remat.planner.types.Fit.TIME`) rather than ints (bytes)."""
    return [
        (f.name, f.metadata.get("fit") is Fit.TIME)
        for f in dataclasses.fields(obj)
        if f.metadata.get("agree") == kind
    ]


def _numbers(obj: Any, kind: str, ints: list[int], floats: list[float]) -> None:
    """The numbers of ``obj``'s fields that agree by ``kind``, in field order (a dict's by
    sorted key), appended to ``ints`` or ``floats`` by the field's type."""
    for name, is_float in _fields(obj, kind):
        v = getattr(obj, name)
        values = [v[k] for k in sorted(v)] if isinstance(v, dict) else [v]
        if is_float:
            floats += [float(x) for x in values]
        else:
            ints += [int(x) for x in values]


def _replaced(obj: Any, kind: str, ints: Iterator[int], floats: Iterator[float]) -> Any:
    """A copy of ``obj`` with the numbers of :func:`_numbers` taken from the iterators."""
    changes: dict[str, Any] = {}
    for name, is_float in _fields(obj, kind):
        v = getattr(obj, name)
        source = floats if is_float else ints
        if isinstance(v, dict):
            changes[name] = {k: next(source) for k in sorted(v)}
        else:
            changes[name] = next(source)
    return dataclasses.replace(obj, **changes)


def profile_numbers(prof: ProfileData, kind: str = "max") -> tuple[list[int], list[float]]:
    """The profile's numbers that agree by ``kind`` (``"max"``: bytes and times; ``"min"``),
    flattened in a fixed order: the profile's fields, its groups', then each block's
    (:func:`~remat.planner.types.term_parts`; see :func:`set_profile_numbers`)."""
    ints: list[int] = []
    floats: list[float] = []
    for _, part in term_parts(prof):
        _numbers(part, kind, ints, floats)
    return ints, floats


def set_profile_numbers(
    prof: ProfileData, ints: Sequence[int], floats: Sequence[float], kind: str = "max"
) -> Any:
    """A copy of ``prof`` with the numbers of :func:`profile_numbers` replaced, in that order."""
    it, ft = iter(ints), iter(floats)
    return with_parts(prof, lambda _, part: _replaced(part, kind, it, ft))


def structure(prof: ProfileData) -> tuple[Any, ...]:
    """What must be the same on every rank before numbers can be combined: the fields that
    agree as ``"same"`` (the profile's, its groups' and its blocks'), and the keys of every
    dict of numbers among them (a block's per-decision terms, the profile's
    ``shared.inputs``: ranks that saw other shared block inputs cannot be combined number
    by number)."""
    same: list[str] = []
    for _, part in term_parts(prof):
        same += [repr(getattr(part, f)) for f, _ in _fields(part, "same")]
        for kind in ("max", "min"):
            same += [
                repr(sorted(map(str, getattr(part, f))))
                for f, _ in _fields(part, kind)
                if isinstance(getattr(part, f), dict)
            ]
    return tuple(same)


def agree_profile(prof: P) -> P:
    """The profile every rank plans with: each number the largest over the ranks (the
    smallest for fields that agree by ``"min"``: a span input is offered for offload only
    where every rank found it free to move), as each field's metadata says
    (:data:`remat.planner.types.MAX`).

    Raises ``PlanError`` on every rank when the ranks profiled different blocks or
    decisions. Returns ``prof`` itself without a process group of two or more ranks.
    """
    if not active():
        return prof
    agree_same(structure(prof), "the profiled blocks, decisions and shared block inputs")
    ints, floats = profile_numbers(prof)
    out = set_profile_numbers(prof, agree_max(ints), agree_max_float(floats))
    ints, floats = profile_numbers(out, "min")
    return set_profile_numbers(out, agree_min(ints), floats, "min")  # type: ignore[no-any-return]
