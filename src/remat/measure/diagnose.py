"""Boundary diagnostics: why checkpointing did not lower the peak, and what to do.

The usual causes of "memory did not go down" are where the checkpoints are, not
how they are solved (pytorch #147449, DeepSpeed #5704, transformers #30404).
Each rule reads the facts of one instrumented step (:class:`remat.measure.probe.StepProbe`)
and names the module and the fix:

* :attr:`Kind.FREES_NOTHING`: a region that drops (almost) nothing, because what
  it saves for backward is mostly its own input, which the checkpoint keeps
  anyway (wrapping every child of a block instead of the block: a Linear, a
  norm, an activation saves its input). Fires when it frees at most a tenth of
  what it would keep; regions inside another one are left to :attr:`Kind.NESTED`.
* :attr:`Kind.RAISES_PEAK`: the step's peak is higher with checkpointing than
  without, by at least 1 % (measured: :func:`remat.explain` and :func:`remat.verify`
  run both); names the region being recomputed when the peak is reached.
* :attr:`Kind.NESTED`: a module checkpointed twice (a checkpoint inside another
  one, Hugging Face's own gradient checkpointing left on under a remat wrapper):
  its forward runs three times a step. Seen where the regions start, and by
  counting: a module whose forward runs at least twice as often in backward as
  in forward. Nesting a plan chose is left out: spans over several blocks and
  split blocks recompute their parts on purpose (Chen et al. 2016).
* :attr:`Kind.LOSS_HEAD`: the peak falls in the loss head (after the last block)
  and the head's tensors (logits, their softmax and gradient) are at least half
  of it: no checkpoint of the blocks can lower it; chunk the loss.
"""

from __future__ import annotations

import dataclasses
import enum

from torch import nn

from ..engine.bytes import fmt_bytes
from ..modules.split import is_split
from .probe import StepProbe
from .records import Alloc

#: A region frees "almost nothing" when it frees at most this share of what it would keep.
FREES_NOTHING_SHARE = 0.1
#: Checkpointing "raises the peak" when it adds at least this share of the plain step's peak
#: (smaller rises, a few position ids kept as inputs, are not worth a warning).
RAISES_PEAK_SHARE = 0.01
#: The loss head "dominates" the peak when its tensors are at least this share of it.
LOSS_HEAD_SHARE = 0.5


class Kind(enum.Enum):
    """What a :class:`Diagnostic` is about.

    Example:
        >>> Kind.NESTED.value
        'nested checkpoints'
    """

    FREES_NOTHING = "frees almost nothing"
    RAISES_PEAK = "raises the peak"
    NESTED = "nested checkpoints"
    LOSS_HEAD = "loss head dominates"


@dataclasses.dataclass(frozen=True)
class Diagnostic:
    """A warning about a checkpoint boundary: the module, what happens, and what to do.

    Attributes:
        kind: which rule fired (:class:`Kind`).
        module: the module it is about (its name in the model).
        message: what happens and what to do, in one paragraph.

    Example:
        >>> d = Diagnostic(Kind.NESTED, "layers.0", "checkpointed twice; keep one.")
        >>> str(d)
        'warning: layers.0: nested checkpoints: checkpointed twice; keep one.'
    """

    kind: Kind
    module: str
    message: str

    def __str__(self) -> str:
        return f"warning: {self.module}: {self.kind.value}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        """``{"kind", "module", "message"}`` for JSON."""
        return {"kind": self.kind.value, "module": self.module, "message": self.message}


def related(a: str, b: str) -> bool:
    """Whether one module name is the other or inside it."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def hf_checkpointing(model: nn.Module | None) -> list[str]:
    """Modules with Hugging Face's own gradient checkpointing on (and in training mode)."""
    if model is None:
        return []
    return [
        name
        for name, m in model.named_modules()
        if getattr(m, "gradient_checkpointing", False) is True and m.training
    ]


def _split(model: nn.Module | None) -> list[str]:
    """Blocks a plan split (checkpointed, and their children inside: nested on purpose)."""
    if model is None:
        return []
    return [name for name, m in model.named_modules() if is_split(m)]


