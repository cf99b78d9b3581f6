"""The default candidate blocks: the repeated blocks of every stack of a model.

One rule, shared by the planner (:func:`remat.profile` through
:func:`remat.modules.modelinfo.candidates`) and by :func:`remat.apply_activation_checkpointing`.
It reads the module tree only (no forward), so the wrappers, which get no inputs, use it
as the planner does; :func:`remat.modules.modelinfo.in_call_order` puts its names in the order one
forward calls them (the planner models the blocks as a chain; :func:`remat.profile` records
that order in its warm-up step and takes the blocks in it).

The rule
--------
A *stack* is the group of a module's children that are its repeated blocks: the children
of the kind with the most instances (at least two), together with every child that sits
between the first and the last of them and every other instance of a kind that does. Only
children that hold submodules count; a child's *kind* is its class, and for a plain
``nn.Sequential`` / ``nn.ModuleList`` / ``nn.ModuleDict`` its class with its children's
classes (so four ``Sequential(conv, bn, relu, conv, bn)`` are one kind, a model's
``features`` and ``classifier`` Sequentials are two). The stem and the last
layer of a MobileNet's ``features`` (the same class, before the first and after the last
inverted residual) are not in its stack; a hybrid stack's interleaved attention layers are.
In a plain container (a chain or list of the model's steps) the single layers (modules
without submodules: a first or last conv, a norm) are in its stack too, as before.

The blocks are found by walking the tree from the model down:

* the members of a stack are blocks, and the walk does not enter them;
* except when the members of one kind are *stages*: each holds a *run* (a container, itself or a child,
  whose children are all of one class that holds submodules), the runs hold at least as
  many parameters as the member's other children that hold submodules, no single layer
  of the member has weights other than an embedding's or a norm's (a router or a
  projection there makes it a block whose run is of parallel parts: a mixture of
  experts), and together the runs have more blocks than there are members. Then the
  runs' children are the blocks (checked the same way in turn: a stage of stages) and the
  rest of each stage is walked;
* a member without ``forward`` (an ``nn.ModuleList`` / ``nn.ModuleDict``) cannot be called,
  so its children are the blocks (``for attn, ff in self.layers``);
* every child that is not a member of a stack is walked the same way.

So ResNet's ``layer1`` ... ``layer4`` give their BasicBlocks (the first of a stage, with its
downsample, is of the same class), ConvNeXt's ``stages.N.blocks.*`` every stage's blocks,
T5's ``encoder.block.*`` and ``decoder.block.*``, a U-Net's down, mid and up stacks, a
vision tower's layers and the language model's; blocks held as plain attributes
(``self.block1``, ``self.block2``) form a stack like those of a container.

A model with no stack of modules that hold submodules (an ``nn.Sequential`` of layers)
keeps the rule of earlier versions: the children of the ``nn.ModuleList`` /
``nn.Sequential`` with the most children of one class.

Not handled (pass ``check_fn``): a model whose repeated blocks are used more than once a
step (ALBERT's shared layer) or not at all; a stack whose blocks are single layers next to
stacks of larger modules; a stage whose run is not in a container (``self.b1``,
``self.b2`` of a custom stage class: the stages are the blocks); a mixture-of-experts layer
whose experts are an ``nn.ModuleList`` child of the layer itself, holding most of its
parameters, and whose router is inside a submodule rather than a layer of its own (it
reads as a stage, the experts as blocks; with the router a ``Linear`` of the layer, or
Hugging Face's fused experts, it does not).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def default_blocks(model: nn.Module) -> list[str]:
    """Names of the model's repeated blocks, of every stack and stage, in the order of the
    model's tree (see the module docstring for the rule and the cases it does not handle).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> default_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))  # layers only
        ['0', '1']
        >>> def block():
        ...     return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.stem = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        ...         self.down = nn.Sequential(block(), block())
        ...         self.up = nn.ModuleList([block(), block(), block()])
        >>> default_blocks(Net())
        ['down.0', 'down.1', 'up.0', 'up.1', 'up.2']
    """
    out: list[str] = []
    _walk(model, "", out, set())
    return out if out else _largest_container(model)


def _walk(module: nn.Module, prefix: str, out: list[str], seen: set[int]) -> None:
    if id(module) in seen:  # a module registered twice is walked once
        return
    seen.add(id(module))
    kids = list(module.named_children())
    members = _stack(kids)
    if members and isinstance(module, _CONTAINERS):  # its single layers are steps of the chain
        members |= {i for i, (_, c) in enumerate(kids) if not _holds_modules(c)}
    _visit(kids, members, prefix, out, seen)


def _forced(container: nn.Module, prefix: str, out: list[str], seen: set[int]) -> None:
    """The children of a run (or of an uncallable list) are blocks, whatever their number:
    those that hold modules, else all."""
    kids = list(container.named_children())
    inner = {i for i, (_, c) in enumerate(kids) if _holds_modules(c)} or set(range(len(kids)))
    _visit(kids, inner, prefix, out, seen)


def _visit(
    kids: Sequence[tuple[str, nn.Module]],
    members: set[int],
    prefix: str,
    out: list[str],
    seen: set[int],
) -> None:
    """Emit a stack's members (or enter them: stages, lists without ``forward``); walk the
    rest. Whether members are stages is decided for each kind, all its members alike."""
    groups: dict[Any, list[nn.Module]] = {}
    for i in sorted(members):
        if _holds_modules(kids[i][1]):
            groups.setdefault(_kind(kids[i][1]), []).append(kids[i][1])
    stages = {id(m) for group in groups.values() if _are_stages(group) for m in group}
    for i, (name, child) in enumerate(kids):
        full = prefix + name
        if i not in members:
            _walk(child, full + ".", out, seen)
        elif not _callable(child):
            _forced(child, full + ".", out, seen)
        elif id(child) in stages:
            _enter_stage(child, full + ".", out, seen)
        elif id(child) not in seen:
            seen.add(id(child))
            out.append(full)


def _enter_stage(stage: nn.Module, prefix: str, out: list[str], seen: set[int]) -> None:
    if id(stage) in seen:
        return
    seen.add(id(stage))
    if _is_run(stage):
        _forced(stage, prefix, out, seen)
        return
    for name, child in stage.named_children():
        if isinstance(child, _CONTAINERS) and _is_run(child):
            if id(child) not in seen:
                seen.add(id(child))
                _forced(child, prefix + name + ".", out, seen)
        else:
            _walk(child, prefix + name + ".", out, seen)


def _callable(m: nn.Module) -> bool:
    """Whether the module has a ``forward`` (a ``ModuleList`` / ``ModuleDict`` has not)."""
    return type(m).forward is not nn.Module.forward


def _holds_modules(m: nn.Module) -> bool:
    return next(m.children(), None) is not None


def _kind(m: nn.Module) -> Any:
    if type(m) in _CONTAINERS:
        return (type(m), tuple(type(c) for c in m.children()))
    return type(m)


def _stack(kids: Sequence[tuple[str, nn.Module]]) -> set[int]:
    """Positions of the stack among a module's children (empty: none)."""
    kinds = {i: _kind(c) for i, (_, c) in enumerate(kids) if _holds_modules(c)}
    counts: dict[Any, int] = {}
    for k in kinds.values():
        counts[k] = counts.get(k, 0) + 1
    if not counts or max(counts.values()) < 2:
        return set()
    main = max(counts, key=lambda k: counts[k])  # the first kind of the most instances
    at = [i for i, k in kinds.items() if k == main]
    inside = {i for i in kinds if at[0] <= i <= at[-1]}
    among = {kinds[i] for i in inside}
    return inside | {i for i, k in kinds.items() if k in among and counts[k] >= 2}


