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


def test_no_engine_module_names_a_queue_web_or_sql_package():
    for path in (ROOT / "worker" / "engine").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                assert name.split(".")[0] not in BANNED_IN_ENGINE, f"{path.name} imports {name}"
