"""``remat plan --hf-config``: a Hugging Face causal language model built from its config on
the meta device, planned without a factory and without allocating its weights.

The config is a ``config.json`` file, a folder holding one (a downloaded checkpoint), or
the JSON text itself (``'{"model_type": "llama", ...}'``); ``model_type`` names the
architecture. The model is ``AutoModelForCausalLM.from_config(config, dtype=...)`` under
``with torch.device("meta")``, with ``use_cache=False`` (a training step: checkpointing
recomputes the layers, and a key/value cache appended twice would be wrong), and its
inputs are ``input_ids`` and ``labels`` of shape ``(batch, seq)`` on meta (the model
computes its own loss).

transformers looks at the position ids once per forward to find sequences packed into one
row (``masking_utils.find_packed_sequence_indices``), a test of values that a meta tensor
does not have; :func:`remat.planner.meta.one_sequence_a_row` answers it as the inputs built here are: one
sequence a row.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ..planner.inputs import Inputs
from ._usage import UsageError

#: ``--dtype`` names and their dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(text: str) -> dict[str, Any]:
    """The config's fields from a ``config.json``, a folder holding one, or JSON text.

    Example:
        >>> read_config('{"model_type": "llama", "hidden_size": 64}')["hidden_size"]
        64
    """
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise UsageError(f"--hf-config: the JSON text does not parse: {e}.") from None
    else:
        path = os.path.join(text, "config.json") if os.path.isdir(text) else text
        if not os.path.isfile(path):
            raise UsageError(
                f"--hf-config {text!r}: no such file; pass a config.json, a folder holding "
                'one, or the config as JSON text (\'{"model_type": "llama", ...}\').'
            )
        try:
            with open(path) as fh:
                data = json.load(fh)
        except (OSError, ValueError) as e:
            raise UsageError(f"--hf-config {path}: cannot read it as JSON: {e}.") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise UsageError(
            "--hf-config: the config must be a JSON object with a 'model_type' "
            '("llama", "gpt2", ...), as a model\'s config.json has.'
        )
    return data


def build(
    fields: dict[str, Any], batch: int, seq: int, dtype: torch.dtype
) -> tuple[torch.nn.Module, Inputs, str]:
    """The causal language model of ``fields`` on meta in ``dtype``, its inputs and a label."""
    try:
        import transformers
    except ImportError:
        raise UsageError("--hf-config needs transformers: pip install transformers.") from None
    fields = {**fields, "use_cache": False}
    kind = fields.pop("model_type")
    try:
        config = transformers.AutoConfig.for_model(kind, **fields)
    except ValueError as e:
        raise UsageError(f"--hf-config: {e}") from None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    model.train()
    count = sum(p.numel() for p in model.parameters())
    label = (
        f"{type(model).__name__} from its config on the meta device ({count:,} parameters, "
        f"{str(dtype).removeprefix('torch.')}), input_ids and labels of "
        f"batch {batch} x seq {seq}"
    )
    return model, Inputs(input_ids=ids, labels=ids), label
