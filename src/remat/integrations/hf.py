"""Hugging Face transformers: remat's checkpointing on a model's layers, and a Trainer callback.

transformers marks the layers it checkpoints itself (the decoder and encoder layers
of every stack: text, vision tower, encoder and decoder of a seq2seq model) as
instances of ``transformers.GradientCheckpointingLayer``. The functions here select
the same layers (:func:`layer_names`, the outermost such modules, in the order
``named_modules`` lists them) and put remat's checkpointing on them with
:func:`remat.checkpoint_wrapper` (:func:`checkpoint_layers`) or with a plan for a
budget (:func:`auto_checkpoint`); :func:`uncheckpoint_layers` undoes either.
Names and ``state_dict`` keys do not change, so checkpoints load as before.

**The cache.** A layer that appends to a KV cache in forward would append again in
its recompute. transformers' own switch turns caching off while it checkpoints (in
training mode with gradients enabled; evaluation and ``generate`` keep the cache),
and so does this one, with forward pre-hooks (public PyTorch API, removed by
:func:`uncheckpoint_layers`):

* every module above the layers whose ``forward`` takes ``use_cache`` (the model,
  its stacks) is called with ``use_cache=False``, so no cache is created;
* every selected layer is called with ``use_cache=False`` and without the cache
  arguments transformers clears (``cache``, ``layer_past``), unless its class says
  that it only reads the cache (transformers' class attribute
  ``_can_checkpoint_with_cache``; read with ``getattr`` and ``False`` when absent,
  as transformers' layer does).

An explicit ``use_cache=True`` (or a cache) dropped this way is logged once (logger
``"remat"``), as transformers warns once. Only public transformers names are used
(``GradientCheckpointingLayer``, the ``gradient_checkpointing`` attribute its switch
sets, ``activation_checkpointing_disable()``), besides that one marker.

**transformers' own switch.** Where it is on (``TrainingArguments(activation_checkpointing=
True)``, its deprecated alias ``gradient_checkpointing=True``, or
``model.activation_checkpointing_enable()``), the functions here and the Trainer callback
turn it off and plan or wrap the layers it would have checkpointed, saying so once (logger
``"remat"``): a layer is never checkpointed twice.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from remat.integrations import hf
    >>> config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = LlamaForCausalLM(config).train()
    >>> hf.checkpoint_layers(model)
    ['model.layers.0', 'model.layers.1']
    >>> ids = torch.randint(0, 64, (2, 8))
    >>> model(input_ids=ids, labels=ids).loss.backward()   # no cache appended twice
    >>> hf.uncheckpoint_layers(model) is model
    True
"""

from __future__ import annotations

from ._hf_layers import (
    auto_checkpoint,
    checkpoint_layers,
    is_layer,
    layer_names,
    uncheckpoint_layers,
)
from ._hf_trainer import RematCallback

__all__ = [
    "RematCallback",
    "auto_checkpoint",
    "checkpoint_layers",
    "is_layer",
    "layer_names",
    "uncheckpoint_layers",
]
