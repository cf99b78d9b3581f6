"""Capture and replay of the global state a recompute must see.

A checkpointed function is run twice: in forward and, later, in backward. For
the second run to compute the same values it must see the same

* random number generator state: the CPU generator and the generators of the
  devices that hold the tensor arguments (any device type with a
  ``torch.get_device_module``, not only CUDA), and every ``torch.Generator``
  passed as an argument (also inside lists, tuples and dicts). torch replays
  none of the latter: a ``rand(..., generator=g)`` inside its checkpoint draws
  new numbers in recompute and ``g`` ends backward advanced twice. A generator
  the function reaches otherwise (a closure, a module attribute) is not seen:
  pass it as an argument, or ``determinism_check="values"`` reports the drift;
* autocast state of every device type (enabled, dtype, cache). The autocast
  cast cache is one process-wide table keyed by tensor, not by dtype: when
  backward runs inside an autocast region of another dtype, the recompute
  must neither read that region's casts (a weight cast to float16 where the
  forward cast it to bfloat16) nor leave its own behind in it: the cache is
  emptied before and after such a recompute. Running the recompute with the
  cache off instead would change how many casts it runs (selective
  checkpointing counts them) and, in the reentrant variant, make a weight
  cast once and used twice two casts whose gradients round differently. The
  open region recasts its weights after backward (new graph nodes, the same
  values);
* the default dtype (``torch.set_default_dtype`` between forward and backward
  would otherwise change what factory calls create in recompute);
* grad mode (recompute always runs with grad enabled: checkpointing only
  happens when the forward ran with grad enabled);
* the default device set with ``with torch.device(...)`` (the innermost
  ``DeviceContext`` mode), so factory calls inside create tensors on the same
  device in recompute.

``torch.use_deterministic_algorithms`` is not replayed: it selects kernels
(and fills ``torch.empty`` with NaN), the values of well-defined CPU code do
not depend on it, and the backward's own kernels run under the backward's
setting anyway.

:class:`ForwardState` records these at forward time. Its :meth:`enter` puts
them in place for the recompute and returns a token; :meth:`exit` restores the
state that was there before, so the global RNG after backward is exactly what
it would be without checkpointing. ``exit`` runs on every exit path.

Which device's RNG is replayed when tensors sit on several device types: CUDA
if any argument is on CUDA, else the first non-CPU device type found in
argument order (the same rule as torch), with a warning. When no argument is on
a device, the type set with :class:`DefaultDeviceType` is used (``"cuda"``),
and its RNG is replayed only if an argument lives on it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .tree import tensors_in


class DefaultDeviceType:
    """The device type whose RNG is replayed when no tensor argument is on a device.

    Like torch's class of the same name this is one process-wide setting (it
    configures the process, not a region of code); it defaults to ``"cuda"``.

    Example:
        >>> import remat
        >>> remat.DefaultDeviceType.get_device_type()
        'cuda'
    """

    _device_type: str = "cuda"

    @staticmethod
    def set_device_type(device: str = "cuda") -> None:
        """Set the default device type (for example ``"cuda"``, ``"xpu"``)."""
        if not isinstance(device, str):
            raise TypeError(
                f"DefaultDeviceType.set_device_type: device must be a device type name "
                f"such as 'cuda', got {device!r}."
            )
        DefaultDeviceType._device_type = device

    @staticmethod
    def get_device_type() -> str:
        """Return the default device type."""
        return DefaultDeviceType._device_type


def infer_device_type(tensors: Iterable[torch.Tensor]) -> str:
    """The device type whose RNG is replayed for these tensor arguments."""
    types: list[str] = []
    for t in tensors:
        dt = t.device.type
        if dt != "cpu" and dt not in types:
            types.append(dt)
    if not types:
        return DefaultDeviceType.get_device_type()
    if len(types) > 1:
        first = "cuda" if "cuda" in types else types[0]
        warnings.warn(
            f"remat.checkpoint: tensor arguments are on several device types {sorted(types)}; "
            f"only the RNG state of '{first}' is saved and replayed. Random ops on the "
            "other device types may differ in recompute.",
            stacklevel=4,
        )
        return first
    return types[0]


def _device_module(device_type: str) -> Any:
    if device_type == "meta":
        return None
    try:
        return torch.get_device_module(device_type)
    except (RuntimeError, AttributeError):
        return None


def _device_initialized(device_type: str) -> bool:
    mod = _device_module(device_type)
    if mod is None:
        return False
    init = getattr(mod, "_initialized", None)
    if init is None:
        is_init = getattr(mod, "is_initialized", None)
        return bool(is_init()) if callable(is_init) else False
    return bool(init)


def get_device_states(*args: Any) -> tuple[list[int], list[torch.Tensor]]:
    """RNG states of the devices that hold the tensors in ``args``, as torch's helper.

    Returns:
        ``(device_ids, states)``, one entry per non-CPU tensor found (nested
        containers are searched).

    Example:
        >>> import torch, remat
        >>> remat.get_device_states(torch.ones(1))
        ([], [])
    """
    tensors: list[torch.Tensor] = []
    tensors_in(args, tensors)
    ids = [t.get_device() for t in tensors if t.device.type not in ("cpu", "meta")]
    states: list[torch.Tensor] = []
    if ids:
        mod = _device_module(infer_device_type(tensors))
        for i in ids:
            with mod.device(i):
                states.append(mod.get_rng_state())
    return ids, states


def set_device_states(
    devices: list[int], states: list[torch.Tensor], *, device_type: str | None = None
) -> None:
    """Set the RNG state of each device in ``devices``, as torch's helper.

    Args:
        devices: device indices.
        states: one RNG state per device, from :func:`get_device_states`.
        device_type: defaults to :meth:`DefaultDeviceType.get_device_type`.

    Example:
        >>> import remat
        >>> remat.set_device_states([], [])
    """
    if device_type is None:
        device_type = DefaultDeviceType.get_device_type()
    if device_type == "meta":
        return
    mod = _device_module(device_type)
    for dev, state in zip(devices, states):
        with mod.device(dev):
            mod.set_rng_state(state)


@functools.cache
def autocast_types() -> tuple[str, ...]:
    """Device types with autocast in this torch build (a fact of the build, cached)."""
    names = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "ipu", "privateuseone")
    return tuple(n for n in names if torch.amp.is_autocast_available(n))


def _autocast_snapshot() -> tuple[tuple[str, bool, torch.dtype], ...]:
    return tuple(
        (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in autocast_types()
    )


def generators_in(obj: Any, out: list[torch.Generator]) -> None:
    """Append each distinct ``torch.Generator`` in ``obj`` (lists, tuples, dicts) to ``out``."""
    if isinstance(obj, torch.Generator):
        if not any(g is obj for g in out):
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            generators_in(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            generators_in(item, out)


def _outer_autocast_nesting() -> int:
    """How many autocast contexts are open (torch has no getter: count one up and down)."""
    n = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return n


def _innermost_device_context() -> Any:
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext

    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode
    return None


def host_state(state: torch.Tensor, on_cpu: bool = True) -> bytearray | torch.Tensor:
    """A CPU RNG state (a ``uint8`` tensor) as a plain Python buffer, for a region on CPU.

    ``torch.get_rng_state()`` returns a 5056-byte tensor that no operator made, so
    remat's memory tracker cannot see it while the CPU allocator (its events in
    ``torch.profiler``) counts it: a region on CPU kept 5 KB the planner did not predict.
    Kept as Python bytes instead, a stashed state is outside the tensor allocator for
    every meter, like the region's other Python objects. The copy costs about 5 us per
    state; a region on a device (``on_cpu=False``) keeps the tensor, which is host memory
    and not in the device's budget.
    """
    if not on_cpu:
        return state
    with unset_fake_temporarily():  # a fake tensor mode (a profile from shapes) must not see it
        return bytearray(state.numpy())


def tensor_state(state: bytearray | torch.Tensor) -> torch.Tensor:
    """The ``uint8`` tensor ``torch.set_rng_state`` takes, over ``state``'s memory (no copy)."""
    if isinstance(state, torch.Tensor):
        return state
    return torch.frombuffer(state, dtype=torch.uint8)


