"""Operator traces for ``debug=True``: what ran in forward and in recompute.

A :class:`OpLog` dispatch mode records, for each ATen operator, its name and
the user's source line that called it (the innermost frame outside torch and
remat). When recomputation does not reproduce the forward, :func:`report`
prints both lists side by side and marks the first line where they differ.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_TORCH_DIR = os.path.dirname(torch.__file__)
_REMAT_DIR = os.path.dirname(os.path.dirname(__file__))  # the package, not engine/ alone


def _user_line() -> str:
    f: Any = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if not (fn.startswith(_TORCH_DIR) or fn.startswith(_REMAT_DIR)):
            return f"{os.path.basename(fn)}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return "<unknown>"


class OpLog(TorchDispatchMode):
    """Records ``(operator, user source line)`` for every operator dispatched inside."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket.__name__)
        if name not in ("detach", "alias"):  # added by autograd's saving machinery
            self.ops.append((name, _user_line()))
        return func(*args, **(kwargs or {}))


def report(forward: list[tuple[str, str]], recompute: list[tuple[str, str]]) -> str:
    """Side-by-side table of forward and recompute operators, first divergence marked."""
    first = None
    for i in range(max(len(forward), len(recompute))):
        a = forward[i][0] if i < len(forward) else None
        b = recompute[i][0] if i < len(recompute) else None
        if a != b:
            first = i
            break
    cells = [f"{op} ({line})" for op, line in forward]
    width = max([len("forward")] + [len(c) for c in cells]) + 2
    lines = [f"   {'#':>4}  {'forward':<{width}}recompute"]
    for i in range(max(len(forward), len(recompute))):
        left = cells[i] if i < len(forward) else "-"
        right = f"{recompute[i][0]} ({recompute[i][1]})" if i < len(recompute) else "-"
        mark = ">> " if i == first else "   "
        lines.append(f"{mark}{i:>4}  {left:<{width}}{right}")
    if first is None:
        lines.append(
            "The operator sequences are the same; the values or metadata of a saved tensor differ."
        )
    else:
        lines.append(f"First divergence at operator #{first} (marked >>).")
    return "\n".join(lines)
