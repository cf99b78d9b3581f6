"""The package's import structure: its packages and the modules inside each run one way,
imports inside functions included, and no module imports another module's private name."""

from __future__ import annotations

import ast
import inspect
import pathlib
import typing

import pytest

import remat

SRC = pathlib.Path(remat.__file__).parent

#: The parts of ``remat`` (a package or a module at its root), each importing only those
#: before it. ``__init__`` is the root package's re-exports (``from remat import unwrap``).
PACKAGE_LAYERS = [
    "policies",
    "engine",
    "modules",
    "memory",
    "measure",
    "planner",
    "__init__",
    "bench",
    "integrations",
    "cli",
    "__main__",
]

#: The imports that climb, each with why.
UPWARD = {
    # ``Shapes`` is checked and read below the module that defines it, imported when used
    # (``shapes`` builds on the planner's steps): the planner's two cycles left, named here
    # so that no third one comes in unseen.
    ("planner/checks.py", "remat.planner.shapes"),
    ("planner/shaped.py", "remat.planner.shapes"),
}

#: The modules of each package that orders its own, each importing only those before it.
PACKAGE_MODULES = {
    "engine": [
        "errors",
        "tree",
        "bytes",
        "observe",
        "torch_compat",
        "config",
        "debug",
        "state",
        "offload",
        "selective",
        "nonreentrant",
        "reentrant",
        "region",
        "checkpoint",
        "sequential",
        "forms",
        "__init__",
    ],
    "modules": ["blocks", "modelinfo", "wrap", "split", "spans", "__init__"],
    "measure": ["records", "probe", "diagnose", "explain", "verify", "__init__"],
}

#: The planner's modules, each importing only those before it.
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
    "grouped",
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
    """The ``from ... import`` statements of the module, those inside functions and classes
    included (those under ``if TYPE_CHECKING:`` are not: they never run)."""
    out: list[ast.ImportFrom] = []

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if "TYPE_CHECKING" in ast.unparse(node.test):
                for child in node.orelse:
                    self.visit(child)
            else:
                self.generic_visit(node)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            out.append(node)

    Visitor().visit(ast.parse(path.read_text()))
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


def _part(path: pathlib.Path) -> str:
    """The part of ``remat`` (a :data:`PACKAGE_LAYERS` entry) a source file belongs to."""
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_parts(path: pathlib.Path, node: ast.ImportFrom) -> list[str]:
    """The parts of ``remat`` a ``from ... import`` reads (``remat.engine.tree`` -> ``engine``;
    ``from remat import memory, unwrap`` -> ``memory`` and the root's ``__init__``)."""
    names = _absolute(path, node).split(".")
    if names[0] != "remat":
        return []
    if len(names) > 1:
        return [names[1]]
    return [
        a.name if (SRC / f"{a.name}.py").exists() or (SRC / a.name).is_dir() else "__init__"
        for a in node.names
    ]


def test_every_part_has_a_layer():
    parts = {_part(p) for p in SRC.rglob("*.py")}
    assert parts == set(PACKAGE_LAYERS)
    for package, layers in PACKAGE_MODULES.items():
        found = {p.stem for p in (SRC / package).glob("*.py")}
        assert found == set(layers), package


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_parts_import_only_the_parts_below(path):
    part = _part(path)
    below = set(PACKAGE_LAYERS[: PACKAGE_LAYERS.index(part)])
    rel = str(path.relative_to(SRC))
    for node in _module_imports(path):
        for target in _imported_parts(path, node):
            if target == part or (rel, _absolute(path, node)) in UPWARD:
                continue
            assert target in below, f"{rel} (in {part}) imports remat.{target}"


def _package_modules() -> list[tuple[str, str, pathlib.Path]]:
    return [
        (package, p.stem, p)
        for package in PACKAGE_MODULES
        for p in sorted((SRC / package).glob("*.py"))
    ]


@pytest.mark.parametrize("package, layer, path", _package_modules(), ids=lambda x: str(x))
def test_package_modules_import_only_the_modules_below(package, layer, path):
    layers = PACKAGE_MODULES[package]
    below = set(layers[: layers.index(layer)])
    for node in _module_imports(path):
        target = _absolute(path, node)
        if not target.startswith(f"remat.{package}"):
            continue
        names = target.split(".")[2:3] or [a.name for a in node.names]
        for name in names:
            assert name in below or name == layer, f"{package}/{path.name} imports {name}"


def test_every_planner_module_has_a_layer():
    assert {layer for layer, _ in _planner_modules()} == set(PLANNER_LAYERS)


@pytest.mark.parametrize("layer, path", _planner_modules(), ids=lambda x: str(x))
def test_planner_modules_import_only_the_layers_below(layer, path):
    below = set(PLANNER_LAYERS[: PLANNER_LAYERS.index(layer)])
    for node in _module_imports(path):
        target = _absolute(path, node)
        if not target.startswith("remat.planner"):
            continue  # the engine below the planner, torch, ...
        if (str(path.relative_to(SRC)), target) in UPWARD:
            continue
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


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
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
