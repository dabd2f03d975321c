"""xpupack's static import graph: modules import downward only, so no two modules import each other.

The graph is read from the source with ``ast`` (nothing is imported): an edge
``a -> b`` for each ``import`` or ``from ... import`` in ``a`` that names
xpupack's module ``b``. Imports at module level and imports inside functions
(deferred, mostly to keep torch out of ``import xpupack``) are separate graphs;
imports under ``if TYPE_CHECKING:`` never run and are left out. Dynamic
imports (``importlib.import_module`` of a computed name: the lazy public names,
the built-in backends) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import xpupack

ROOT = Path(xpupack.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The xpupack modules an import statement in ``module`` imports."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        # ``from . import _device`` imports a module; ``from .errors import XpupackError`` a name of one
        names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target for alias in node.names]
    return [name for name in names if name in MODULES]


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def import_graphs(*, annotations: bool = False) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(module level, inside functions)``: module -> the xpupack modules it imports there; with
    ``annotations``, those under ``if TYPE_CHECKING:`` count as module-level imports too."""
    top: dict[str, set[str]] = {name: set() for name in MODULES}
    deferred: dict[str, set[str]] = {name: set() for name in MODULES}

    def visit(node: ast.AST, module: str, is_package: bool, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child) and not annotations:
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                graph = deferred if in_function else top
                graph[module].update(t for t in _targets(child, module, is_package) if t != module)
            visit(
                child,
                module,
                is_package,
                in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
            )

    for name, path in MODULES.items():
        visit(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", False)
    return top, deferred


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for successor in sorted(graph.get(node, ())):
            if state.get(successor) == 1:
                return path[path.index(successor) :] + [successor]
            if successor not in state and (found := walk(successor)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_the_graph_sees_known_imports():
    """The parser finds what the modules plainly import (else the tests below could not fail)."""
    top, deferred = import_graphs()
    assert "xpupack.manifest" in top["xpupack.hub"]
    assert "xpupack._device" in top["xpupack.loading"]  # ``from . import _device``
    assert "xpupack.backends.base" in top["xpupack.backends.torchao"]  # ``from .base import ...``
    assert "xpupack.publish" in deferred["xpupack"]  # ``xpupack.push`` imports it when called
    assert "xpupack.backends.base" not in top["xpupack.plan"]  # under TYPE_CHECKING only
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_cycle_among_module_level_imports():
    top, _ = import_graphs()
    assert find_cycle(top) is None, f"module-level import cycle: {' -> '.join(find_cycle(top))}"


def test_no_cycle_even_counting_imports_inside_functions():
    """A deferred import must still point downward: a cycle through one means two modules depend
    on each other, whatever the import order at run time."""
    top, deferred = import_graphs()
    both = {name: top[name] | deferred[name] for name in MODULES}
    assert find_cycle(both) is None, f"import cycle: {' -> '.join(find_cycle(both))}"


def test_no_cycle_even_counting_imports_for_annotations():
    """The spec types sit below the modules that pass them around (`ModuleSpec` in the backend contract,
    `BatchAxes` in `xpupack.signature`): even an import for a type annotation points downward."""
    top, deferred = import_graphs(annotations=True)
    both = {name: top[name] | deferred[name] for name in MODULES}
    assert find_cycle(both) is None, f"import cycle: {' -> '.join(find_cycle(both))}"


#: what reads and checks a package's files and names where it came from
FORMAT_FLOOR = (
    "xpupack.manifest",
    "xpupack.shards",
    "xpupack.digests",
    "xpupack.source",
    "xpupack.errors",
    "xpupack._version",
    "xpupack._fsutil",
    "xpupack.backends._facts",
    "xpupack.backends._megacache",
    "xpupack._listeners",
)


@pytest.mark.parametrize("module", FORMAT_FLOOR)
def test_the_format_floor_imports_nothing_above_it(module):
    """What reads and checks a package's files and names where it came from stands on its own."""
    top, deferred = import_graphs()
    floor = set(FORMAT_FLOOR)
    assert top[module] | deferred[module] <= floor


#: the torch-free part of the backends that the format floor reads (`plan.py`, `inspect` without torch)
BACKEND_FACTS = {"xpupack.backends._facts", "xpupack.backends._megacache"}


def test_nothing_the_backends_stand_on_imports_a_backend():
    """No upward arrow: what a backend imports from outside ``xpupack.backends`` (the spec types in
    `xpupack.module_spec`, padding, signatures, state, the device layer) imports no backend module, even for
    an annotation. Regression: `padding.py` and `recorder.py` took `ModuleSpec` from `backends/base.py`."""
    top, deferred = import_graphs(annotations=True)
    both = {name: top[name] | deferred[name] for name in MODULES}
    backends = {name for name in MODULES if name.startswith("xpupack.backends")}
    below = {target for name in backends for target in both[name]} - backends
    assert "xpupack.module_spec" in below and "xpupack.padding" in below  # else the test could not fail
    upward = {
        name: both[name] & (backends - BACKEND_FACTS) for name in below if both[name] & (backends - BACKEND_FACTS)
    }
    assert not upward, f"modules below the backends import a backend: {upward}"


#: the floors of docs/architecture.md, bottom first: a module imports only modules on its own floor or below
FLOORS = {
    "ground": {
        "errors", "_version", "_fsutil", "_listeners", "_background", "_torch_compat", "_inference", "_device",
        "_timing", "_signature_text", "state", "distributed", "examples", "candidate", "_hooks", "digests",
        "shards", "source", "environment", "backends._facts", "backends._megacache",
    },
    "format and sources": {"manifest", "hub", "limits"},
    "specs and recording": {
        "signature", "module_spec", "_compare", "recorder", "padding", "spec", "device_slots", "_weights_io",
        "_model_edit",
    },
    "backends": {
        "backends", "backends.base", "backends.eager", "backends.graph", "backends._graph_handover",
        "backends.inductor", "backends.aoti", "backends._storage_watch", "backends.torchao",
        "backends.torchao_configs",
    },
    "runtime": {"tuned", "_padded_calls", "_new_sizes", "warmup", "testing"},
    "decisions": {
        "plan", "searches", "strategies", "strategies.checks", "strategies.base", "strategies.first_wins",
        "strategies.fastest", "strategies.only",
    },
    "reports": {"report", "card"},
    "actions": {"tuning", "loading", "package", "publish", "bench"},
    "entry": {"", "__main__", "cli", "cli._common", "cli.bench", "cli.build", "cli.inspect", "cli.push"},
}  # fmt: skip


def _floor_of() -> dict[str, int]:
    return {f"xpupack.{name}".rstrip("."): height for height, names in enumerate(FLOORS.values()) for name in names}


def test_every_module_has_a_floor():
    """A new module is placed on a floor (here and in docs/architecture.md) before it lands."""
    floor_of = _floor_of()
    assert set(MODULES) - set(floor_of) == set(), "modules on no floor"
    assert set(floor_of) - set(MODULES) == set(), "floors name modules that do not exist"


def test_no_module_imports_one_on_a_floor_above_it():
    """Imports point down or sideways, never up, deferred imports (inside functions) included."""
    floor_of, names = _floor_of(), list(FLOORS)
    top, deferred = import_graphs()
    upward = sorted(
        f"{module} ({names[floor_of[module]]}) -> {target} ({names[floor_of[target]]})"
        for module in MODULES
        for target in top[module] | deferred[module]
        if floor_of[target] > floor_of[module]
    )
    assert not upward, "upward imports:\n" + "\n".join(upward)
    assert floor_of["xpupack.tuned"] > floor_of["xpupack.backends.base"]  # else the test could not fail
