"""Optional dependencies: import one, or say which extra installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, where: str) -> ModuleType:
    """Import ``module``, or raise ``ImportError`` naming the pip extra that installs it.

    Example:
        >>> require("math", "none", "remat.example").pi > 3
        True
        >>> require("no_such_module_xyz", "hf", "remat.integrations.hf")
        Traceback (most recent call last):
        ...
        ImportError: remat.integrations.hf needs no_such_module_xyz, which is not installed: pip install 'remat[hf]'.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name != module and not module.startswith(e.name + "."):
            raise  # the framework itself is there but broken: its own error says why
        raise ImportError(
            f"{where} needs {module}, which is not installed: pip install 'remat[{extra}]'."
        ) from None
