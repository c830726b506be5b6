"""Flask web app: the customer chat page, the OpenAI-compatible API and the operators' dashboard."""

from __future__ import annotations

import redis
from flask import Flask
from flask_socketio import SocketIO

from models.db import make_engine, make_session_factory
from worker.celery_app import make_celery

from . import config

socketio = SocketIO()


def create_app(overrides: dict | None = None) -> Flask:
    app = Flask(__name__, instance_path=str(config.INSTANCE_DIR))
    app.config.update(config.load())
    app.config.update(overrides or {})
    config.check_production(app.config)
    app.extensions["redis"] = redis.Redis.from_url(app.config["REDIS_URL"])
    app.extensions["celery"] = make_celery(app.config["REDIS_URL"])
    app.extensions["db"] = make_session_factory(make_engine(app.config["DATABASE_URL"]))
    # Every web process listens on the same Redis channel, so the worker's emits reach any of them.
    socketio.init_app(app, message_queue=app.config["REDIS_URL"], async_mode="threading",
                      max_http_buffer_size=64 * 1024)

    from . import api, auth, chat, dashboard, health, metrics
    app.register_blueprint(chat.bp)
    app.register_blueprint(api.bp)
    app.register_blueprint(health.bp)
    auth.init_app(app)
    app.register_blueprint(dashboard.bp)
    metrics.init_app(app)
    return app
