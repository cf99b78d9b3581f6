"""The package's import structure: the planner's layers run one way, and no module imports
another module's private name."""

from __future__ import annotations

import ast
import inspect
import pathlib
import typing

import pytest

import remat

SRC = pathlib.Path(remat.__file__).parent

#: The planner's modules, each importing (at module level) only those before it.
PLANNER_LAYERS = [
    "types",
    "regional",
    "progress",
    "render",
    "stepmodel",
    "chain",
    "perblock",
    "amp",
    "sharded",
    "state",
    "checks",
    "apply",
    "advice",
    "solve",
    "inputs",
    "distributed",
    "meta",
    "fake",
    "loop",
    "scratch",
    "counting",
    "calibration",
    "timing",
    "probes",
    "compiled",
    "measure",
    "shapefit",
    "shaped",
    "shapes",
    "auto",
    "pipeline",
    "__init__",
]


def _module_imports(path: pathlib.Path) -> list[ast.ImportFrom]:
    """The ``from ... import`` statements run when the module is imported (those under
    ``if TYPE_CHECKING:`` are not)."""
    tree = ast.parse(path.read_text())
    out: list[ast.ImportFrom] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                out.append(node)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    return out


def _planner_modules() -> list[tuple[str, pathlib.Path]]:
    """``(layer, path)`` of every module of the planner: a subpackage's modules are its layer."""
    out = []
    for p in sorted((SRC / "planner").rglob("*.py")):
        rel = p.relative_to(SRC / "planner")
        out.append((rel.parts[0].removesuffix(".py"), p))
    return out


def _absolute(path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (``remat.planner.types``)."""
    package = list(path.relative_to(SRC.parent).with_suffix("").parts)
    base = package[: len(package) - node.level] if node.level else []
    return ".".join(base + ([node.module] if node.module else []))


def test_every_planner_module_has_a_layer():
    assert {layer for layer, _ in _planner_modules()} == set(PLANNER_LAYERS)


@pytest.mark.parametrize("layer, path", _planner_modules(), ids=lambda x: str(x))
def test_planner_modules_import_only_the_layers_below(layer, path):
    below = set(PLANNER_LAYERS[: PLANNER_LAYERS.index(layer)])
    for node in _module_imports(path):
        target = _absolute(path, node)
        if not target.startswith("remat.planner"):
            continue  # the engine below the planner, torch, ...
        names = target.split(".")[2:] or [a.name for a in node.names]
        for name in names[:1] if target != "remat.planner" else names:
            assert name in below or name == layer, f"{path.name} imports remat.planner.{name}"


def _private_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in _module_imports(path):
        if node.level == 0 and not (node.module or "").startswith("remat"):
            continue  # torch's own private helpers are torch's business
        if node.module is None:
            continue  # ``from . import _config``: the package's own modules
        found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return found


@pytest.mark.parametrize(
    "path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC))
)
def test_no_module_imports_another_modules_private_name(path):
    assert _private_imports(path) == []


@pytest.mark.parametrize(
    "fn",
    [
        remat.plan,
        remat.profile,
        remat.auto_checkpoint,
        remat.measure_peak,
        remat.Plan.apply,
        remat.Profile.peak,
        remat.Plan.from_json,
        remat.Profile.from_json,
    ],
    ids=lambda f: f.__qualname__,
)
def test_planner_public_signatures_name_their_types(fn):
    """``Any`` only where the model's own inputs go (``*args``, ``**kwargs``)."""
    hints = typing.get_type_hints(fn)
    params = inspect.signature(fn).parameters
    for name, p in params.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in ("self", "cls"):
            continue
        assert hints.get(name) is not typing.Any, f"{fn.__qualname__}({name}: Any)"
    assert hints.get("return") is not typing.Any
