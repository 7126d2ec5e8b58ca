"""The package's shape, read from its source with ``ast`` (nothing is imported):

- data flows one way: no circle of imports among shardkit's modules, counting every
  ``import`` statement wherever it is (module level, inside a function, under
  ``if TYPE_CHECKING:``), absolute and relative, and ``from X import Y`` as an import of
  ``X.Y`` when ``Y`` is a submodule; and no import reaches up a layer (the core into the
  transport, the transport into the Hypothesis machine, the server into the worker, …);
- no module keeps mutable state at module level (a list, dict or set built there, or a
  ``global`` statement anywhere), so no run leaks into the next through a module.

Each finder has a self-test on a small package written to ``tmp_path`` (or a small graph),
which fails if the finder stops finding.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "shardkit"

#: Where no circle may pass: the semantics (``_core``), the transport and the public modules
#: they rest on. A circle elsewhere that passes through none of these is not counted here.
LOWER_LAYERS = (
    "shardkit._core",
    "shardkit._transport",
    "shardkit.contract",
    "shardkit.errors",
    "shardkit.engines",
    "shardkit.remote",
    "shardkit.proto",
)

#: Each module of the transport room, and the others of the room it may reach through its imports
#: (directly or not): data flows one way, codec → client → resolve → server, and the worker
#: and the isolation front end above the client; the server never reaches a worker.
TRANSPORT_LAYERS = {
    "codec": set(),
    "calls_socket": set(),
    "client": {"codec", "calls_socket"},
    "resolve": {"client", "codec", "calls_socket"},
    "server": {"resolve", "client", "codec", "calls_socket"},
    "forkserver": set(),
    "worker": {"client", "codec", "calls_socket", "forkserver"},
    "isolation": {"resolve", "worker", "client", "codec", "calls_socket", "forkserver"},
}

#: The semantics and the public modules the transport rests on.
BELOW_THE_TRANSPORT = ("shardkit._core", "shardkit.contract", "shardkit.errors", "shardkit.engines")
#: What those may never reach.
ABOVE_THE_CORE = (
    "shardkit._transport",
    "shardkit._parallel",
    "shardkit._machine",
    "shardkit._run",
    "shardkit._campaign",
    "shardkit._html",
    "shardkit._bench",
    "shardkit._cli",
    "shardkit.pytest_plugin",
    "shardkit.remote",
)
#: What the transport may never reach.
ABOVE_THE_TRANSPORT = (
    "shardkit._parallel",
    "shardkit._machine",
    "shardkit._run",
    "shardkit._campaign",
    "shardkit._html",
    "shardkit._bench",
    "shardkit._cli",
    "shardkit.pytest_plugin",
)
#: The HTML report draws a report document from its JSON alone, so that a report from another
#: machine renders: it reaches no engine, no machine and no run, only the core's vocabulary; and
#: one run never draws a page (the command line does).
ABOVE_THE_HTML = (
    "shardkit._transport",
    "shardkit._parallel",
    "shardkit._machine",
    "shardkit._run",
    "shardkit._campaign",
    "shardkit._bench",
    "shardkit._cli",
    "shardkit.engines",
    "shardkit.pytest_plugin",
    "shardkit.remote",
)
BELOW_THE_HTML = ("shardkit._run", "shardkit._machine", "shardkit._parallel")
#: A campaign runs rounds of ``fuzz`` and the command line runs a campaign: what one run is
#: never reaches the campaign, and the campaign never reaches the command line.
BELOW_THE_CAMPAIGN = ("shardkit._run", "shardkit._machine", "shardkit._parallel")
ABOVE_THE_CAMPAIGN = ("shardkit._bench", "shardkit._cli", "shardkit.pytest_plugin")
#: The bench measures the run, the machine, the parallel phases, the campaign and the transport,
#: and only the command line runs it: no module but the command line's imports the bench, and
#: the bench reaches nothing of the command line (the rooms below it are held by the lists above).
BENCH = "shardkit._bench"
IMPORTERS_OF_THE_BENCH = ("shardkit._cli",)
ABOVE_THE_BENCH = ("shardkit._cli",)

#: Module-level values that are mutable however they are used.
MUTABLE_CALLS = frozenset({"dict", "list", "set", "Counter", "defaultdict", "deque", "OrderedDict"})


# --- reading the source -----------------------------------------------------------------------


def module_files(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root`` (a folder with ``__init__.py``) by dotted name."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, str | None]]:
    """(module named, name imported from it or None) for every import statement in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # Relative: from the module's own package (a package's __init__ is its own package).
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                yield source, alias.name


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules of the same package it imports. A dotted import also runs each
    parent package's ``__init__``; those edges are left out, or every module would depend on
    the package's ``__init__`` and the graph would be one circle."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets: set[str] = set()
        for source, name in _imported_names(tree, module, path.name == "__init__.py"):
            submodule = f"{source}.{name}" if name is not None else None
            # A module outside the package, or one that does not exist, is no edge.
            if submodule in modules:
                targets.add(submodule)  # from package import submodule
            elif source in modules:
                targets.add(source)
        graph[module] = targets
    return graph


