"""The planner: measure a model's blocks, model the training step, solve, apply.

Data flows one way, each module importing only those before it::

    types ──> stepmodel ──> chain ──> perblock ──> solve ──> probes ──> measure ──> shapes ──> auto
    (data)    (every term)  (DP)      (MILP/DP)   (plan())  (hooks)    (profile()) (varying)  (auto_checkpoint)
                   render (text) and apply (modules) sit beside them, under solve

* :mod:`.types`: the vocabulary as types: :class:`~.types.Decision` (an enum),
  :class:`~.types.Span`, :class:`~.types.Where` (a phase of the step), :class:`~.types.Window`
  (a window of the measured step), the measured
  :class:`~.types.Timeline` s and :class:`~.types.Measurements`, a block's terms
  (:class:`~.types.BlockCosts`), the data of a profile and of a plan, and how ranks agree
  over each field (its metadata).
* :mod:`.stepmodel` owns every term of the predicted peak and cost: the per-block terms
  derived from the timelines (pair-effect corrections included), the segments (one
  running-sum accumulator per kind of span, read by the reference evaluation and by the
  DP alike), the peak of a step and where it falls, the cost, what each block saves and
  adds, and budgets.
* :mod:`.chain` (spans) and :mod:`.perblock` (one decision per block) are exact solvers
  over the step model's rows; they have no formula of their own.
* :mod:`.solve`: :func:`plan` (the floor, the solve, the :class:`Plan` with its table
  from the same segments), :class:`Profile` (measured data with the step model's answers).
* :mod:`.render`: the plan's table and ``PlanError``'s text, rendered last, never parsed.
* :mod:`.apply`: decisions and spans put on modules.
* :mod:`.probes`: the recording hooks (named classes) the profile's steps run with;
  :mod:`.measure`: :func:`profile`, a short pipeline of those steps that records raw
  :class:`~.types.Measurements`, from which :func:`.stepmodel.profile_data` reads the profile;
  :mod:`.grouped`: a decision's uniform line assembled from pair steps (two blocks under it
  at a time), where no step may hold every block kept.
* :mod:`.shapefit`: the step model as a function of a varying size (profiles at a few
  sizes, every byte term fitted exactly, checked between them); :mod:`.shapes`:
  :class:`Shapes` (``auto_checkpoint(shapes=...)``) and :class:`ShapePlans`, the plan for
  each batch's size switched in before its forward.
* :mod:`.auto`: :func:`auto_checkpoint` and :func:`measure_peak`; :mod:`.inputs`: the
  model's inputs apart from the options (:class:`Inputs`).
* Beside them: :mod:`.loop` (the training loop's options as one :class:`~.loop.Loop`,
  and the one step runner), :mod:`.state` (what a step changes, put back; the bytes a step
  starts with), :mod:`.counting` (each operator a block runs: FLOPs, bytes moved, whether the
  selective cache saves it), :mod:`.calibration` (per-device constants that price counted
  work, timed once and cached), :mod:`.timing` (what each decision costs: modelled seconds,
  measured seconds or FLOPs), :mod:`.scratch` (scratch inside operators),
  :mod:`.amp` (the mixed-precision recipe), :mod:`.sharded` (FSDP2, DDP bytes),
  :mod:`.distributed` (one profile, one plan for all ranks), :mod:`.pipeline` (a plan per
  pipeline stage for the microbatches its schedule holds: :func:`plan_pipeline_stage`).

Words, each with one meaning here:

* **block**: a candidate module the planner decides for (a transformer layer).
* **decision**: what a block does with its activations (``keep``, ``recompute``,
  ``selective``, ``offload``, ``split``).
* **span**: consecutive blocks checkpointed as one region; its blocks' decision says how
  they run inside it (the span's *inner* decision).
* **segment**: a block alone or a span, with its peak, what it saves and what it costs: the
  rows the solvers plan over.
* **term**: one bound of the step model (a block's forward, backward, recompute, the head).
* **window**: a stretch of the measured step between two boundaries (a block's forward):
  a :class:`~.types.Window`; :class:`~.probes.WindowProbe` turns the block hooks into them.
* **timeline**: the bytes at every window boundary of one measured step.
* **region** (outside the planner): one ``checkpoint`` frame; the autocast context is
  the *autocast region*.
* **step model**: the prediction; **model** alone means the user's ``nn.Module``.
"""

from .auto import auto_checkpoint, measure_peak
from .inputs import Inputs
from .measure import profile
from .pipeline import StagePlan, StageShapePlans, plan_pipeline_stage
from .shapes import ShapePlans, Shapes
from .solve import Plan, Profile, plan

__all__ = [
    "Inputs",
    "Plan",
    "Profile",
    "ShapePlans",
    "Shapes",
    "StagePlan",
    "StageShapePlans",
    "auto_checkpoint",
    "measure_peak",
    "plan",
    "plan_pipeline_stage",
    "profile",
]
