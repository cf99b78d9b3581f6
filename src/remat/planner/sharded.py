"""Bytes that data parallelism adds to a rank's step: FSDP2's unsharded parameters, DDP's buckets.

The planner's bytes are one rank's: a budget is the peak of one process on its
device. Two kinds of memory of data-parallel wrappers are invisible to an
operator-level tracker, and are counted here:

* **FSDP2** (``fully_shard``): each parameter is a ``DTensor`` whose local shard
  is what the rank keeps; :func:`remat.planner.state.storage_bytes` counts the
  shard (the local tensor), not the global size the ``DTensor`` reports. Before a
  sharded module runs, FSDP2 all-gathers its parameters into storages that it
  resizes in place (``UntypedStorage.resize_``: to full size before the forward
  and before the backward, to 0 after them when ``reshard_after_forward``); no
  operator sees such a resize. :func:`unsharded_storages` finds those storages
  once (``FSDPModule.unshard()``, then ``reshard()``: public API), and the
  planner's trackers :meth:`~remat.memory.MemoryTracker.watch` them, so the
  measured windows see the unsharded parameters exactly when they are alive:
  in the forward of their block, in its backward (recompute included: FSDP2
  gathers a block once for its backward, and its recompute runs inside it, so a
  recomputed block gathers no more than a kept one) and, without
  ``reshard_after_forward``, from the forward to the backward.
* **DDP**: the reducer allocates gradient buckets when the wrapper is built, one
  flat buffer per bucket, as many bytes as the parameters that require grad.
  They are alive for the whole run, so they count as static bytes
  (:func:`bucket_bytes`). With ``gradient_as_bucket_view=True`` the parameters'
  ``.grad`` are views of the buckets: :func:`bucket_view_params` names them so
  that their gradients are not counted a second time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..engine.bytes import storage_key


def _fsdp_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return None
    return FSDPModule  # type: ignore[no-any-return]


def _ddp_class() -> type | None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return None
    return DistributedDataParallel


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to, outermost first."""
    cls = _fsdp_class()
    if cls is None:
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) was applied to ``model`` or a submodule."""
    return bool(fsdp_modules(model))


def unsharded_storages(model: nn.Module) -> list[torch.UntypedStorage]:
    """The storages FSDP2 gathers ``model``'s parameters into (empty while resharded).

    A collective (every rank calls it): each sharded module is unsharded, the
    storages of its now unsharded parameters are read, and it is resharded. Call
    it between steps, after one step ran (FSDP2 initializes lazily).
    """
    mods = fsdp_modules(model)
    if not mods:
        return []
    for m in mods:
        m.unshard()  # type: ignore[operator]
    try:
        found: dict[int, torch.UntypedStorage] = {}
        for m in mods:
            for p in m.parameters():
                if _is_dtensor(p):  # still sharded: a parameter FSDP2 does not gather
                    continue
                st = p.untyped_storage()
                found.setdefault(storage_key(st), st)
    finally:
        for m in reversed(mods):
            m.reshard()  # type: ignore[operator]
    return list(found.values())


def reshard(model: nn.Module) -> None:
    """Free every unsharded FSDP2 parameter of ``model`` (a forward without backward,
    as under ``no_grad``, leaves them gathered when ``reshard_after_forward=False``)."""
    for m in fsdp_modules(model):
        m.reshard()  # type: ignore[operator]


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def is_ddp(model: nn.Module) -> bool:
    """Whether ``model`` is or holds a ``DistributedDataParallel`` wrapper."""
    return bool(_ddps(model))


def _ddps(model: nn.Module) -> list[Any]:
    cls = _ddp_class()
    if cls is None:
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


def _bucketed(ddp: Any) -> list[torch.Tensor]:
    ignored: set[str] = set(getattr(ddp, "parameters_to_ignore", ()))
    return [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]


def bucket_bytes(model: nn.Module, device: torch.device | None) -> int:
    """Bytes of the gradient buckets of the DDP wrappers in ``model`` (on ``device``;
    all when ``None``): one dense buffer as large as the parameters that require grad."""
    total = 0
    for ddp in _ddps(model):
        for p in _bucketed(ddp):
            if device is None or p.device == device:
                total += p.numel() * p.element_size()
    return total


def bucket_view_params(model: nn.Module) -> set[int]:
    """``id`` of the parameters whose ``.grad`` is a view of a DDP bucket
    (``gradient_as_bucket_view=True``): their gradient bytes are the buckets'."""
    out: set[int] = set()
    for ddp in _ddps(model):
        if getattr(ddp, "gradient_as_bucket_view", False):
            out.update(id(p) for p in _bucketed(ddp))
    return out
