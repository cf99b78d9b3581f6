"""Profiles from shapes alone: a model on the meta device measured as if on a real one.

A model built under ``with torch.device("meta"):`` (as large models are, before their
weights exist) runs its training step on meta tensors: every operator computes its
outputs' shapes and allocates nothing. Inside :func:`remat.engine.bytes.meta_holds_bytes` the
memory tracker counts each meta storage at its size, so every byte term of a profile is
what a real device holds: tensor storages are a function of shapes, dtypes and of which
tensors autograd saves, never of values. :func:`remat.profile` does this for a model whose
tensors are on meta; :func:`twin` makes a meta copy of a real model (its parameters,
buffers, inputs and optimizer: no bytes) so that :func:`remat.auto_checkpoint` plans a
model before any real step runs (none could run unchecked where it does not fit).

What a meta run cannot know, and how it is handled:

* **The device's own kernels.** ``scaled_dot_product_attention`` picks a fused kernel by
  device (on CPU the flash kernel, which saves a ``logsumexp``, not the ``seq x seq``
  weights); on meta it would always take the math path. :class:`AsDevice` routes each call
  as the target device would: on CPU by torch's own choice (``torch._fused_sdp_choice`` on
  stand-in CPU tensors that hold one row), on CUDA by a rule of thumb (flash for 16-bit
  inputs without a mask and a head size <= 256 that is a multiple of 8, memory-efficient
  for other multiples of 8, else math; cuDNN's attention is not modelled). A boolean mask
  is first made the additive one torch makes (the fused kernels save it, in the query's
  dtype); grouped-query attention (``enable_gqa``) takes torch's choice on CPU (flash, which
  saves the unexpanded keys and values), the math path on CUDA.
* **Kernels' dtypes.** CPU's layer norm and batch norm keep their saved statistics in the
  input's (the weight's) dtype, the meta kernels in float32 as CUDA's do:
  :class:`CpuStatistics` gives them CPU's dtype for a CPU target.
* **Values a library reads.** transformers looks for sequences packed into one row in the
  position ids it makes (``arange``): :func:`one_sequence_a_row` answers "none" for meta
  ones (where the caller passes no ``position_ids`` of its own). torch's fused optimizers
  check their parameters' device before kernels that run on meta: :func:`fused_on_meta`.
* **Hooks.** The twin runs the model's own hook objects (shared, not copied: their owners,
  a Trainer's callback or a meter, are not the model's to copy).
* **Scratch inside operators** (oneDNN's, cuBLAS workspaces) shows only on a real
  device: a profile from shapes counts none (``Profile.from_shapes`` and the plan's table
  say so); :func:`remat.auto_checkpoint` measures it in one real step under the plan.
* **Shapes that depend on values** (a mixture of experts' routing: ``nonzero``, a
  ``.item()``): a meta run raises; :func:`remat.auto_checkpoint` then profiles on the
  device (logged), :func:`remat.profile` raises saying so.
* **Autocast** applies per device type and never to meta tensors: a meta model's profile
  inside ``torch.autocast`` is refused (build the model in the dtype it computes in); a real
  model inside autocast is profiled through a *fake* twin instead (:mod:`.fake`), whose
  tensors autocast casts.
* **offload** needs a device to copy from: it is not measured from shapes.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..engine.bytes import meta_holds_bytes
from ..engine.tree import replace_tensors, tensors_in

log = logging.getLogger("remat")

#: ``torch.nn.attention.SDPBackend``'s values, as ``torch._fused_sdp_choice`` returns them.
_MATH, _FLASH, _EFFICIENT = 0, 1, 2


def check_not_mixed(model: nn.Module, args: Any, where: str) -> None:
    """Raise ``ValueError`` when some of the model's parameters, buffers and tensor inputs
    are on the meta device and others are not (torch would fail inside the first step with
    "Tensor on device meta is not on the expected device" or "Cannot copy out of meta
    tensor"): naming which are where and the two ways out. A 0-dimensional input (a
    scalar) may be anywhere, and so may integer and boolean inputs beside a model on meta
    (token ids, masks: torch's meta kernels take them from the host, as ``nn.Embedding``
    does).

    Example:
        >>> import torch
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(4, 4)
        >>> check_not_mixed(model, (torch.empty(2, 4, device="meta"),), "remat.profile")
        >>> check_not_mixed(model, (torch.randn(2, 4),), "remat.profile")
        Traceback (most recent call last):
        ...
        ValueError: remat.profile: the model's parameters or buffers are on the meta device and its inputs on cpu; remat plans a model on the meta device from shapes, with inputs on meta too (torch.empty(shape, dtype=..., device="meta")), and measures real steps of a model whose weights exist: make the inputs meta tensors, or materialize the model first (model.to_empty(device=...), then initialize its weights or load a checkpoint).
    """
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    own = [*model.parameters(), *model.buffers()]
    inputs = [t for t in found if t.dim() > 0]
    model_meta = {t.is_meta for t in own}
    if model_meta == {True}:  # indices and masks may stay on the host
        inputs = [t for t in inputs if t.is_floating_point() or t.is_complex()]
    input_meta = {t.is_meta for t in inputs}
    if len(model_meta | input_meta) < 2:
        return
    if len(model_meta) == 2:
        what = "some of the model's parameters or buffers are on the meta device, others not"
    elif model_meta == {True}:
        where_in = sorted({str(t.device) for t in inputs if not t.is_meta})
        what = (
            "the model's parameters or buffers are on the meta device and its inputs on "
            + ", ".join(where_in)
        )
    else:
        where_m = sorted({str(t.device) for t in own if not t.is_meta})
        what = f"the inputs are on the meta device and the model on {', '.join(where_m)}"
    raise ValueError(
        f"{where}: {what}; remat plans a model on the meta device from shapes, with inputs "
        'on meta too (torch.empty(shape, dtype=..., device="meta")), and measures real steps '
        "of a model whose weights exist: make the inputs meta tensors, or materialize the "
        "model first (model.to_empty(device=...), then initialize its weights or load a "
        "checkpoint)."
    )


def is_meta(model: nn.Module, args: Any) -> bool:
    """Whether the model's tensors (its first parameter, else its first input) are on meta."""
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    first = next(iter([*model.parameters(), *found]), None)
    return first is not None and first.is_meta


