"""Module level: checkpointing put on a model's ``nn.Module`` s, and what remat knows of a model.

Private as a whole: :mod:`remat` re-exports the public names
(``remat.checkpoint_wrapper``, ``remat.apply_activation_checkpointing``, ``remat.unwrap``,
...); import them from there. Modules carry no leading underscore (the rule of
:mod:`remat.engine`); a name that starts with one is its module's alone.

Above :mod:`remat.engine` (whose regions these put on modules); imports run one way, each
module importing only those before it::

    blocks ──> modelinfo, wrap ──> split ──> spans

* :mod:`.blocks`: the default candidate blocks, the repeated blocks of every stack (one rule
  for the wrappers and the planner).
* :mod:`.modelinfo`: the model's facts the wrappers, ``verify`` and the planner share (its
  candidate blocks in call order, its device, its loss, the checks a model must pass).
* :mod:`.wrap`: :func:`~remat.checkpoint_wrapper`, :func:`~remat.offload_wrapper`,
  :func:`~remat.unwrap`, :func:`~remat.apply_activation_checkpointing`: a module
  checkpointed in place, the same object.
* :mod:`.split`: a block split in parts (its children with parameters as their own regions).
* :mod:`.spans`: a span, consecutive blocks of a chain checkpointed as one region.

Words: a **block** is a candidate module (a transformer layer); a **span** is consecutive
blocks checkpointed as one region; **split** checkpoints a block's children instead of the
block.
"""
