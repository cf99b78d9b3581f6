"""Budgets: bytes from what a user writes (``"60%"``, ``"18GiB"``, ``2**30``)."""

from __future__ import annotations

import math
import re

from ...engine.bytes import fmt_bytes
from ..types import ProfileData
from .peak import unchecked_peak

#: The unchecked step's peak :func:`check_budget` reads a percentage against: large, so
#: that any share reads as bytes and only the budget's form is checked.
_ANY_PEAK = 2**62


def parse_budget(
    budget: int | float | str, static: int, unchecked: int, where: str = "remat.plan"
) -> int:
    """Bytes from ``budget``: the absolute step peak it allows (the one parser of budgets:
    the API's functions, the callbacks and the CLI's ``--budget`` all read them here).

    Bytes are an int (``2**30``) or a size string: ``"1.5GiB"``, ``"512MiB"``,
    ``"18GB"``. Binary prefixes (``KiB``, ``MiB``, ``GiB``, ``TiB``) are powers
    of 1024; decimal ones (``KB``, ``MB``, ``GB``, ``TB``) powers of 1000, as
    in the SI (and in Hugging Face's ``max_memory``). A percentage ``"60%"``
    is ``static`` plus that share of what the unchecked step allocates above
    ``static`` (``unchecked - static``); it must be above ``0%``, and ``100%``
    or more is met by keeping every block.

    A bare number in a string (``"50"``, ``--budget 50``) is refused, never read as bytes:
    it names both readings (``"50%"`` or ``"50B"``). A float between 0 and 1 (``0.5``,
    ``torch.compile``'s memory budget) is refused with its percentage. Errors start
    with ``where`` and name the value.

    Example:
        >>> parse_budget("50%", 1000, 3000), parse_budget(2048, 0, 1), parse_budget("1.5KiB", 0, 1)
        (2000, 2048, 1536)
        >>> parse_budget("2GB", 0, 1), parse_budget("2GiB", 0, 1)
        (2000000000, 2147483648)
        >>> parse_budget("50", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: remat.plan: budget='50' is a bare number: 50% (a share) or 50 bytes? Write budget='50%' for the share or '50B' for bytes (or a size such as '50MiB').
    """
    hint = (
        "Pass the step's peak in bytes (a positive int such as 2**30, or a size such as "
        "'1.5GiB' or '18GB'), or a percentage above 0% such as '60%' of what the unchecked "
        "step allocates above its static bytes."
    )
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)):
        raise TypeError(
            f"{where}: budget must be bytes (int) or a string, got {type(budget).__name__} "
            f"{budget!r}. {hint}"
        )
    if isinstance(budget, (int, float)):
        if isinstance(budget, float) and 0 < budget < 1:
            raise ValueError(
                f"{where}: budget={budget!r} is read as bytes (less than one); for a share "
                f"write it as a percentage string: budget='{budget * 100:g}%'."
            )
        if not math.isfinite(budget) or budget < 1:
            raise ValueError(f"{where}: budget must be >= 1 byte, got {budget!r}. {hint}")
        return int(budget)
    m = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*%\s*", budget)
    if m:
        pct = float(m.group(1))
        if not pct > 0:
            raise ValueError(f"{where}: budget percentage must be above 0%, got {budget!r}. {hint}")
        return static + int(max(unchecked - static, 0) * pct / 100)
    m = re.fullmatch(r"\s*([+-]?\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", budget, re.IGNORECASE)
    if m:
        if m.group(2) is None and float(m.group(1)) > 0:
            n = m.group(1).lstrip("+")
            raise ValueError(
                f"{where}: budget={budget!r} is a bare number: {n}% (a share) or {n} bytes? "
                f"Write budget='{n}%' for the share or '{n}B' for bytes (or a size such as "
                f"'{n}MiB')."
            )
        unit = (m.group(2) or "B").upper()
        scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}.get(unit) or {
            "KIB": 2**10,
            "MIB": 2**20,
            "GIB": 2**30,
            "TIB": 2**40,
        }[unit]
        out = int(float(m.group(1)) * scale)
        if out < 1:
            raise ValueError(f"{where}: budget must be >= 1 byte, got {budget!r}. {hint}")
        return out
    raise ValueError(f"{where}: cannot read budget {budget!r}. {hint}")


def check_budget(budget: object, where: str) -> None:
    """Raise ``TypeError``/``ValueError`` (starting with ``where``) unless ``budget`` is a
    budget :func:`parse_budget` reads: its form, checked before any step runs (what a
    percentage is in bytes needs the profile).

    Example:
        >>> check_budget("60%", "remat.auto_checkpoint")
        >>> check_budget("abc", "remat.auto_checkpoint")
        Traceback (most recent call last):
        ...
        ValueError: remat.auto_checkpoint: cannot read budget 'abc'. Pass the step's peak in bytes (a positive int such as 2**30, or a size such as '1.5GiB' or '18GB'), or a percentage above 0% such as '60%' of what the unchecked step allocates above its static bytes.
    """
    parse_budget(budget, 0, _ANY_PEAK, where)  # type: ignore[arg-type]


def is_share(budget: object) -> bool:
    """Whether ``budget`` is a percentage (``"60%"``)."""
    return isinstance(budget, str) and budget.strip().endswith("%")


def smallest_share(static: int, unchecked: int, low: int) -> str:
    """The smallest percentage (two decimals) that :func:`parse_budget` reads as at least
    ``low`` bytes, with ``static`` and ``unchecked`` as it takes them.

    Example:
        >>> smallest_share(400, 1000, 700), smallest_share(400, 1000, 701)
        ('50%', '50.17%')
    """
    span = max(unchecked - static, 1)
    pct = max(math.ceil((low - static) * 10000 / span), 1)  # hundredths of a percent
    while parse_budget(f"{pct / 100:.2f}%", static, unchecked) < low:
        pct += 1
    return f"{pct / 100:.2f}".rstrip("0").rstrip(".") + "%"


def budget_of(prof: ProfileData, budget: int | float | str) -> int:
    """``budget`` in bytes for ``prof``: a percentage is of the unchecked step's activations
    (tensors), with the static bytes and the largest scratch inside operators on top (at
    least the unchecked step's peak as the allocator counts it at ``100%``; plans count the
    scratch where it happens: :mod:`.allocator`)."""
    scratch = prof.scratch.bytes
    return parse_budget(
        budget, prof.static_step_bytes + scratch, unchecked_peak(prof).bytes + scratch
    )


def share_note(prof: ProfileData, budget: object, low: int) -> str:
    """For a percentage ``budget`` no plan reaches (``low``: the smallest budget a plan
    meets), what its share is of, the part of it that no plan removes, and the smallest
    share that is reachable; ``""`` for a budget in bytes."""
    if not is_share(budget):
        return ""
    scratch = prof.scratch.bytes
    static = prof.static_step_bytes + scratch
    unchecked = unchecked_peak(prof).bytes + scratch
    fixed = low - static
    return (
        f" budget={budget!r} is a share of the {fmt_bytes(unchecked - static)} the unchecked "
        f"step allocates above its static bytes{' and largest scratch' if scratch else ''} "
        f"({fmt_bytes(static)}); {fmt_bytes(fixed)} of that "
        f"({100 * fixed / max(unchecked - static, 1):.1f}%: gradients, optimizer state and "
        f"the activations no plan of these blocks drops) stays under every plan, so the "
        f"smallest reachable share is budget='{smallest_share(static, unchecked, low)}'."
    )
