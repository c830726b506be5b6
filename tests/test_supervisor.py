"""`make run`'s supervisor on PostgreSQL: it serves, restarts a worker killed mid-answer, and stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import requests

from models import Order, RequestRecord
from models.db import make_engine, make_session_factory
from tests.clients import ChatClient
from tests.stack import ROOT, wait_for
from worker.local_redis import free_port


def celery_main(supervisor: psutil.Process) -> psutil.Process | None:
    """The worker the supervisor started (its direct child), or None while it is being restarted."""
    for child in supervisor.children():
        if "celery" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
            return child
    return None


def test_supervisor_restarts_a_killed_worker_and_stops_everything(tmp_path, tiny_model_dir, pg_url):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MODEL")}
    env.update(DATABASE_URL=pg_url, MODEL=str(tiny_model_dir), PORT=str(port), RUN_DIR=str(tmp_path / "run"),
               MAX_NUM_SEQS="2", KV_CACHE_GIB="0.05", SECRET_KEY="test-secret", TEMPERATURE="0",
               MAX_NEW_TOKENS="16", HF_HUB_OFFLINE="1", VISIBILITY_TIMEOUT="6", PYTHONUNBUFFERED="1")
    log = tmp_path / "supervisor.log"
    proc = subprocess.Popen([sys.executable, "supervise.py"], cwd=ROOT, env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    supervisor = psutil.Process(proc.pid)
    try:
        # No REDIS_URL: the supervisor starts a private Redis; the migration runs on the empty database.
        wait_for(lambda: requests.get(url + "/readyz", timeout=2).ok, 120, "make run", proc, log)
        assert any("redis-server" in " ".join(c.cmdline()) for c in supervisor.children(recursive=True))
        assert any("housekeeping" in " ".join(c.cmdline()) for c in supervisor.children())
        assert (f"the OpenAI-compatible API at {url}/v1 is open to anyone who can reach it; create a key with: "
                f"{os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else sys.executable}"
                " -m webapp.keys create NAME") in log.read_text()
        client = ChatClient(url)
        first = client.ask("Do you have gift cards?")["done"]

        worker = celery_main(supervisor)
        worker.kill()
        wait_for(lambda: (w := celery_main(supervisor)) is not None and w.pid != worker.pid, 60,
                 "the restarted worker", proc, log)
        second = client.ask("How much do they cost?", conversation_id=first["conversation_id"], timeout=120)["done"]
        client.close()
        descendants = supervisor.children(recursive=True)
        assert "worker exited" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0 and "supportbot: stopped" in log.read_text()
    gone, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"

    with make_session_factory(make_engine(pg_url))() as db:
        records = [db.get(RequestRecord, d["request_id"]) for d in (first, second)]
        assert db.query(Order).count() == 0   # demo orders go only to the embedded database unless asked
    assert all(r.finished_at is not None and r.finish_reason in ("stop", "length") for r in records)
