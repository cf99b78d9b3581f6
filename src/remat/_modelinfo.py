"""What remat needs to know about a user's model, shared by the wrappers, ``verify`` and the planner.

* :func:`default_blocks` / :func:`candidates`: the model's repeated blocks (one walk);
* :func:`loss_of` / :func:`default_loss`: a scalar loss from the model's output;
* :func:`device_of` / :func:`counted_device`: where the model runs and whose bytes count;
* :class:`BufferSnapshot`: buffer values put back after steps that are not the user's;
* :func:`check_grad_enabled`: a clear error under ``no_grad``;
* :func:`rng_state` / :func:`set_rng_state` and :func:`graph_leaves`: steps that leave no trace.

Nothing here imports the planner or the wrappers: they import this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._tree import tensors_in


def default_blocks(model: nn.Module) -> list[str]:
    """Names of the model's repeated blocks: the children of its ``ModuleList``/``Sequential``
    with the most children of one class (then one whose children are all of that class, then
    the most children; then the first).

    The repeated blocks, not merely the longest container: in a ``ModuleList`` of four
    ``Sequential(conv, bn, relu, conv, bn)`` blocks the four blocks are the candidates, not
    the five layers of the first one.

    Example:
        >>> import torch
        >>> default_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
        ['0', '1']
        >>> def layer():  # five children, three of one class
        ...     L, R = torch.nn.Linear, torch.nn.ReLU
        ...     return torch.nn.Sequential(L(2, 2), R(), L(2, 2), R(), L(2, 2))
        >>> default_blocks(torch.nn.ModuleList([layer() for _ in range(4)]))
        ['0', '1', '2', '3']
    """
    best: tuple[tuple[int, bool, int], str] | None = None
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0:
            kinds: dict[type, int] = {}
            for child in m.children():
                kinds[type(child)] = kinds.get(type(child), 0) + 1
            most = max(kinds.values(), default=0)
            score = (most, most == len(m), len(m))
            if best is None or score > best[0]:
                best = (score, name)
    if best is None:
        return []
    prefix = best[1] + "." if best[1] else ""
    container = model.get_submodule(best[1]) if best[1] else model
    return [prefix + child for child, _ in container.named_children()]


def check_module(model: Any, where: str, arg: str = "model") -> None:
    """Raise a clear ``TypeError`` unless ``model`` is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{where}: {arg} must be a torch.nn.Module, got {type(model).__name__} "
            f"({model!r:.60}). Pass the model itself (for a function, wrap it in an nn.Module)."
        )


def candidates(
    model: nn.Module, check_fn: Callable[[str, nn.Module], bool] | None, where: str = "remat.profile"
) -> list[str]:
    """Names of the candidate blocks (default: children of the largest ModuleList/Sequential)."""
    if check_fn is None:
        names = default_blocks(model)
    else:
        names = []
        for name, m in model.named_modules():
            if name and not any(name.startswith(p + ".") for p in names) and check_fn(name, m):
                names.append(name)
    if not names:
        raise ValueError(
            f"{where}: found no candidate blocks in {type(model).__name__} (it has no "
            "nn.ModuleList/nn.Sequential of blocks). Pass check_fn=lambda name, module: ... that "
            "selects the repeated blocks of the model (for example its transformer layers)."
        )
    return names


def default_loss(out: Any, where: str = "remat.verify") -> torch.Tensor:
    """The loss the model returns, else the sum of the floating outputs that require grad
    (in float32).

    A model that computes its own loss (Hugging Face models given ``labels``) returns it as
    the ``loss`` entry (a mapping, such as ``ModelOutput``) or attribute of its output; the
    user's step is then ``model(**batch).loss.backward()``, and that is the step measured
    (summing the logits as well would add a gradient the size of the logits to it).
    """
    own = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if (
        isinstance(own, torch.Tensor)
        and own.dim() == 0
        and own.is_floating_point()
        and own.requires_grad
    ):
        return own
    tensors: list[torch.Tensor] = []
    tensors_in(out, tensors)
    floats = [t for t in tensors if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ValueError(
            f"{where}: the model's output holds no floating tensor that requires grad (are all "
            "its parameters frozen, requires_grad=False, and no input requires grad?); there is "
            "no backward to run. Pass loss_fn=... that turns the output into a scalar loss "
            "that requires grad."
        )
    return sum((t.float().sum() for t in floats), torch.zeros((), device=floats[0].device))


def loss_of(
    out: Any, loss_fn: Callable[[Any], torch.Tensor] | None, where: str = "remat.profile"
) -> torch.Tensor:
    """``loss_fn(out)``, or :func:`default_loss` when none is given."""
    if loss_fn is not None:
        return loss_fn(out)
    return default_loss(out, where)


def check_grad_enabled(where: str) -> None:
    """Raise a clear error when called under ``torch.no_grad()`` / ``inference_mode()``."""
    if not torch.is_grad_enabled():
        raise RuntimeError(
            f"{where} was called with gradients disabled (inside torch.no_grad() or "
            "torch.inference_mode()); it runs training steps (forward and backward) to measure "
            f"them. Call it outside that block, or wrap the call in torch.enable_grad()."
        )


def device_of(model: nn.Module, args: Any) -> torch.device:
    """The device of the first tensor argument, else of the first parameter, else CPU."""
    found: list[torch.Tensor] = []
    tensors_in(args, found)
    for t in [*found, *model.parameters()]:
        return t.device
    return torch.device("cpu")


def counted_device(device: torch.device) -> torch.device | None:
    """The device whose bytes the planner counts: the model's (host buffers of offload are
    not device memory there); everything (``None``) on CPU."""
    return None if device.type == "cpu" else device


class BufferSnapshot:
    """The values of a model's buffers (BatchNorm running statistics, counters), put back later.

    Steps that are not the user's (profiling, measuring) run the model in its
    current mode; in training mode they update running statistics, which must
    not count as the user's steps.
    """

    def __init__(self, model: nn.Module) -> None:
        self.saved: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
        for mod in model.modules():
            for name, buf in mod._buffers.items():
                if buf is None or nn.parameter.is_lazy(buf):
                    continue
                self.saved.append((mod._buffers, name, buf, buf.detach().clone()))

    def restore(self) -> None:
        with torch.no_grad():
            for store, name, buf, value in self.saved:
                buf.copy_(value)
                store[name] = buf  # a step that replaced the buffer gets the original back


def rng_state() -> tuple[Any, Any]:
    """The CPU RNG state and, when CUDA is already in use, every CUDA device's (for
    :func:`set_rng_state`); CUDA is never initialised here."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[Any, Any]) -> None:
    """Put back an RNG state taken by :func:`rng_state`."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def graph_leaves(root: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors whose ``.grad`` a backward from ``root`` accumulates into."""
    leaves: list[torch.Tensor] = []
    seen: set[Any] = set()
    todo = [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor):
            leaves.append(var)
        todo.extend(fn for fn, _ in node.next_functions)
    return leaves