def no_data(t: torch.Tensor) -> bool:
    """Whether ``t`` has shapes only: a meta tensor, or a fake one (its storage on meta)."""
    return t.is_meta or isinstance(t, FakeTensor)


def target_device(device: str | torch.device | None, where: str) -> torch.device:
    """The real device a profile from shapes stands for (``None``: CPU)."""
    if device is None:
        return torch.device("cpu")
    try:
        out = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"{where}: device must name the device the model will train on ('cpu', 'cuda', "
            f"'cuda:0'), got {device!r}."
        ) from None
    if out.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{where}: device must be 'cpu' or 'cuda' for a model on the meta device, got "
            f"{device!r}."
        )
    return out


def check_no_autocast(where: str) -> None:
    """Refuse a profile from shapes inside ``torch.autocast`` (autocast never casts meta
    tensors, so the bytes would be the full-precision step's)."""
    if any(torch.is_autocast_enabled(t) for t in ("cpu", "cuda")):
        raise ValueError(
            f"{where}: a model on the meta device cannot be profiled inside torch.autocast "
            "(autocast applies to CPU and CUDA tensors, never to meta ones, so the bytes would "
            "be the full-precision step's). Build the model in the dtype it computes in "
            "(model.to(torch.bfloat16)), or profile it on its device."
        )


