"""Where people train: Hugging Face transformers and Lightning, and plan vs actual per step.

* :mod:`remat.integrations.hf` (extra ``remat[hf]``): put remat's checkpointing on a
  transformers model's layers (:func:`~remat.integrations.hf.checkpoint_layers`), plan
  them (:func:`~remat.integrations.hf.auto_checkpoint`), and
  :class:`~remat.integrations.hf.RematCallback`, a ``transformers.TrainerCallback`` that
  plans for a budget on the first training batch and logs each step's peak.
* :mod:`remat.integrations.lightning` (extra ``remat[lightning]``):
  :class:`~remat.integrations.lightning.RematCallback`, the same for ``Trainer.fit``.
* :class:`PeakMeter` / :class:`PeakCheck`: a step's measured peak beside the plan's
  prediction and the budget, for the callbacks and for a plain loop.

The two framework modules import their framework, so they are imported only when used
(``from remat.integrations import hf``, or the attribute ``remat.integrations.hf``);
without the framework installed they raise an ``ImportError`` that names the extra.
"""

from __future__ import annotations

import importlib
from typing import Any

from .actual import PeakCheck, PeakMeter

__all__ = ["PeakCheck", "PeakMeter", "hf", "lightning"]

_LAZY = ("hf", "lightning")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
