"""The shape of the code base (README "Layout", CONTRIBUTING.md): imports in one direction, no
import cycle (imports inside functions count too), no hand-written module over 600 lines, and
common/ importing nothing of the project but the generated wire code."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = {"agent": "xpusense.agent", "collector": "xpusense.collector", "probes": "xpusense.probes",
            "client": "xpusense.client", "common": "xpusense.common", "proto/xpusense": "xpusense"}
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Project modules `name` imports, at any depth of its code."""
    deps = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                module = ".".join(base + ([module] if module else []))
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                deps.add(target)
    return deps


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in GRAPH:
        if start in index:
            continue
        work = [(start, iter(sorted(GRAPH[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(GRAPH.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_walk_finds_the_project():
    assert {"xpusense.agent.daemon", "xpusense.collector.server", "xpusense.common.config"} <= set(MODULES)
    assert "xpusense.common.config" in GRAPH["xpusense.agent.config"]


def test_no_import_cycle():
    assert _cycles() == []


def test_the_cycle_finder_finds_one():
    GRAPH["xpusense.common.config"].add("xpusense.agent.config")
    try:
        assert any("xpusense.common.config" in c and "xpusense.agent.config" in c for c in _cycles())
    finally:
        GRAPH["xpusense.common.config"].discard("xpusense.agent.config")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_over_600_lines(name):
    assert MODULES[name].read_text(encoding="utf-8").count("\n") <= MAX_LINES


def test_common_imports_nothing_of_the_project_but_the_wire_code():
    for name, deps in GRAPH.items():
        if name.startswith("xpusense.common"):
            outside = {d for d in deps if not d.startswith(("xpusense.common", "xpusense.v1")) and d != "xpusense"}
            assert not outside, f"{name} imports {outside}"


def test_the_collector_never_imports_the_agent():
    for name, deps in GRAPH.items():
        if name.startswith("xpusense.collector"):
            assert not {d for d in deps if d.startswith("xpusense.agent")}, name


def test_every_package_is_in_the_wheel():
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_test_files_have_unique_names():
    """pytest imports test files by basename (rootdir mode, no packages): two files of one name in
    different folders stop the whole run at collection."""
    names: dict[str, list[str]] = {}
    for p in (ROOT / "tests").rglob("test_*.py"):
        names.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}
