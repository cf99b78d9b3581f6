"""Errors raised by remat.

All of them derive from one base, so ``except remat.RematError`` catches every
error the library raises on purpose::

    RematError (Exception)
    ├── CheckpointError (also torch.utils.checkpoint.CheckpointError, a RuntimeError)
    │       recomputation did not reproduce the forward
    └── PlanError (also ValueError)
            a memory budget no plan can meet, or a plan that does not fit the model

``CheckpointError`` subclasses torch's class of the same name, so code written
against ``torch.utils.checkpoint`` that catches torch's error keeps working.
"""

from __future__ import annotations

import torch.utils.checkpoint as _torch_checkpoint


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class CheckpointError(RematError, _torch_checkpoint.CheckpointError):
    """Recomputation did not reproduce what the forward saved.

    Raised in backward when the checkpointed function saved a different number
    of tensors in recompute, tensors of another shape, dtype or device
    (``determinism_check="default"``) or other values (``"values"``).
    """


class PlanError(RematError, ValueError):
    """A plan cannot be made or applied (for example: a budget below the smallest reachable peak)."""