# --- finding a circle --------------------------------------------------------------------------


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components: each circle of the graph lies inside one (iterative, no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.get(step, ())))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def _path(graph: dict[str, set[str]], start: str, goal: str, within: set[str]) -> list[str]:
    """A shortest path of imports from ``start`` to ``goal`` inside ``within`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        following: list[str] = []
        for node in frontier:
            for step in sorted(graph.get(node, ())):
                if step == goal:
                    path = [goal, node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1]
                if step in within and step not in seen:
                    seen.add(step)
                    previous[step] = node
                    following.append(step)
        frontier = following
    raise AssertionError(f"no path from {start} to {goal}")  # pragma: no cover - a component has one


def find_cycles(graph: dict[str, set[str]], touching: tuple[str, ...] = ()) -> list[list[str]]:
    """One circle of imports per tangle of the graph, as ``[a, b, …, a]``; with ``touching``
    (module names or their parent packages), only tangles holding such a module, each circle
    drawn through one of them."""

    def counted(module: str) -> bool:
        return not touching or _within(module, touching)

    cycles: list[list[str]] = []
    for component in strongly_connected(graph):
        member = min(component)
        if len(component) == 1 and member not in graph.get(member, ()):
            continue  # a module alone, not importing itself
        chosen = sorted(module for module in component if counted(module))
        if chosen:
            cycles.append(_path(graph, chosen[0], chosen[0], component))
    return cycles


def layer_violations(graph: dict[str, set[str]], lower: tuple[str, ...], higher: tuple[str, ...]) -> list[str]:
    """``a -> b -> c`` for each module under ``lower`` that reaches one under ``higher``."""
    return [
        " -> ".join(chain)
        for module in sorted(graph)
        if _within(module, lower)
        for reached, chain in reachable(graph, module).items()
        if _within(reached, higher)
    ]


def room_violations(graph: dict[str, set[str]], room: str, layers: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each module ``room.NAME`` that reaches a module of the room not in ``layers[NAME]``."""
    return [
        " -> ".join(chain)
        for name, allowed in layers.items()
        for reached, chain in reachable(graph, f"{room}.{name}").items()
        if reached.startswith(f"{room}.") and reached.removeprefix(f"{room}.") not in allowed
    ]


def direct_importers(graph: dict[str, set[str]], room: str, allowed: tuple[str, ...]) -> list[str]:
    """``a -> b`` for each module outside ``room`` and ``allowed`` that itself imports a module
    ``b`` of ``room`` (reaching ``room`` through a module of ``allowed`` is no such import)."""
    return [
        f"{module} -> {imported}"
        for module in sorted(graph)
        if not _within(module, (room, *allowed))
        for imported in sorted(graph[module])
        if _within(imported, (room,))
    ]


def _cycle_text(graph: dict[str, set[str]], cycles: list[list[str]]) -> str:
    """Each circle, and every module of its tangle (the circles through it may be many)."""
    components = strongly_connected(graph)
    lines = []
    for cycle in cycles:
        tangle = next(component for component in components if cycle[0] in component)
        lines.append(f"{' -> '.join(cycle)}\n    (its tangle: {', '.join(sorted(tangle))})")
    return "\n".join(lines)