class AsDevice:
    """Inside, ``scaled_dot_product_attention`` on meta tensors runs the kernel ``device``
    would run (see the module docstring); on other tensors it runs as it is.

    ``torch.nn.functional.scaled_dot_product_attention`` is replaced while inside (and put
    back on exit, exceptions included), not intercepted by a ``TorchFunctionMode``: a
    checkpoint's recompute runs in backward, where no such mode is active, and must run the
    forward's kernel.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._saved: list[Any] = []

    def __enter__(self) -> AsDevice:
        self._saved.append(F.scaled_dot_product_attention)
        F.scaled_dot_product_attention = self._attention  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        F.scaled_dot_product_attention = self._saved.pop()  # type: ignore[assignment]

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        sdpa = torch._C._nn.scaled_dot_product_attention
        if not query.is_meta or (enable_gqa and self.device.type != "cpu"):
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                        enable_gqa=enable_gqa)  # fmt: skip
        attn_mask = _additive(attn_mask, query.dtype)
        plain = (query, key, value, attn_mask, dropout_p, is_causal)
        choice = self._choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if choice == _FLASH and self.device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
        if choice == _FLASH:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale
            )[0]
        if choice == _EFFICIENT:
            need = attn_mask is not None and attn_mask.requires_grad
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
            )[0] if not need else sdpa(*plain, scale=scale)
        return sdpa(*plain, scale=scale, enable_gqa=enable_gqa)

    def _choice(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
    ) -> int:
        if self.device.type == "cpu":
            with _disable_current_modes():  # the stand-ins are no step's tensors
                return int(
                    torch._fused_sdp_choice(
                        _standin(q), _standin(k), _standin(v),
                        None if mask is None else _standin(mask),
                        dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
                    )  # fmt: skip
                )
        head = q.shape[-1]
        if head % 8 or head != v.shape[-1] or q.dim() != 4:
            return _MATH
        if q.dtype in (torch.float16, torch.bfloat16) and mask is None and head <= 256:
            return _FLASH
        return _EFFICIENT if q.dtype in (torch.float16, torch.bfloat16, torch.float32) else _MATH


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive one (0 where kept, ``-inf`` elsewhere, in the query's
    dtype) that ``scaled_dot_product_attention`` makes of it before choosing a kernel: the
    fused kernels save that one for backward, not the boolean mask."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    ninf = torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device)
    return torch.where(mask, 0.0, ninf)


class AutocastInForward(ValueError):
    """A meta model's step entered ``torch.autocast`` for the target's device type (inside its
    forward: accelerate's mixed precision wraps ``forward`` so), which never casts meta
    tensors: its bytes would be the full-precision step's. Raised by :class:`NoAutocast` at
    the first operator that runs in such a region;
    :class:`~remat.planner.shaped.ProfileSource` then profiles a fake twin instead."""


class NoAutocast(TorchFunctionMode):
    """Inside, a torch function called while autocast is on for ``device_type`` raises
    :class:`AutocastInForward` (a meta model's profile is refused inside autocast before
    any step: one that turns up inside its forward is caught here). A function mode, not a
    dispatch mode: autocast's state reads as off inside ``__torch_dispatch__``."""

    def __init__(self, device_type: str, where: str) -> None:
        super().__init__()
        self.device_type, self.where = device_type, where

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if torch.is_autocast_enabled(self.device_type):
            raise AutocastInForward(
                f"{self.where}: the model turns torch.autocast on inside its forward (as "
                "accelerate's mixed precision does), and autocast never casts meta tensors, so "
                "the bytes would be the full-precision step's: profile it on its device (a real "
                "model's auto_checkpoint profiles a fake copy, which autocast casts), or build "
                "it in the dtype it computes in."
            )
        return func(*args, **(kwargs or {}))


class CpuStatistics(TorchDispatchMode):
    """Inside, the normalisations on meta (and fake) tensors return their statistics in the
    dtype CPU's kernels do: layer (and group) norm's mean and reciprocal deviation in the input's dtype
    (float32 where the weight's dtype is another: a bfloat16 input under autocast), batch
    norm's saved mean and inverse deviation in the weight's (else the input's); the meta
    kernels return them in float32, as CUDA's do (or in the input's, for a fake tensor's
    mixed layer norm), and group norm's input gradient in the input's dtype. Saved for
    backward, they are bytes of the step."""

    _LAYER = torch.ops.aten.native_layer_norm.default
    _GROUP = torch.ops.aten.native_group_norm.default
    _GROUP_BACKWARD = torch.ops.aten.native_group_norm_backward.default
    _BATCH = torch.ops.aten.native_batch_norm.default

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is self._GROUP_BACKWARD and no_data(args[1]) and out[0] is not None:
            if out[0].dtype != args[1].dtype:  # the meta kernel's is float32 for mixed stats
                return (out[0].to(args[1].dtype), *out[1:])
        if func is self._LAYER or func is self._GROUP or func is self._BATCH:
            x = args[0]
            weight = args[2] if func is self._LAYER else args[1]
            dtype = weight.dtype if func is self._BATCH and weight is not None else x.dtype
            if func is not self._BATCH and weight is not None and weight.dtype != x.dtype:
                dtype = torch.float32  # mixed (autocast's bf16 input, float32 weight)
            if no_data(x) and out[1].dtype != dtype:
                return (out[0], *(t.to(dtype) for t in out[1:]))
        return out


def _standin(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor of ``t``'s shape, dtype and last-dimension stride 1 that holds one row."""
    if t.dim() == 0:
        return torch.empty((), dtype=t.dtype)
    base = torch.empty(t.shape[-1], dtype=t.dtype)
    return base.as_strided(t.shape, [0] * (t.dim() - 1) + [1])


def twin(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    optimizer: torch.optim.Optimizer | None,
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], torch.optim.Optimizer | None]:
    """A meta copy of the model (same modules, hooks and wrapping; parameters and buffers on
    meta), of its inputs and of its optimizer (same class, groups and hyper-parameters, an
    empty state): a training step of the copy allocates nothing.

    Raises ``TypeError`` for what cannot be copied so (a distributed model: DDP, FSDP2's
    sharded parameters).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> m, (x,), _, o = twin(model, (torch.randn(2, 4),), {}, opt)
        >>> m.weight.is_meta, x.is_meta, type(o).__name__, o.defaults["lr"]
        (True, True, 'SGD', 0.1)
    """
    return copy_model(model, args, kwargs, optimizer, _meta_of)


def copy_model(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    optimizer: torch.optim.Optimizer | None,
    copy_of: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], torch.optim.Optimizer | None]:
    """A copy of the model, its inputs and its optimizer in which each parameter, buffer
    and input is ``copy_of`` it (one copy per tensor): :func:`twin`'s, and the fake twin's
    (:func:`remat.planner.fake.fake_twin`). Raises ``TypeError`` for a distributed model or
    a parameter of a tensor subclass."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError("a DistributedDataParallel model is profiled on its device")
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if type(t) not in (torch.Tensor, nn.Parameter):
            raise TypeError(f"a parameter of type {type(t).__name__} is profiled on its device")
        if id(t) not in memo:
            memo[id(t)] = copy_of(t)
    found: list[torch.Tensor] = []
    tensors_in((args, kwargs), found)
    for t in found:
        if id(t) not in memo:
            memo[id(t)] = copy_of(t)
    for mod in model.modules():  # hooks are shared, not copied: they belong to their owners
        for name, value in vars(mod).items():
            if name.endswith("hooks") and isinstance(value, dict):
                for hook in value.values():
                    memo[id(hook)] = hook
    meta_model = copy.deepcopy(model, memo)
    meta_args, meta_kwargs = copy.deepcopy((args, kwargs), memo)
    meta_opt = None
    if optimizer is not None:
        groups = [
            {**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
             "params": [memo[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups
        ]  # fmt: skip
        cls: Any = type(optimizer)
        takes = inspect.signature(cls.__init__).parameters
        meta_opt = cls(groups, **{k: v for k, v in optimizer.defaults.items() if k in takes})
    return meta_model, meta_args, meta_kwargs, meta_opt


def on_meta(args: Any) -> Any:
    """``args`` with each tensor a meta copy of it (:func:`twin`'s, one per tensor; other
    leaves shared), for a batch of another shape than the one a twin was made with.

    Example:
        >>> import torch
        >>> (x, n), _ = on_meta(((torch.randn(2, 4), 3), {}))
        >>> x.is_meta, list(x.shape), n
        (True, [2, 4], 3)
    """
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    memo: dict[int, torch.Tensor] = {}
    for t in found:
        if id(t) not in memo:
            memo[id(t)] = _meta_of(t)
    return replace_tensors(args, [memo[id(t)] for t in found], [0])


@contextlib.contextmanager
def shapes_only(target: torch.device | None, own_positions: bool) -> Iterator[None]:
    """Inside, meta tensors hold their bytes and run ``target``'s kernels (``None``: nothing
    changes): :func:`~remat.engine.bytes.meta_holds_bytes`, :class:`AsDevice`,
    :class:`CpuStatistics` for CPU, :func:`fused_on_meta`, and with ``own_positions`` (no
    ``position_ids`` passed) :func:`one_sequence_a_row`. What :func:`remat.profile` runs a
    meta model's steps in."""
    if target is None:
        yield
        return
    fixes = CpuStatistics() if target.type == "cpu" else contextlib.nullcontext()
    rows = one_sequence_a_row() if own_positions else contextlib.nullcontext()
    with meta_holds_bytes(), AsDevice(target), fixes, rows, fused_on_meta():
        yield


