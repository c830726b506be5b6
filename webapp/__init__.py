"""Flask web app: the customer chat page, the OpenAI-compatible API and the operators' dashboard."""

from __future__ import annotations

from flask import Flask

from models.db import make_engine, make_session_factory
from messaging.connections import redis_client
from messaging.queue import make_celery

from . import config
from .capacity import Capacity
from .sockets import SOCKET_BUFFER_BYTES, async_mode, socketio
from .stream import StreamQueue


def create_app(overrides: dict | None = None) -> Flask:
    app = Flask(__name__, instance_path=str(config.INSTANCE_DIR))
    app.config.update(config.load())
    app.config.update(overrides or {})
    config.check_production(app.config)
    app.extensions["redis"] = redis_client(app.config["REDIS_URL"])
    app.extensions["capacity"] = Capacity(app.extensions["redis"])
    # A publisher per message taken in at once (queue.INTAKE_CONCURRENCY), and a few to spare: none waits for one.
    app.extensions["celery"] = make_celery(app.config["REDIS_URL"], broker_pool_limit=32)
    app.extensions["db"] = make_session_factory(make_engine(app.config["DATABASE_URL"]))
    # Every web process listens on the same Redis channels, so any worker's answers reach any of them.
    stream = app.extensions["stream"] = StreamQueue(app.config["REDIS_URL"])
    socketio.init_app(app, client_manager=stream, async_mode=async_mode(), max_http_buffer_size=SOCKET_BUFFER_BYTES)

    from . import api, api_messages, auth, chat, dashboard, headers, health, keyring, limits, metrics, security, tokens
    headers.init_app(app)   # first: every response, errors included, carries the request's id
    try:
        limits.init_app(app)
    except ValueError as exc:
        raise config.ConfigError(str(exc)) from exc
    security.init_app(app)
    security.trust_proxies(app)   # outermost, so Socket.IO connections see the client's address too
    app.register_blueprint(chat.bp)
    keyring.init_app(app)   # before every /v1 request: its API key
    api.init_app(app)
    api_messages.init_app(app)   # errors on /v1/messages in Anthropic's shape
    app.register_blueprint(tokens.bp)
    app.register_blueprint(health.bp)
    auth.init_app(app)
    app.register_blueprint(dashboard.bp)
    metrics.init_app(app)
    return app
