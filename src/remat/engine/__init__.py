"""The checkpoint engine: a region's forward, what it keeps, its recompute in backward.

Private as a whole: :mod:`remat` re-exports the public names (``remat.checkpoint``,
``remat.offload``, ``remat.CheckpointPolicy``, ...); import them from there. Modules inside
the private packages (``engine``, :mod:`remat.modules`, :mod:`remat.measure`) carry no
leading underscore; a name that starts with one is its module's alone.

Imports run one way, each module importing only those before it (and
:mod:`remat.policies`, the policy enum users pass in)::

    errors  tree  bytes  observe  torch_compat  config  debug      (import no engine module)
        ──> state ──> offload ──> selective ──> nonreentrant, reentrant, region
        ──> checkpoint ──> sequential, forms

* :mod:`.errors`: :class:`~remat.RematError` and the errors derived from it (the tree is
  drawn there).
* :mod:`.tree`: the tensors in a nested value, found and replaced.
* :mod:`.bytes`: storage identity and bytes, the one place that knows which storage holds a
  tensor's memory and how many bytes that is; :mod:`remat.memory`, :mod:`remat.measure` and
  the planner count with it, the engine's offload and selective cache too (hence here, at
  the bottom).
* :mod:`.observe`: the engine's hook point for :func:`remat.explain` (the observer itself,
  :mod:`remat.measure.probe`, sits above).
* :mod:`.torch_compat`: what differs between torch versions, one name per difference.
* :mod:`.config`: the settings and flags, each a ``ContextVar``; the region depth counters;
  :class:`~.config.StopRecompute`, the early-stop signal.
* :mod:`.debug`: the operator log a determinism error prints.
* :mod:`.state`: the RNG, autocast and default-device state captured in forward and
  replayed in recompute.
* :mod:`.offload`: host offload (pinned buffers, streams, prefetch).
* :mod:`.selective`: :class:`~remat.CheckpointPolicy` dispatch and the selective cache.
* :mod:`.nonreentrant`: the saved-tensor-hooks engine (frames, recompute, early stop);
  :mod:`.reentrant`: the ``autograd.Function`` variant; :mod:`.region`: one call of a
  wrapped module, guarded against side effects in recompute.
* :mod:`.checkpoint`: :func:`~remat.checkpoint` (argument checks, dispatch to a variant);
  :mod:`.sequential`: :func:`~remat.checkpoint_sequential`; :mod:`.forms`: the call forms
  of torch's and fairscale's wrappers mapped to remat's options.

Words: a **region** is one ``checkpoint`` frame (a forward that keeps its inputs and drops
what autograd saves inside it); **recompute** runs it again in backward; **early stop** ends
a recompute once every tensor backward needs is back.
"""
