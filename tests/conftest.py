"""Shared fixtures: the real tokenizer, tiny random models in float32, and engines built on them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():   # Triton kernels run on CPU tensors in Triton's interpreter, set before its import
    os.environ.setdefault("TRITON_INTERPRET", "1")
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from models.db import make_engine, make_session_factory, upgrade
from tests.stack import Stack, base_env, throwaway_database
from tests.tiny_model import make_tiny_model_dir
from worker.local_redis import start_redis
from worker.model_loader import load_model, load_tokenizer


def pytest_configure(config) -> None:
    """Each pytest worker takes its share of the cores, and so do the processes its tests start (a stack's worker):
    two workers of two threads each on two cores wait at every parallel op for each other's descheduled threads (a
    real-model precision check took 44 s beside one busy process at two threads, 9 s at one). An OMP_NUM_THREADS
    set outside is kept; a run without workers keeps torch's own default."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:   # no workers, or their controller (whose environment they inherit)
        return
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workerinput["workercount"])))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The slowest modules, slowest first (junit times of a run on two cores): started first, so the two workers end
# together. xdist's own order (most tests first) left the long stack modules of few tests to the end, with one
# worker idle for a minute or more. `make test` keeps this order (--no-loadscope-reorder).
SLOWEST_FIRST = ("test_engine", "test_bench", "test_infra_faults", "test_attention", "test_class_queues",
                 "test_service_classes", "test_worker_faults", "test_api_edges", "test_summaries",
                 "test_engine_requests", "test_supervisor", "test_chat_stack", "test_grounded_stack", "test_fused",
                 "test_triton_attention", "test_soak", "test_api_protocol", "test_compiled")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))   # stable: each module's tests keep their order


CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture()
def two_threads() -> Iterator[None]:
    """The C kernels' parallel paths run even where this process's share of the cores is one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def browser():
    """Debian's headless chromium, launched once; each test opens its own pages (a fresh context each)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (make test does)")
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is needed: apt-get install chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tokenizer):
    """One saved tiny model per architecture, built once per session."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model_dir(root / arch, tokenizer, arch) for arch in ("llama", "qwen2", "qwen3", "gpt2")}


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture()
def tiny(tiny_model_dir):
    """A fresh (model, tokenizer) pair: the engine switches the model's attention, so none is shared."""
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def real_model():
    """The default model in float32, as `generate` is checked against on SDPA."""
    return load_model()


@pytest.fixture(scope="session")
def served_model():
    """The default model as the worker serves it: WEIGHTS=auto, the settings' default."""
    return load_model(weights="auto")


DEFAULT_PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[Engine]:
    """AUTOCOMMIT engine on the server's maintenance database; skips when no server answers."""
    url = os.environ.get("TEST_POSTGRES_URL", DEFAULT_PG_ADMIN_URL)
    engine = create_engine(
        url, isolation_level="AUTOCOMMIT", poolclass=NullPool, connect_args={"connect_timeout": 3}
    )
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # any failure to connect means "no server here", not a test failure
        engine.dispose()
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        pytest.skip(f"PostgreSQL not reachable at {engine.url.render_as_string()}: {reason}")
    yield engine
    engine.dispose()


@pytest.fixture()
def pg_url(pg_admin: Engine) -> Iterator[str]:
    """A throwaway database, so whatever the server already holds stays untouched."""
    with throwaway_database(pg_admin) as url:
        yield url


@pytest.fixture(scope="session")
def stack(tmp_path_factory, tiny_model_dir):
    """The running system on the tiny model: private Redis, SQLite, one worker, two web processes."""
    workdir = tmp_path_factory.mktemp("stack")
    redis_proc, redis_url = start_redis(workdir / "redis")
    database_url = f"sqlite:///{workdir / 'chat.db'}"
    upgrade(database_url)
    s = Stack(workdir, base_env(redis_url, database_url, tiny_model_dir, workdir))
    try:
        s.start_worker()
        s.start_housekeeping()
        s.start_web()
        s.start_web()   # a second web process: answers must reach clients on either
        yield s
    finally:
        s.stop()
        redis_proc.terminate()
        redis_proc.wait(10)


@pytest.fixture(scope="session")
def db(stack):
    return make_session_factory(make_engine(stack.env["DATABASE_URL"]))
