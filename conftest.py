"""Doctest collection of src/remat: the integration modules whose framework (an optional
extra) is not installed are not collected (importing them raises, naming the extra)."""

from __future__ import annotations

import importlib.util

collect_ignore: list[str] = []
if importlib.util.find_spec("transformers") is None:
    collect_ignore += [
        "src/remat/integrations/hf.py",
        "src/remat/integrations/_hf_layers.py",
        "src/remat/integrations/_hf_trainer.py",
    ]
if importlib.util.find_spec("lightning") is None:
    collect_ignore += ["src/remat/integrations/lightning.py"]
