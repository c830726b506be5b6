"""The tiers' imports: the web app reaches nothing in the worker, and the engine nothing in the queue or web."""

from __future__ import annotations

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


def test_the_engine_imports_no_queue_web_or_sql_module():
    loaded = modules_after("import worker.engine")
    for banned in ("messaging", "webapp", "flask", "celery", "redis", "sqlalchemy", "models"):
        assert banned not in loaded, banned
