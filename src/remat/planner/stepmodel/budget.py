"""Budgets: bytes from what a user writes (``"60%"``, ``"18GiB"``, ``2**30``)."""

from __future__ import annotations

import math
import re

from ..types import ProfileData
from .peak import unchecked_peak


def parse_budget(budget: int | float | str, static: int, unchecked: int) -> int:
    """Bytes from ``budget``: the absolute step peak it allows.

    Bytes are an int (``2**30``) or a size string: ``"1.5GiB"``, ``"512MiB"``,
    ``"18GB"``. Binary prefixes (``KiB``, ``MiB``, ``GiB``, ``TiB``) are powers
    of 1024; decimal ones (``KB``, ``MB``, ``GB``, ``TB``) powers of 1000, as
    in the SI (and in Hugging Face's ``max_memory``). A percentage ``"60%"``
    is ``static`` plus that share of what the unchecked step allocates above
    ``static`` (``unchecked - static``); it must be above ``0%``, and ``100%``
    or more is met by keeping every block.

    Example:
        >>> parse_budget("50%", 1000, 3000), parse_budget(2048, 0, 1), parse_budget("1.5KiB", 0, 1)
        (2000, 2048, 1536)
        >>> parse_budget("2GB", 0, 1), parse_budget("2GiB", 0, 1)
        (2000000000, 2147483648)
    """
    hint = (
        "Pass the step's peak in bytes (a positive int such as 2**30, or a size such as "
        "'1.5GiB' or '18GB'), or a percentage above 0% such as '60%' of what the unchecked "
        "step allocates above its static bytes."
    )
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(
            f"remat.plan: budget must be bytes (int) or a string, got {type(budget).__name__} "
            f"{budget!r}. {hint}"
        )
    if isinstance(budget, (int, float)):
        if isinstance(budget, float) and 0 < budget < 1:
            raise ValueError(
                f"remat.plan: budget={budget!r} is read as bytes (less than one); for a share "
                f"write it as a percentage string: budget='{budget * 100:g}%'."
            )
        if not math.isfinite(budget) or budget < 1:
            raise ValueError(f"remat.plan: budget must be >= 1 byte, got {budget!r}. {hint}")
        return int(budget)
    m = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*%\s*", budget)
    if m:
        pct = float(m.group(1))
        if not pct > 0:
            raise ValueError(
                f"remat.plan: budget percentage must be above 0%, got {budget!r}. {hint}"
            )
        return static + int(max(unchecked - static, 0) * pct / 100)
    m = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", budget, re.IGNORECASE)
    if m:
        unit = (m.group(2) or "B").upper()
        scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}.get(unit) or {
            "KIB": 2**10,
            "MIB": 2**20,
            "GIB": 2**30,
            "TIB": 2**40,
        }[unit]
        out = int(float(m.group(1)) * scale)
        if out < 1:
            raise ValueError(f"remat.plan: budget must be >= 1 byte, got {budget!r}. {hint}")
        return out
    raise ValueError(f"remat.plan: cannot read budget {budget!r}. {hint}")


def budget_of(prof: ProfileData, budget: int | float | str) -> int:
    """``budget`` in bytes for ``prof``: a percentage is of the unchecked step's activations
    (tensors), with the static bytes and the largest scratch inside operators on top (at
    least the unchecked step's peak as the allocator counts it at ``100%``; plans count the
    scratch where it happens: :mod:`.allocator`)."""
    scratch = prof.scratch_bytes
    return parse_budget(
        budget, prof.static_step_bytes + scratch, unchecked_peak(prof).bytes + scratch
    )