@contextlib.contextmanager
def one_sequence_a_row() -> Iterator[None]:
    """Inside, transformers (where imported) finds no sequences packed into one row of meta
    position ids, as a model that makes its own position ids (``arange`` of the length) has
    none: ``masking_utils.find_packed_sequence_indices`` tests their values, which meta
    tensors do not have. Real position ids are looked at as before; put back on exit. Not
    used where the caller passes its own ``position_ids`` (packed rows are possible then).
    """
    masking: Any = sys.modules.get("transformers.masking_utils")
    found = getattr(masking, "find_packed_sequence_indices", None)
    if found is None:
        yield
        return
    masking.find_packed_sequence_indices = _OneSequenceARow(found)
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = found


@contextlib.contextmanager
def fused_on_meta() -> Iterator[None]:
    """Inside, torch's fused optimizers (``AdamW(fused=True)``, the Trainer's default) take
    meta parameters: their kernels have meta implementations, only the device check before
    them refuses meta. Put back on exit."""
    from torch.optim import optimizer as optim

    devices = optim._get_fused_kernels_supported_devices

    def with_meta() -> list[str]:
        return [*devices(), "meta"]

    optim._get_fused_kernels_supported_devices = with_meta
    try:
        yield
    finally:
        optim._get_fused_kernels_supported_devices = devices


class _OneSequenceARow:
    """``find_packed_sequence_indices`` answering "none packed" for meta position ids."""

    def __init__(self, found: Any) -> None:
        self.found = found

    def __call__(self, position_ids: torch.Tensor) -> Any:
        return None if no_data(position_ids) else self.found(position_ids)


def _meta_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` on meta (same shape, strides, dtype, ``requires_grad``; a parameter stays one)."""
    with torch.no_grad():
        m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(m, requires_grad=t.requires_grad)
    return m.requires_grad_(t.requires_grad) if t.is_leaf else m
