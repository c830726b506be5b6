"""The tiers' imports: the web app reaches nothing in the worker, and the engine nothing in the queue or web."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

from tests.stack import ROOT


def modules_after(statement: str) -> set[str]:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_web_app_imports_nothing_from_the_worker_nor_torch():
    loaded = modules_after("from webapp import create_app; import webapp.api, webapp.chat, webapp.dashboard, "
                           "webapp.health, webapp.metrics")
    assert not {m for m in loaded if m == "worker" or m.startswith("worker.")}, "webapp imports from worker/"
    assert "torch" not in loaded


BANNED_IN_ENGINE = ("messaging", "webapp", "flask", "celery", "redis", "sqlalchemy", "models")


def test_the_engine_imports_no_queue_web_or_sql_module():
    # torch's own compiler looks for redis (an optional remote cache) when FlexAttention loads, so the engine is
    # imported with every banned package made unimportable: it must load, and none of them may appear.
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in BANNED_IN_ENGINE)
    loaded = modules_after(f"{blocked}; import worker.engine; "
                           f"[sys.modules.pop(n) for n in {BANNED_IN_ENGINE!r}]")
    for banned in BANNED_IN_ENGINE:
        assert banned not in loaded, banned
    # Nor does it load torch's compiler: a dependency that runs torch.compile as it is imported costs every
    # process that imports the engine seconds (a worker's start, each test process) before anything compiles.
    assert "torch._inductor.compile_fx" not in loaded


def test_no_engine_module_names_a_queue_web_or_sql_package():
    for path in (ROOT / "worker" / "engine").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                assert name.split(".")[0] not in BANNED_IN_ENGINE, f"{path.name} imports {name}"


PACKAGES = ("webapp", "worker", "messaging", "models", "structured", "housekeeping", "bench")


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of PACKAGES it imports, anywhere in it (inside functions and TYPE_CHECKING blocks
    too). `from package import name` points at the submodule when `name` is one, else at the package."""
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module] if node.module else
                                here[:len(here) - node.level + 1]) if node.level else node.module
                edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[module] = {e for e in edges if e in files and e != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of modules that import one another, directly or through others (Tarjan's strongly connected
    components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                found.append(sorted(group + [v]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    assert {"webapp.chat", "worker.job", "bench.engine"} <= set(graph)   # the graph covers the packages
    assert "webapp.sockets" in graph["webapp.chat"] and "worker.runtime" in graph["worker.job"]
    assert circles(graph) == []


def test_the_product_imports_nothing_from_its_benchmarks():
    graph = import_graph()
    leaks = {m: sorted(e for e in edges if e.split(".")[0] == "bench") for m, edges in graph.items()
             if m.split(".")[0] != "bench"}
    assert {m: e for m, e in leaks.items() if e} == {}