def _hf_advice(module: str, hf: list[str]) -> str:
    if not hf:
        return ""
    if any(related(module, h) for h in hf) or any(h == "" for h in hf):
        return (
            " Hugging Face's own activation checkpointing is on"
            f" ({hf[0] or 'the model'}): turn it off with"
            " model.activation_checkpointing_disable() (gradient_checkpointing_disable() in"
            " older transformers; in a Trainer: TrainingArguments(activation_checkpointing="
            "False), or let remat.integrations.hf.RematCallback take it over) where remat"
            " checkpoints the layers."
        )
    return ""


def frees_nothing(probe: StepProbe) -> list[Diagnostic]:
    """Regions that free at most :data:`FREES_NOTHING_SHARE` of what they would keep."""
    found = []
    for s in probe.region_stats():
        if s.kind != "checkpoint" or s.dropped_bytes < 0 or s.nested:
            continue  # a nested region's inputs and saves belong to the one around it
        would = s.dropped_bytes + s.saved_input_bytes
        freed = s.dropped_bytes - s.extra_input_bytes
        if would == 0 and s.extra_input_bytes == 0:
            continue
        if freed > FREES_NOTHING_SHARE * would:
            continue
        calls = f" over its {s.calls} calls" if s.calls > 1 else ""
        if would == 0:
            why = "it saves nothing for backward, yet the checkpoint keeps its input"
        elif s.dropped_bytes <= FREES_NOTHING_SHARE * would:
            why = (
                f"what it saves is mostly its own input ({fmt_bytes(s.saved_input_bytes)}), "
                "which the checkpoint keeps anyway"
            )
        else:
            why = (
                f"the input it keeps ({fmt_bytes(s.extra_input_bytes)}) is as large as what it "
                f"drops ({fmt_bytes(s.dropped_bytes)})"
            )
        found.append(
            Diagnostic(
                Kind.FREES_NOTHING,
                s.label,
                f"checkpointing it frees {fmt_bytes(max(freed, 0))} of the {fmt_bytes(would)} "
                f"it would keep for backward{calls}: {why}, and backward still pays its "
                "recompute. Checkpoint the block that contains it (one region over a larger "
                "module) instead, or leave it unwrapped.",
            )
        )
    return found


def raises_peak(probe: StepProbe, peak_bytes: int, plain_peak: int | None) -> list[Diagnostic]:
    """The peak with checkpointing above the peak without it (both measured)."""
    if plain_peak is None or peak_bytes - plain_peak < max(1, RAISES_PEAK_SHARE * plain_peak):
        return []
    p = probe.peak
    head = (
        f"the step's peak is {fmt_bytes(peak_bytes)} with checkpointing and "
        f"{fmt_bytes(plain_peak)} without it (+{fmt_bytes(peak_bytes - plain_peak)})."
    )
    where = f"{p.op} at {p.line}" if p.line else p.op
    if p.recompute_of is not None:
        return [
            Diagnostic(
                Kind.RAISES_PEAK,
                p.recompute_of,
                f"{head} It falls in backward, while this region is recomputed ({where}): "
                "rematerializing it there, next to the gradients alive at that point, costs "
                "more than keeping its activations saved. Do not checkpoint it (keep its "
                "activations), or checkpoint a larger block around it so that its recompute "
                "happens earlier in backward.",
            )
        ]
    regions = sorted({s.label for s in probe.region_stats()})
    names = ", ".join(regions[:4]) + (f" and {len(regions) - 4} more" if len(regions) > 4 else "")
    phase = "backward" if p.backward else "forward"
    module = p.module if p.module in probe.calls or not regions else regions[0]
    return [
        Diagnostic(
            Kind.RAISES_PEAK,
            module,
            f"{head} It falls in {phase} ({where}), where the inputs the checkpoints keep "
            f"({names}) add to what is alive. Leave out the wraps that free nothing, or "
            "checkpoint fewer, larger blocks.",
        )
    ]


