"""Ready-made selective-checkpointing policies.

Matmul-like operators (matrix products, attention, convolutions) are the
expensive ones to recompute and their outputs are a small part of a
transformer block's activations; norms, activations, dropout and adds are
cheap to recompute. Saving (or offloading) the former and recomputing the
latter keeps most of the memory win of full checkpointing at a fraction of
its time.

Example:
    >>> import functools, torch, remat
    >>> ctx_fn = functools.partial(remat.create_selective_checkpoint_contexts,
    ...                            remat.policies.save_matmuls())
    >>> lin = torch.nn.Linear(8, 8)
    >>> x = torch.randn(4, 8, requires_grad=True)
    >>> y = remat.checkpoint(lambda t: torch.nn.functional.gelu(lin(t)), x, context_fn=ctx_fn)
    >>> y.sum().backward()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.utils.checkpoint as _tuc

#: The policy enum is torch's own, so policies written for torch work unchanged.
CheckpointPolicy = _tuc.CheckpointPolicy

_MATMUL_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "convolution",
    "_convolution",
    "mkldnn_convolution",
    "cudnn_convolution",
)


def matmul_ops() -> frozenset[Any]:
    """The ATen overloads of matrix products, attention (SDPA, CPU and CUDA) and convolutions.

    ``nn.Linear`` and ``torch.matmul`` reach these (``addmm``, ``mm``, ``bmm``)
    in eager mode, so they are covered too.

    Example:
        >>> import torch, remat
        >>> torch.ops.aten.mm.default in remat.policies.matmul_ops()
        True
    """
    ops = []
    for name in _MATMUL_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            ops.append(getattr(packet, overload))
    return frozenset(ops)


class OpPolicy:
    """Policy: ``on_match`` for the listed operators, ``otherwise`` for the rest.

    A plain policy function for :func:`remat.create_selective_checkpoint_contexts`
    (and for torch's), with a fast path in remat: no context object is built
    per operator.

    Args:
        ops: ATen operator overloads.
        on_match: policy for the listed operators.
        otherwise: policy for every other operator.

    Example:
        >>> import torch, remat
        >>> p = remat.policies.OpPolicy([torch.ops.aten.mm.default])
        >>> p(None, torch.ops.aten.mm.default)
        <CheckpointPolicy.MUST_SAVE: 0>
    """

    __slots__ = ("ops", "on_match", "otherwise")

    def __init__(
        self,
        ops: Iterable[Any],
        on_match: CheckpointPolicy = CheckpointPolicy.MUST_SAVE,
        otherwise: CheckpointPolicy = CheckpointPolicy.PREFER_RECOMPUTE,
    ) -> None:
        self.ops = frozenset(ops)
        for op in self.ops:
            if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
                hint = (
                    f" Use a specific overload, for example {op}.default."
                    if isinstance(op, torch._ops.OpOverloadPacket)
                    else ""
                )
                raise ValueError(
                    f"OpPolicy: expected ATen operator overloads in ops, got {op!r} of type "
                    f"{type(op).__name__}.{hint}"
                )
        self.on_match = on_match
        self.otherwise = otherwise

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return self.on_match if op in self.ops else self.otherwise

    def __repr__(self) -> str:
        return f"OpPolicy({len(self.ops)} ops, on_match={self.on_match.name}, otherwise={self.otherwise.name})"


def save_matmuls(prefer: bool = False) -> OpPolicy:
    """Save the outputs of matmul-like operators, recompute everything else.

    Args:
        prefer: answer ``PREFER_SAVE`` instead of ``MUST_SAVE``: an output the
            region changes in place (``F.relu(linear(x), inplace=True)``, ``nn.GRU``'s
            gate products) is then recomputed rather than raising
            :class:`~remat.CheckpointError` in backward (what the planner's
            ``selective`` decision uses).

    Example:
        >>> import remat
        >>> remat.policies.save_matmuls().on_match.name, remat.policies.save_matmuls(prefer=True).on_match.name
        ('MUST_SAVE', 'PREFER_SAVE')
    """
    if not isinstance(prefer, bool):
        raise TypeError(f"save_matmuls: prefer must be True or False, got {prefer!r}.")
    return OpPolicy(
        matmul_ops(), CheckpointPolicy.PREFER_SAVE if prefer else CheckpointPolicy.MUST_SAVE
    )


def offload_matmuls() -> OpPolicy:
    """Keep the outputs of matmul-like operators in host memory, recompute everything else.

    On a device the outputs are copied to pinned host memory asynchronously and
    brought back for backward; on CPU-only setups they stay where they are.

    Example:
        >>> import remat
        >>> remat.policies.offload_matmuls().on_match.name
        'MUST_CPU_OFFLOAD'
    """
    return OpPolicy(matmul_ops(), CheckpointPolicy.MUST_CPU_OFFLOAD)
