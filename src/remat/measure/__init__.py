"""Measurement: one instrumented step, what it allocates and keeps, and what to do about it.

Private as a whole: :mod:`remat` re-exports the public names (``remat.explain``,
``remat.verify``, ``remat.Explanation``, ``remat.Report``, ``remat.Diagnostic``); import them
from there. Modules carry no leading underscore (the rule of :mod:`remat.engine`); a name
that starts with one is its module's alone.

Above :mod:`remat.engine` and :mod:`remat.modules`, below the planner (which reads the
diagnostics); imports run one way, each module importing only those before it::

    records ──> probe ──> diagnose ──> explain, verify

* The meter is :mod:`remat.memory` (public, at the package root beside
  :mod:`remat.policies`): exact storage bytes alive per device, with the peak; storage
  identity and bytes, which it counts with, are :mod:`remat.engine.bytes` (the engine's
  offload counts with them too, so they sit at the bottom).
* :mod:`.records`: the plain records of one instrumented step (:class:`~.records.Alloc`,
  :class:`~.records.Reason`, :class:`~.records.RegionStats`, ...).
* :mod:`.probe`: :class:`~.probe.StepProbe`, the observer of :mod:`remat.engine.observe`
  that fills them.
* :mod:`.diagnose`: the rules that read them and name the module and the fix
  (:class:`~remat.Diagnostic`).
* :mod:`.explain`: :func:`~remat.explain`, what a step keeps for backward and why;
  :mod:`.verify`: :func:`~remat.verify`, one step with checkpointing and one without,
  compared (bytes formatted as every figure remat prints, :func:`remat.engine.bytes.fmt_bytes`).
"""