def nested(probe: StepProbe, model: nn.Module | None) -> list[Diagnostic]:
    """Modules checkpointed twice: found where regions start, and by counting forward calls."""
    hf = hf_checkpointing(model)
    split = _split(model)
    found: list[Diagnostic] = []
    covered: list[str] = [*split]  # a split block's children run three times by design
    for n in probe.nestings.values():
        if any(related(n.inner, b) for b in split):
            continue
        if n.how == "torch.utils.checkpoint inside remat's checkpoint":
            module = n.outer
            text = (
                f"torch.utils.checkpoint runs inside remat's checkpoint of it (at {n.inner}): "
                "backward recomputes the layer twice, once for each checkpoint."
            )
        elif n.how == "remat inside torch's checkpoint":
            module = n.inner
            text = (
                "remat's checkpoint of it runs inside torch.utils.checkpoint: backward "
                "recomputes it twice, once for each checkpoint."
            )
        elif n.how == "recomputed by it in backward":
            module = n.inner
            text = (
                "its checkpoint was created in backward, by the recompute of a reentrant "
                "checkpoint around it (torch.utils.checkpoint with use_reentrant=True): it is "
                "recomputed twice."
            )
        else:
            module = n.inner
            text = (
                f"it is checkpointed inside the checkpoint of {n.outer}: its forward runs three "
                "times a step (forward, the outer region's recompute, its own recompute)."
            )
        covered.append(module)
        found.append(
            Diagnostic(
                Kind.NESTED,
                module,
                f"{text} Keep one of the two checkpoints.{_hf_advice(module, hf)}",
            )
        )
    flagged = [
        name
        for name, (fwd, bwd) in probe.calls.items()
        if fwd > 0 and bwd >= 2 * fwd and name not in probe.spanned
    ]
    flagged = [n for n in flagged if not any(n != o and n.startswith(o + ".") for o in flagged)]
    for name in flagged:
        if any(related(name, c) for c in covered):
            continue
        fwd, bwd = probe.calls[name]
        found.append(
            Diagnostic(
                Kind.NESTED,
                name,
                f"its forward runs {fwd + bwd} times a step ({fwd} in forward, {bwd} recomputed "
                "in backward): two nested checkpoints cover it. Keep one of the two."
                + _hf_advice(name, hf),
            )
        )
    return sorted(found, key=lambda d: d.module)


def loss_head(probe: StepProbe) -> list[Diagnostic]:
    """The peak in the loss head, its tensors at least :data:`LOSS_HEAD_SHARE` of it."""
    start = probe.head_start
    p = probe.peak
    t = probe.peak_at
    labels = probe.head_labels()
    if start is None or p.bytes == 0 or t < start or p.module not in labels:
        return []
    end = probe.head_end  # backward leaves the head (reaches the blocks) there
    if p.backward and end is not None and t >= end:
        return []
    head: list[Alloc] = [
        a
        for a in probe.order
        if a.alive_at(t)
        and a.born >= start
        and a.module in labels
        and (not a.backward or end is None or a.born < end)
    ]
    head_bytes = sum(a.nbytes for a in head)
    if head_bytes < LOSS_HEAD_SHARE * p.bytes:
        return []
    by_module: dict[str, int] = {}
    for a in head:
        by_module[a.module] = by_module.get(a.module, 0) + a.nbytes
    module = max(by_module, key=lambda m: by_module[m])
    big = max(head, key=lambda a: a.nbytes)
    shape = "x".join(str(d) for d in big.shape) or "scalar"
    phase = "backward" if p.backward else "forward"
    return [
        Diagnostic(
            Kind.LOSS_HEAD,
            module,
            f"the step's peak ({fmt_bytes(p.bytes)} above the start of the step) falls in the "
            f"loss head, after the last block ({phase}, {p.op}"
            + (f" at {p.line}" if p.line else "")
            + f"), and {fmt_bytes(head_bytes)} of it are the head's tensors (the largest: "
            f"{shape} {str(big.dtype).removeprefix('torch.')} from {big.op} in {big.module}). "
            "No checkpoint of the blocks can lower it. Compute the loss in chunks (run the "
            "head and the loss on slices of the sequence or batch, each slice checkpointed, "
            "as a chunked cross-entropy does) so that the logits and their gradient are never "
            "all alive at once.",
        )
    ]


def diagnose_step(
    probe: StepProbe, model: nn.Module | None, *, peak_bytes: int, plain_peak: int | None
) -> list[Diagnostic]:
    """Every rule on one instrumented step, in the order of the module docstring.

    A region nested with another one is only reported as such: what it frees follows
    from the nesting (a remat checkpoint around torch's keeps an input and drops nothing).
    """
    twice = nested(probe, model)
    return [
        *(d for d in frees_nothing(probe) if not any(related(d.module, n.module) for n in twice)),
        *raises_peak(probe, peak_bytes, plain_peak),
        *twice,
        *loss_head(probe),
    ]
