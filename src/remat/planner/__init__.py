"""The planner: measure a model's blocks, model the training step, solve, apply.

Data flows one way: model -> :mod:`.measure` (raw measurements) -> :mod:`.model`
(the step model: predicted peak and cost of a plan) -> :mod:`.solve` (exact
solvers) -> :mod:`.plan` (:class:`Plan`) -> :mod:`.apply` (decisions on modules).
:mod:`.auto` puts them together in :func:`auto_checkpoint`.
"""

from .auto import auto_checkpoint, measure_peak
from .measure import Profile, profile
from .plan import Plan, plan

__all__ = ["Plan", "Profile", "auto_checkpoint", "measure_peak", "plan", "profile"]
