"""The operators' latency dashboard: the page, the JSON it polls for every figure it shows, and the API keys page."""

from __future__ import annotations

from flask import Blueprint, current_app, flash, redirect, render_template, request, url_for

from messaging.classes import CLASSES

from . import aggregates, keys
from .auth import check_csrf, operator_required

bp = Blueprint("dashboard", __name__, url_prefix="/dashboard")

POLL_SECONDS = 5


def chosen_window() -> str | None:
    key = request.args.get("window", aggregates.DEFAULT_WINDOW)
    return key if key in aggregates.WINDOWS else None


@bp.get("")
@operator_required(page=True)
def page():
    return render_template("dashboard.html", windows=aggregates.WINDOWS.values(), classes=CLASSES,
                           window=chosen_window() or aggregates.DEFAULT_WINDOW, poll_seconds=POLL_SECONDS,
                           operator=current_app.config["OPERATOR_USERNAME"])


@bp.get("/data")
@operator_required()
def data():
    window = chosen_window()
    if window is None:
        return {"error": {"code": "invalid_window",
                          "message": f"window must be one of {', '.join(aggregates.WINDOWS)}."}}, 400
    with current_app.extensions["db"]() as db:
        body = aggregates.figures(db, current_app.extensions["redis"], window,
                                  objectives=current_app.config["TTFT_OBJECTIVES"])
    return body, 200, {"Cache-Control": "no-store"}


def keys_page(status: int = 200, created: tuple | None = None, error: str | None = None, form: dict | None = None):
    """The keys page; a key just created is in this one response only (never stored, never cached)."""
    with current_app.extensions["db"]() as db:
        rows = keys.all_keys(db)
        status_line = keys.api_status(db, request.host_url.rstrip("/") + "/v1",
                                      current_app.config.get("SUPPORTBOT_ENV") == "production")
    html = render_template("keys.html", keys=rows, created=created, error=error, form=form or {}, when=keys.when,
                           status_line=status_line, api_base=request.host_url.rstrip("/") + "/v1", classes=CLASSES,
                           operator=current_app.config["OPERATOR_USERNAME"])
    return html, status, {"Cache-Control": "no-store"}


@bp.get("/keys")
@operator_required(page=True)
def api_keys():
    return keys_page()


@bp.post("/keys")
@operator_required(page=True)
def create_key():
    check_csrf()
    form = {"name": request.form.get("name", ""), "rate_limit": request.form.get("rate_limit", ""),
            "service_class": request.form.get("service_class", "standard"),
            "priority": request.form.get("priority") == "on"}
    try:
        with current_app.extensions["db"]() as db:
            key, secret = keys.create(db, form["name"], form["rate_limit"] or None, form["service_class"],
                                      form["priority"])
            created = (key.name, secret)
    except keys.KeyCommandError as exc:
        return keys_page(400, error=str(exc), form=form)
    return keys_page(201, created=created)


@bp.post("/keys/<name>/revoke")
@operator_required(page=True)
def revoke_key(name: str):
    check_csrf()
    try:
        with current_app.extensions["db"]() as db:
            key, now = keys.revoke(db, name)
    except keys.KeyCommandError as exc:
        return keys_page(404, error=str(exc))
    flash(f"Revoked the key {key.name!r} ({key.prefix}): every web process refuses it within a few seconds."
          if now else f"The key {key.name!r} was revoked already.")
    return redirect(url_for("dashboard.api_keys"), 303)


@bp.post("/keys/<name>/class")
@operator_required(page=True)
def set_key_class(name: str):
    check_csrf()
    try:
        with current_app.extensions["db"]() as db:
            key = keys.set_class(db, name, request.form.get("service_class"), request.form.get("priority") == "on")
            flash(f"The key {key.name!r} is now {keys.describe_class(key)}; every web process applies it within a few "
                  "seconds.")
    except keys.KeyCommandError as exc:
        return keys_page(400 if "service class" in str(exc) else 404, error=str(exc))
    return redirect(url_for("dashboard.api_keys"), 303)