class ForwardState:
    """RNG, autocast, default dtype and device state recorded when a checkpointed forward starts.

    For a region on CPU, the CPU RNG and generator states are kept as Python buffers
    (:func:`host_state`).
    """

    __slots__ = (
        "autocast",
        "cache",
        "cpu_rng",
        "device_type",
        "devices",
        "device_rngs",
        "device_ctx",
        "dtype",
        "generators",
        "generator_states",
    )

    def __init__(
        self,
        tensors: list[torch.Tensor],
        preserve_rng_state: bool,
        generators: list[torch.Generator] | None = None,
    ) -> None:
        # Autocast: record nothing when it is off everywhere (the common case).
        if torch._C._is_any_autocast_enabled():
            self.autocast: tuple[tuple[str, bool, torch.dtype], ...] | None = _autocast_snapshot()
        else:
            self.autocast = None
        self.cache = torch.is_autocast_cache_enabled()
        self.dtype = torch.get_default_dtype()
        self.device_ctx: Any = None
        if torch._C._is_torch_function_mode_enabled():  # cheap test first: rarely true
            self.device_ctx = _innermost_device_context()
        self.cpu_rng: bytearray | torch.Tensor | None = None
        self.device_type = "cpu"
        self.devices: list[int] = []
        self.device_rngs: list[torch.Tensor] = []
        self.generators: list[torch.Generator] = []
        self.generator_states: list[bytearray | torch.Tensor] = []
        if preserve_rng_state:
            device_type = infer_device_type(tensors)
            self.device_type = device_type
            if device_type != "cpu" and _device_initialized(device_type):
                mod = _device_module(device_type)
                for t in tensors:
                    if t.device.type == device_type:
                        idx = t.get_device()
                        if idx not in self.devices:
                            self.devices.append(idx)
                for idx in self.devices:
                    with mod.device(idx):
                        self.device_rngs.append(mod.get_rng_state())
            on_cpu = not self.devices  # a region on CPU: its states out of the allocator
            self.cpu_rng = host_state(torch.get_rng_state(), on_cpu)
            if generators:
                self.generators = generators
                self.generator_states = [host_state(g.get_state(), on_cpu) for g in generators]

    def enter(self) -> tuple[Any, ...]:
        """Put the forward's state in place; return what :meth:`exit` restores."""
        saved_cpu = saved_dev = saved_gens = saved_dtype = None
        mod = None
        stack = None
        clear = False
        try:
            if self.cpu_rng is not None:
                on_cpu = not self.devices
                saved_cpu = host_state(torch.get_rng_state(), on_cpu)
                torch.set_rng_state(tensor_state(self.cpu_rng))
                if self.generators:
                    saved_gens = [host_state(g.get_state(), on_cpu) for g in self.generators]
                    for g, gen_state in zip(self.generators, self.generator_states):
                        g.set_state(tensor_state(gen_state))
                if self.devices:
                    mod = _device_module(self.device_type)
                    saved_dev = []
                    for idx, state in zip(self.devices, self.device_rngs):
                        with mod.device(idx):
                            saved_dev.append(mod.get_rng_state())
                            mod.set_rng_state(state)
            if torch.get_default_dtype() != self.dtype:
                saved_dtype = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
            if (
                self.autocast is not None
                or self.device_ctx is not None
                or torch._C._is_any_autocast_enabled()
            ):
                stack = contextlib.ExitStack()
                if self.device_ctx is not None:
                    stack.enter_context(self.device_ctx)
                fwd = self.autocast or tuple(
                    (t, False, torch.get_autocast_dtype(t)) for t in autocast_types()
                )
                if self.cache and not self._cache_is_private(fwd):
                    clear = True
                    torch.clear_autocast_cache()
                for t, enabled, dtype in fwd:
                    if enabled or torch.is_autocast_enabled(t):
                        stack.enter_context(
                            torch.autocast(
                                t, dtype=dtype, enabled=enabled, cache_enabled=self.cache
                            )
                        )
        except BaseException:
            self.exit((saved_cpu, saved_dev, mod, stack, saved_gens, saved_dtype, clear))
            raise
        return saved_cpu, saved_dev, mod, stack, saved_gens, saved_dtype, clear

    def exit(self, token: tuple[Any, ...]) -> None:
        """Restore the state that :meth:`enter` replaced."""
        saved_cpu, saved_dev, mod, stack, saved_gens, saved_dtype, clear = token
        try:
            if stack is not None:
                stack.close()
        finally:
            if clear:  # the open region must not find the recompute's casts
                torch.clear_autocast_cache()
            try:
                if saved_dtype is not None:
                    torch.set_default_dtype(saved_dtype)
            finally:
                self._restore_rng(saved_cpu, saved_dev, mod, saved_gens)

    @staticmethod
    def _cache_is_private(fwd: tuple[tuple[str, bool, torch.dtype], ...]) -> bool:
        """Whether the recompute may use the autocast cast cache without mixing dtypes.

        Outside any autocast region the cache is empty and the recompute's
        outermost autocast clears it on exit. Inside one (backward called in
        an autocast block) the cache holds that region's casts and keeps the
        recompute's: sharing it is right only when every autocast the
        recompute enables casts to the dtype of the open region (enabled or
        not: a disabled region inside an enabled one keeps the enclosing casts).
        """
        if not any(enabled for _, enabled, _ in fwd) or _outer_autocast_nesting() == 0:
            return True
        return all(torch.get_autocast_dtype(t) == dtype for t, enabled, dtype in fwd if enabled)

    def _restore_rng(
        self, saved_cpu: Any, saved_dev: Any, mod: Any, saved_gens: Any = None
    ) -> None:
        if saved_cpu is not None:
            torch.set_rng_state(tensor_state(saved_cpu))
        if saved_gens is not None:
            for g, state in zip(self.generators, saved_gens):
                g.set_state(tensor_state(state))
        if saved_dev is not None:
            for idx, state in zip(self.devices, saved_dev):
                with mod.device(idx):
                    mod.set_rng_state(state)