def _within(module: str, tops: tuple[str, ...]) -> bool:
    return any(module == top or module.startswith(f"{top}.") for top in tops)


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or not, with a shortest chain of imports to it."""
    chains = {start: [start]}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for step in sorted(graph.get(node, ())):
                if step not in chains:
                    chains[step] = [*chains[node], step]
                    following.append(step)
        frontier = following
    del chains[start]
    return chains


# --- mutable state at module level ---------------------------------------------------------------


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements run when the module is imported: into ``if``/``try``/``with``/loops, not into defs."""
    for statement in body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield statement
        for field in ("body", "orelse", "finalbody"):
            yield from _module_level(getattr(statement, field, []))
        for handler in getattr(statement, "handlers", []):
            yield from _module_level(handler.body)


def _mutable(value: ast.expr | None) -> str | None:
    """What makes ``value`` a mutable object, or None."""
    if isinstance(value, (ast.List, ast.Dict, ast.Set)):
        return f"a {type(value).__name__.lower()} literal"
    if isinstance(value, (ast.ListComp, ast.DictComp, ast.SetComp)):
        return "a comprehension"
    if isinstance(value, ast.Call):
        called = value.func
        name = called.id if isinstance(called, ast.Name) else called.attr if isinstance(called, ast.Attribute) else ""
        if name in MUTABLE_CALLS:
            return f"{name}()"
    return None


