"""What remat does differently on the torch versions it supports, in one place.

remat supports torch 2.11 to 2.14 (README, "Compatibility"). Each name below is
the torch behaviour it handles and says which versions have it;
``tests/engine/test_torch_compat.py`` runs each on a torch that takes it (the other side
by patching these names, so every path runs on any installed torch):

- :data:`make_saved_tensor`: autograd makes a ``SavedTensor`` from Python
  (``torch._C._autograd._make_saved_tensor``: 2.13 and 2.14 have it, 2.11 does not;
  without it a region keeps its inputs by hand, :class:`remat.engine.nonreentrant._KeptByHand`).
- :data:`SAC_MODE_TAKES_HOOKS_OPTION`: torch's own selective-checkpointing forward mode
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) can route what it
  saves through the saved-tensor hooks around the region
  (``respect_saved_tensors_hooks``, torch 2.14); before 2.14 it cannot, and
  ``remat.checkpoint(..., respect_saved_tensors_hooks=True)`` with torch's contexts
  raises, naming the version that has it.
- :func:`user_saved_tensors_hooks`: the saved-tensor hooks a tensor saved right now
  would go through, looking past checkpoint's own hooks. torch 2.14 marks its
  checkpoint's hooks (``_checkpoint_internal``, the hooks under them in
  ``_user_hooks``) and remat marks its own the same way on every version
  (:func:`mark_internal`), so that torch 2.14's selective mode run inside a remat region
  sees the user's hooks, not remat's. torch's checkpoint hooks before 2.14 carry no
  mark; they are recognised by where they are defined, and what lies under them is not
  visible (treated as no hooks, which is what those versions do).

The checkpoint API of torch 2.14 (the curried form, ``respect_saved_tensors_hooks``)
is remat's own code and works the same on every supported version.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as _tuc

#: ``torch._C._autograd._make_saved_tensor`` where torch has it (not in 2.11), else ``None``.
make_saved_tensor: Callable[..., Any] | None = getattr(
    torch._C._autograd, "_make_saved_tensor", None
)

#: Whether torch's selective-checkpointing forward mode has ``respect_saved_tensors_hooks``.
SAC_MODE_TAKES_HOOKS_OPTION: bool = (
    "respect_saved_tensors_hooks" in inspect.signature(_tuc.checkpoint).parameters
)

#: The torch release that first has what :data:`SAC_MODE_TAKES_HOOKS_OPTION` says.
SAC_HOOKS_OPTION_SINCE = "2.14"

_top_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_TORCH_CHECKPOINT_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.")

HookPair = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


def installed_torch() -> str:
    """The installed torch's version without its build tag (``"2.13.0"``).

    Example:
        >>> from remat.engine.torch_compat import installed_torch
        >>> installed_torch().count(".") >= 1
        True
    """
    return torch.__version__.split("+")[0]


def mark_internal(cls: type) -> type:
    """Class decorator: instances pushed as a pack hook are checkpoint's own hooks.

    The class must have a ``_user_hooks`` attribute (a slot), set while the hook is
    pushed to what :func:`user_saved_tensors_hooks` returned then, and ``None`` after.
    """
    cls._checkpoint_internal = True  # type: ignore[attr-defined]
    return cls


def user_saved_tensors_hooks() -> HookPair | None:
    """The (pack, unpack) hooks a tensor saved now would go through, past checkpoint's own.

    ``None`` when there are none, or when the only ones are torch's checkpoint hooks of a
    torch before 2.14 (what lies under them is not visible).

    Example:
        >>> import torch
        >>> from remat.engine.torch_compat import user_saved_tensors_hooks
        >>> user_saved_tensors_hooks() is None
        True
        >>> with torch.autograd.graph.save_on_cpu():
        ...     user_saved_tensors_hooks() is not None
        True
    """
    hooks: Any = _top_hooks(False)
    while hooks is not None:
        pack = hooks[0]
        if getattr(pack, "_checkpoint_internal", False):
            hooks = getattr(pack, "_user_hooks", None)
        elif getattr(pack, "__qualname__", "").startswith(_TORCH_CHECKPOINT_HOOKS):
            return None  # torch's checkpoint before 2.14: unmarked
        else:
            return hooks  # type: ignore[no-any-return]
    return None


def set_hooks_option(forward_mode: Any, respect: bool | None) -> None:
    """Hand ``respect_saved_tensors_hooks`` to a selective forward mode: remat's (any
    torch), torch's own (2.14); ``True`` for torch's before 2.14 raises, naming the version.

    Raises:
        ValueError: ``respect`` is ``True`` and ``forward_mode`` is torch's selective mode of
            a torch before 2.14, which cannot route what it saves through hooks.
    """
    if hasattr(forward_mode, "respect_saved_tensors_hooks"):
        forward_mode.respect_saved_tensors_hooks = respect
    elif respect and isinstance(forward_mode, _tuc._CachingTorchDispatchMode):
        raise ValueError(
            "remat.checkpoint: respect_saved_tensors_hooks=True with the contexts of "
            "torch.utils.checkpoint.create_selective_checkpoint_contexts needs torch "
            f">= {SAC_HOOKS_OPTION_SINCE} (installed: {installed_torch()}): torch's selective "
            "mode before it cannot route what it saves through saved-tensor hooks. Use "
            "remat.create_selective_checkpoint_contexts (the same arguments), which can on every "
            "supported torch, or pass respect_saved_tensors_hooks=False."
        )