def _is_run(m: nn.Module) -> bool:
    """A container whose children all hold modules and are of one class."""
    kids = list(m.children())
    return (
        isinstance(m, _CONTAINERS)
        and bool(kids)
        and all(_holds_modules(c) for c in kids)
        and len({type(c) for c in kids}) == 1
    )


def _runs(m: nn.Module) -> list[nn.Module]:
    if _is_run(m):
        return [m]
    return [c for c in m.children() if isinstance(c, _CONTAINERS) and _is_run(c)]


def _computes(m: nn.Module) -> bool:
    """A single layer with weights of its own other than an embedding's or a norm's (1-D):
    a router, a projection. A module that has one is a block with a list of parallel
    parts (a mixture of experts), not a stage."""
    if _holds_modules(m) or isinstance(m, nn.Embedding):
        return False
    return any(p.dim() > 1 for p in m.parameters(recurse=False) if not nn.parameter.is_lazy(p))


def _numel(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters() if not nn.parameter.is_lazy(p))


def _are_stages(members: Sequence[nn.Module]) -> bool:
    """Whether a stack's members are stages: each holds runs of blocks that carry at least
    as many parameters as its other children that hold modules, has no single layer that
    computes (:func:`_computes`), and the runs together have more blocks than there are
    members."""
    callable_ = [m for m in members if _callable(m)]
    if not callable_:
        return False
    blocks = 0
    for m in callable_:
        runs = _runs(m)
        if not runs or any(_computes(c) for c in m.children()):
            return False
        if runs[0] is not m:
            others = [
                c for c in m.children() if _holds_modules(c) and all(c is not r for r in runs)
            ]
            if sum(_numel(r) for r in runs) < sum(_numel(c) for c in others):
                return False
        blocks += sum(len(list(r.children())) for r in runs)
    return blocks > len(callable_)


def _largest_container(model: nn.Module) -> list[str]:
    """The rule for models of layers only: the children of the ``ModuleList``/``Sequential``
    with the most children of one class (then one whose children are all of that class,
    then the most children; then the first)."""
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