def mutable_state(path: Path, module: str) -> list[str]:
    """``module:LINE NAME = …`` for each module-level assignment of a mutable value, and
    ``module:LINE global NAMES`` for each ``global`` statement anywhere in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[str] = []
    for statement in _module_level(tree.body):
        targets: list[ast.expr]
        value: ast.expr | None
        if isinstance(statement, ast.Assign):
            targets, value = statement.targets, statement.value
        elif isinstance(statement, ast.AnnAssign):
            targets, value = [statement.target], statement.value
        else:
            continue
        names = [ast.unparse(target) for target in targets]
        what = _mutable(value)
        if what is not None and names != ["__all__"]:
            found.append(f"{module}:{statement.lineno} {' = '.join(names)} is {what}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{module}:{node.lineno} global {', '.join(node.names)}")
    return found


def package_mutable_state(root: Path) -> list[str]:
    return [line for module, path in module_files(root).items() for line in mutable_state(path, module)]


# --- the package ---------------------------------------------------------------------------------


def test_no_import_cycle_touches_the_core_or_the_transport() -> None:
    graph = import_graph(PACKAGE_ROOT)
    cycles = find_cycles(graph, touching=LOWER_LAYERS)
    assert not cycles, (
        f"import circles through the core, the transport or the public modules:\n{_cycle_text(graph, cycles)}"
    )


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph(PACKAGE_ROOT)
    cycles = find_cycles(graph)
    assert not cycles, f"import circles among shardkit's modules:\n{_cycle_text(graph, cycles)}"


def test_the_core_reaches_nothing_above_it() -> None:
    graph = import_graph(PACKAGE_ROOT)
    found = layer_violations(graph, BELOW_THE_TRANSPORT, ABOVE_THE_CORE)
    found += layer_violations(graph, ("shardkit._transport",), ABOVE_THE_TRANSPORT)
    assert not found, "imports from a lower layer into a higher one:\n" + "\n".join(found)


def test_the_campaign_sits_between_the_run_and_the_command_line() -> None:
    graph = import_graph(PACKAGE_ROOT)
    assert "shardkit._run.runner" in reachable(graph, "shardkit._campaign.worker"), "the campaign's modules were not read"
    found = layer_violations(graph, BELOW_THE_CAMPAIGN, ("shardkit._campaign",))
    found += layer_violations(graph, ("shardkit._campaign",), ABOVE_THE_CAMPAIGN)
    assert not found, "the campaign is reached from below it, or reaches above it:\n" + "\n".join(found)


def test_the_html_report_reads_only_the_document() -> None:
    graph = import_graph(PACKAGE_ROOT)
    assert "shardkit._html.render" in reachable(graph, "shardkit._html"), "the HTML report's modules were not read"
    found = layer_violations(graph, ("shardkit._html",), ABOVE_THE_HTML)
    found += layer_violations(graph, BELOW_THE_HTML, ("shardkit._html",))
    assert not found, "the HTML report reaches a run, or a run reaches it:\n" + "\n".join(found)


def test_only_the_command_line_imports_the_bench_and_the_bench_never_reaches_it() -> None:
    graph = import_graph(PACKAGE_ROOT)
    assert "shardkit._bench.run" in reachable(graph, "shardkit._cli.bench"), "the bench's modules were not read"
    found = direct_importers(graph, BENCH, IMPORTERS_OF_THE_BENCH)
    found += layer_violations(graph, (BENCH,), ABOVE_THE_BENCH)
    assert not found, "the bench is imported from outside the command line, or reaches it:\n" + "\n".join(found)


def test_the_transport_room_is_layered() -> None:
    graph = import_graph(PACKAGE_ROOT)
    room = {module.rpartition(".")[2] for module in graph if module.startswith("shardkit._transport.")}
    assert room == set(TRANSPORT_LAYERS), "a module of shardkit/_transport is missing from TRANSPORT_LAYERS, or gone"
    found = room_violations(graph, "shardkit._transport", TRANSPORT_LAYERS)
    assert not found, "a transport module reaches one it must not (see TRANSPORT_LAYERS):\n" + "\n".join(found)


def test_no_module_level_mutable_state() -> None:
    found = package_mutable_state(PACKAGE_ROOT)
    assert not found, (
        "module-level mutable state (make it a tuple, frozenset or MappingProxyType, or own it in an object):\n"
        + "\n".join(found)
    )


# --- the finders find what they look for ----------------------------------------------------------


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root / "fakepkg"


def test_the_cycle_finder_finds_every_kind_of_import(tmp_path: Path) -> None:
    """A circle closed by a function-level relative import, one closed by ``from package import
    submodule``, a module importing itself, and modules outside any circle."""
    package = _write_package(
        tmp_path,
        {
            "fakepkg/__init__.py": "",
            "fakepkg/low.py": "import os\n",
            "fakepkg/a.py": "from fakepkg.b import thing\nfrom fakepkg import low\n",
            "fakepkg/b.py": "thing = 1\n\ndef later():\n    from . import a\n    return a\n",
            "fakepkg/sub/__init__.py": "from .inner import x\n",
            "fakepkg/sub/inner.py": "import fakepkg.sub.deep as deep\nx = deep\n",
            "fakepkg/sub/deep.py": "from .. import sub\n",
            "fakepkg/alone.py": "import fakepkg.alone\n",
        },
    )
    graph = import_graph(package)
    assert graph["fakepkg.a"] == {"fakepkg.b", "fakepkg.low"}
    assert graph["fakepkg.b"] == {"fakepkg.a"}
    assert graph["fakepkg.sub"] == {"fakepkg.sub.inner"}
    assert graph["fakepkg.sub.deep"] == {"fakepkg.sub"}
    assert graph["fakepkg.low"] == set()
    cycles = find_cycles(graph)
    assert sorted(cycles) == [
        ["fakepkg.a", "fakepkg.b", "fakepkg.a"],
        ["fakepkg.alone", "fakepkg.alone"],
        ["fakepkg.sub", "fakepkg.sub.inner", "fakepkg.sub.deep", "fakepkg.sub"],
    ]
    assert find_cycles(graph, touching=("fakepkg.sub",)) == [
        ["fakepkg.sub", "fakepkg.sub.inner", "fakepkg.sub.deep", "fakepkg.sub"]
    ]
    assert find_cycles(graph, touching=("fakepkg.low",)) == []


def test_the_cycle_finder_passes_a_package_without_a_cycle(tmp_path: Path) -> None:
    package = _write_package(
        tmp_path,
        {
            "fakepkg/__init__.py": "from fakepkg.top import run\n",
            "fakepkg/base.py": "VALUE = 1\n",
            "fakepkg/top.py": "from fakepkg import base\n\ndef run():\n    from .base import VALUE\n    return VALUE\n",
        },
    )
    assert find_cycles(import_graph(package)) == []


def test_the_mutable_state_finder_finds_each_kind(tmp_path: Path) -> None:
    package = _write_package(
        tmp_path,
        {
            "fakepkg/__init__.py": "__all__ = ['x']\n",
            "fakepkg/state.py": (
                "import collections\n"
                "from typing import TYPE_CHECKING\n"
                "NAMES = ('a', 'b')\n"
                "FROZEN = frozenset({'a'})\n"
                "LIST = []\n"
                "TABLE: dict[str, int] = {}\n"
                "SQUARES = {n: n * n for n in range(3)}\n"
                "SEEN = set()\n"
                "COUNTS = collections.Counter()\n"
                "if not TYPE_CHECKING:\n"
                "    QUEUE = collections.deque()\n"
                "def count():\n"
                "    global CALLS\n"
                "    local = []\n"
                "    return local\n"
                "class Holder:\n"
                "    items = []\n"
            ),
        },
    )
    assert package_mutable_state(package) == [
        "fakepkg.state:5 LIST is a list literal",
        "fakepkg.state:6 TABLE is a dict literal",
        "fakepkg.state:7 SQUARES is a comprehension",
        "fakepkg.state:8 SEEN is set()",
        "fakepkg.state:9 COUNTS is Counter()",
        "fakepkg.state:11 QUEUE is deque()",
        "fakepkg.state:13 global CALLS",
    ]


@pytest.mark.parametrize(
    "module", ["shardkit._core.targets", "shardkit._transport.client", "shardkit._transport.worker"]
)
def test_the_graph_reads_the_real_package(module: str) -> None:
    """Guards the reader against finding nothing (a wrong root would pass every test above)."""
    graph = import_graph(PACKAGE_ROOT)
    assert module in graph
    assert "shardkit.contract" in graph[module]


def test_the_layer_checks_find_an_import_upwards() -> None:
    graph = {
        "pkg.low.a": {"pkg.low.b"},
        "pkg.low.b": {"pkg.high.c"},
        "pkg.high.c": set(),
        "pkg.room.base": set(),
        "pkg.room.mid": {"pkg.room.base"},
        "pkg.room.top": {"pkg.room.mid", "pkg.low.a"},
    }
    assert layer_violations(graph, ("pkg.low",), ("pkg.high",)) == [
        "pkg.low.a -> pkg.low.b -> pkg.high.c",
        "pkg.low.b -> pkg.high.c",
    ]
    assert layer_violations(graph, ("pkg.high",), ("pkg.low",)) == []
    layers = {"base": set(), "mid": {"base"}, "top": {"mid"}}
    assert room_violations(graph, "pkg.room", layers) == ["pkg.room.top -> pkg.room.mid -> pkg.room.base"]
    assert room_violations(graph, "pkg.room", {**layers, "top": {"mid", "base"}}) == []


def test_the_importer_check_finds_a_direct_import_from_outside_the_allowed_rooms() -> None:
    graph = {
        "pkg.room": {"pkg.room.a"},
        "pkg.room.a": {"pkg.room.b", "pkg.low"},
        "pkg.room.b": set(),
        "pkg.cli.x": {"pkg.room.a"},
        "pkg.cli.y": {"pkg.cli.x"},
        "pkg.other": {"pkg.room.b", "pkg.cli.y"},
        "pkg.low": set(),
    }
    # pkg.other reaches pkg.room.a through the command line too: only its own import counts.
    assert direct_importers(graph, "pkg.room", ("pkg.cli",)) == ["pkg.other -> pkg.room.b"]
    assert direct_importers(graph, "pkg.room", ()) == ["pkg.cli.x -> pkg.room.a", "pkg.other -> pkg.room.b"]
    assert direct_importers(graph, "pkg.room", ("pkg.cli", "pkg.other")) == []


#: The most lines a module of the command line may have: it reads arguments and hands them
#: to the rooms below (the bench, the campaign, the run); a larger one is doing their work.
CLI_MODULE_LINES = 400


def modules_over(folder: Path, most_lines: int) -> dict[str, int]:
    sizes = {path.name: len(path.read_text(encoding="utf-8").splitlines()) for path in sorted(folder.glob("*.py"))}
    return {name: lines for name, lines in sizes.items() if lines > most_lines}


def test_the_command_line_stays_thin() -> None:
    assert modules_over(PACKAGE_ROOT / "_cli", CLI_MODULE_LINES) == {}


def test_the_size_check_finds_a_large_module(tmp_path: Path) -> None:
    (tmp_path / "small.py").write_text("x = 1\n" * 3)
    (tmp_path / "large.py").write_text("x = 1\n" * 5)
    assert modules_over(tmp_path, 4) == {"large.py": 5}
