"""The import graph keeps DESIGN's layers: no face imports another, the core no face, nothing imports upward.

No process is started: every module under ``src/ringpipe`` is parsed with :mod:`ast` and its
runtime imports of ``ringpipe.*`` are collected (function-local imports count, imports under
``if TYPE_CHECKING:`` do not, since they never run). The layer table below is DESIGN's
(``docs/architecture.md`` says where the tree deviates from it, and why).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

#: DESIGN's layers, bottom first: a module may import its own layer and the layers below.
#: The longest matching prefix decides a module's layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("env", ("ringpipe.env", "ringpipe.ports", "ringpipe.quick_exit", "ringpipe.slurm_lists", "ringpipe.version")),
    # the call description and the doubling exchange: run by the communicators themselves
    ("comm", ("ringpipe.comm", "ringpipe.check.call", "ringpipe.check.doubling_exchange")),
    ("collectives", ("ringpipe.collectives",)),
    # ranks are started by the launcher, and by the doctor and bench themselves (their -n N)
    ("launch", ("ringpipe.launch",)),
    ("observe", ("ringpipe.observe",)),
    # the announcement and the settings agreement run on the engine
    ("core", ("ringpipe.core", "ringpipe.check")),
    ("pipeline, dp", ("ringpipe.pipeline", "ringpipe.dp")),
    ("faces", ("ringpipe.api", "ringpipe.mpi_ops", "ringpipe.tensorflow", "ringpipe.keras")),
    ("train", ("ringpipe.train",)),
    # the package itself (``import ringpipe as hvd`` is the torch face, plus the launcher's and
    # the trainer's entry points, imported on first use) and the command line
    ("cli", ("ringpipe.cli", "ringpipe")),
]

#: The faces, each one framework's Horovod API. ``ringpipe.keras`` is Horovod's ``horovod.keras``
#: import path of the TensorFlow face's Keras API (as Horovod's own ``horovod.keras`` is built on
#: ``horovod.tensorflow``), so it belongs to that face; ``ringpipe.mpi_ops`` is
#: ``horovod.torch.mpi_ops``, the torch face's.
FACES: dict[str, tuple[str, ...]] = {
    "torch": ("ringpipe.api", "ringpipe.mpi_ops"),
    "tensorflow": ("ringpipe.tensorflow", "ringpipe.keras"),
}

#: Imports that break the table today, in packages being reshaped elsewhere (importer, imported).
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _known_modules() -> set[str]:
    out = set()
    for path in (SRC / "ringpipe").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.add(".".join(parts))
    return out


MODULES = _known_modules()


def _target(name: str) -> str:
    """The module an imported name lives in: ``ringpipe.core.engine.Engine`` -> ``ringpipe.core.engine``."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module, self.is_package = module, is_package
        self.found: list[tuple[str, int]] = []

    def visit_If(self, node: ast.If) -> None:  # noqa: N802 - ast's name
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:  # noqa: N802
        for alias in node.names:
            self.found.append((alias.name, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:  # noqa: N802
        base = node.module or ""
        if node.level:
            parts = self.module.split(".")
            if not self.is_package:
                parts = parts[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
            self.found.append((base if alias.name == "*" else f"{base}.{alias.name}", node.lineno))

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        first = node.args[0] if node.args else None
        if name == "import_module" and isinstance(first, ast.Constant) and isinstance(first.value, str):
            self.found.append((first.value, node.lineno))
        self.generic_visit(node)


def _edges() -> list[tuple[str, str, int]]:
    """(importer, imported module, line) for every runtime import of ringpipe.* in the package."""
    edges = []
    for path in sorted((SRC / "ringpipe").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        visitor = _Imports(module, is_package)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for name, line in visitor.found:
            if name == "ringpipe" or name.startswith("ringpipe."):
                target = _target(name)
                if target != module:
                    edges.append((module, target, line))
    return edges


EDGES = _edges()


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _layer(module: str) -> int:
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _within(module, prefix) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer of the table: add it to LAYERS"
    return best


def _face(module: str) -> str | None:
    for face, prefixes in FACES.items():
        if any(_within(module, p) for p in prefixes):
            return face
    return None


def _show(edges: list[tuple[str, str, int]]) -> str:
    return "\n".join(f"  {a} (line {line}) imports {b}" for a, b, line in edges)


def test_the_graph_was_read() -> None:
    importers = {a for a, _, _ in EDGES}
    assert len(EDGES) > 500
    for module in ("ringpipe.core.engine", "ringpipe.tensorflow.mpi_ops", "ringpipe.comm.base", "ringpipe.api"):
        assert module in importers
    # a function-local import counts; one under TYPE_CHECKING does not
    assert ("ringpipe.comm.base", "ringpipe.check.doubling_exchange") in {(a, b) for a, b, _ in EDGES}
    assert ("ringpipe.core.world", "ringpipe.core.process_sets") not in {(a, b) for a, b, _ in EDGES}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        _layer(module)


def test_no_face_imports_another_face() -> None:
    crossing = [(a, b, line) for a, b, line in EDGES
                if _face(a) is not None and _face(b) is not None and _face(a) != _face(b)]
    assert not crossing, "a face imports another face:\n" + _show(crossing)


def test_the_core_imports_no_face() -> None:
    upward = [(a, b, line) for a, b, line in EDGES
              if (_within(a, "ringpipe.core") or _within(a, "ringpipe.check")) and _face(b) is not None]
    assert not upward, "the core imports a face:\n" + _show(upward)


def test_every_package_imports_its_layer_or_below() -> None:
    upward = [(a, b, line) for a, b, line in EDGES
              if _layer(b) > _layer(a) and (a, b) not in KNOWN_EXCEPTIONS]
    named = "\n".join(f"  {a}: {LAYERS[_layer(a)][0]} -> {b}: {LAYERS[_layer(b)][0]} (line {line})"
                      for a, b, line in upward)
    assert not upward, "imports from a layer above:\n" + named


def test_known_exceptions_still_exist() -> None:
    """An exception that no longer happens is taken off the list (so the list stays the truth)."""
    pairs = {(a, b) for a, b, _ in EDGES}
    assert not KNOWN_EXCEPTIONS - pairs, f"no longer imported: {sorted(KNOWN_EXCEPTIONS - pairs)}"
