"""How much of a training step the candidate blocks cover, for the plan's table.

The *share* of a profile's blocks is what they keep for backward in the unchecked step
(every block ``keep``: the sum of their ``retained["keep"]``) against the step's
activations: what it holds above its start between the last block's forward and that
block's backward, gradients excluded (``Profile.top - Profile.top_grads``: the blocks'
saved tensors, those of the model's code outside them, the head's and the loss's). What
the share leaves out is in code outside the blocks (a stem at full resolution, a large
head, an encoder beside the planned decoder), which no plan of these blocks checkpoints;
below :data:`LOW_SHARE` the table warns and names ``check_fn``.

Where the unchecked peak falls in backward, after gradients or with optimizer state, a
budget may stay out of reach with a share near 1 (``PlanError`` names the smallest
reachable peak): the share is about which blocks were found, not about the budget.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from remat import Profile

#: Below this share the table warns: most of the step's bytes are outside the blocks.
LOW_SHARE = 0.5


def block_share(profile: Profile) -> float:
    """The share (0 to 1) of the unchecked step's activations that the profile's blocks keep
    for backward (see the module docstring); 0 when the step has none.

    Example:
        >>> import torch, remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> prof = remat.profile(model, torch.randn(32, 64), timer="flops")
        >>> round(block_share(prof), 2)
        1.0
    """
    activations = profile.top - profile.top_grads
    if activations <= 0:
        return 0.0
    kept = sum(b.retained.get("keep", 0) for b in profile.blocks)
    return min(max(kept / activations, 0.0), 1.0)


def coverage_note(profile: Profile) -> str | None:
    """The table's warning when the blocks cover less than :data:`LOW_SHARE` of the step
    (``None`` otherwise): how much they cover and how to pick others.

    Example:
        >>> import torch, remat
        >>> class Net(torch.nn.Module):  # a wide head outside the two small blocks
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.blocks = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        ...         self.head = torch.nn.Linear(8, 4096)
        ...     def forward(self, x):
        ...         return self.head(self.blocks(x)).relu()
        >>> prof = remat.profile(Net(), torch.randn(16, 8), timer="flops")
        >>> print(coverage_note(prof))  # doctest: +ELLIPSIS
        the candidate blocks keep ...% of the unchecked step's activations; ...
    """
    share = block_share(profile)
    if share >= LOW_SHARE:
        return None
    return (
        f"the candidate blocks keep {100 * share:.0f}% of the unchecked step's activations; "
        "the rest is in code outside them, which no plan of these blocks checkpoints. Pass "
        "check_fn=lambda name, module: ... to plan the modules that hold it."
    )


def name_ranges(names: Sequence[str]) -> str:
    """The block names, consecutive indices of one stack as a range, for the table.

    Example:
        >>> name_ranges(["encoder.block.0", "encoder.block.1", "encoder.block.2",
        ...              "decoder.block.0", "head"])
        'encoder.block.0-2, decoder.block.0, head'
    """
    parts: list[str] = []
    run: tuple[str, int, int] | None = None  # prefix, first, last
    for name in names:
        m = re.fullmatch(r"(.*?)(\d+)", name)
        if m and run and m[1] == run[0] and int(m[2]) == run[2] + 1:
            run = (run[0], run[1], int(m[2]))
            continue
        if run:
            parts.append(_range(run))
        run = (m[1], int(m[2]), int(m[2])) if m else None
        if not m:
            parts.append(name)
    if run:
        parts.append(_range(run))
    return ", ".join(parts)


def _range(run: tuple[str, int, int]) -> str:
    prefix, first, last = run
    return f"{prefix}{first}" if first == last else f"{prefix}{first}-{last}"
