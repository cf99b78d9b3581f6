"""``--blocks PATTERN``: the API's ``check_fn`` from the shell.

``PATTERN`` is one or more shell-style globs over the model's module names, separated by
commas (``'blocks.*'``, ``'encoder.block.*,decoder.block.*'``, ``'model.layers.?'``),
matched with :func:`fnmatch.fnmatchcase` against each module's full name (as
``model.named_modules()`` gives it). As with ``check_fn``, the outermost matching modules
are the blocks: ``'blocks.*'`` also matches ``blocks.0.attn``, which is inside
``blocks.0`` and is not a block of its own. A glob rather than a regular expression: module
names are dotted paths with numbers, which globs write without escaping the dots.

The pattern is checked against the model before any step runs: one that selects no module
is a usage error naming the model's default blocks and a pattern for them.

The planner's messages name ``check_fn=``, the API's argument; :func:`for_the_shell`
rewrites them to name this flag where the CLI prints them.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
from collections.abc import Callable, Sequence

from torch import nn

from ..modules.blocks import default_blocks
from ._usage import UsageError

BlockFilter = Callable[[str, nn.Module], bool]


def add_blocks_argument(p: argparse.ArgumentParser, verb: str) -> None:
    """The ``--blocks`` option of a subcommand that picks blocks; ``verb`` says what for."""
    p.add_argument(
        "--blocks",
        metavar="PATTERN",
        default=None,
        help=f"the blocks to {verb}: globs over module names, comma-separated, the outermost "
        "match a block (e.g. 'blocks.*' or 'encoder.block.*,decoder.block.*'; the API's "
        "check_fn; default: the model's repeated blocks)",
    )


def parse_blocks(text: str) -> tuple[str, ...]:
    """The globs of ``--blocks``, checked before any model is built.

    Example:
        >>> parse_blocks("encoder.block.*, decoder.block.*")
        ('encoder.block.*', 'decoder.block.*')
    """
    globs = tuple(g.strip() for g in text.split(","))
    if not text.strip() or not all(globs):
        raise UsageError(
            f"--blocks {text!r}: an empty pattern; pass globs over module names separated by "
            "commas, e.g. --blocks 'blocks.*'."
        )
    return globs


class NameFilter:
    """``check_fn(name, module)``: True for a module whose full name matches a glob."""

    def __init__(self, globs: Sequence[str]) -> None:
        self.globs = tuple(globs)

    def __call__(self, name: str, module: nn.Module) -> bool:
        return any(fnmatch.fnmatchcase(name, g) for g in self.globs)

    def __repr__(self) -> str:
        return f"NameFilter({','.join(self.globs)!r})"


def suggest(names: Sequence[str]) -> str:
    """A ``--blocks`` value selecting ``names``: each number in a name becomes ``*``.

    Example:
        >>> suggest(["encoder.block.0", "encoder.block.1", "decoder.block.0"])
        'encoder.block.*,decoder.block.*'
    """
    out: list[str] = []
    for n in names:
        g = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", n)
        if g not in out:
            out.append(g)
    return ",".join(out)


def blocks_filter(model: nn.Module, text: str | None) -> BlockFilter | None:
    """``check_fn`` for ``--blocks text`` on ``model`` (``None`` without the flag).

    Raises:
        UsageError: the pattern selects no module of ``model``; names the default blocks and
            a pattern for them.
    """
    if text is None:
        return None
    pick = NameFilter(parse_blocks(text))
    if any(pick(name, m) for name, m in model.named_modules() if name):
        return pick
    try:
        found = default_blocks(model)
    except Exception:  # a model without repeated blocks: name its children instead
        found = []
    if found:
        hint = f"its repeated blocks are {', '.join(found[:3])}{', ...' if len(found) > 3 else ''}"
        hint += f" (--blocks '{suggest(found)}')"
    else:
        children = [n for n, _ in model.named_children()]
        hint = f"its children are {', '.join(children[:6]) or 'none'}"
    raise UsageError(
        f"--blocks {text!r} selects no module of {type(model).__name__}: {hint}. Pass globs "
        "over the names model.named_modules() gives."
    )


_CHECK_FN = re.compile(r"check_fn=(?:lambda name, module: )?\.\.\.")


def for_the_shell(text: str) -> str:
    """The planner's advice with the API's ``check_fn=...`` named as this flag.

    Example:
        >>> for_the_shell("Raise the budget or pick finer blocks (check_fn=...).")
        'Raise the budget or pick finer blocks (--blocks PATTERN).'
        >>> for_the_shell("Pass check_fn=lambda name, module: ... that selects the blocks")
        'Pass --blocks PATTERN that selects the blocks'
    """
    text = _CHECK_FN.sub("--blocks PATTERN", text)
    return re.sub(r"\bcheck_fn\b", "--blocks", text)
