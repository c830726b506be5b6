"""The operators' latency dashboard: the page, and the JSON it polls for every figure it shows."""

from __future__ import annotations

from flask import Blueprint, current_app, render_template, request

from . import aggregates
from .auth import operator_required

bp = Blueprint("dashboard", __name__, url_prefix="/dashboard")

POLL_SECONDS = 5


def chosen_window() -> str | None:
    key = request.args.get("window", aggregates.DEFAULT_WINDOW)
    return key if key in aggregates.WINDOWS else None


@bp.get("")
@operator_required(page=True)
def page():
    return render_template("dashboard.html", windows=aggregates.WINDOWS.values(),
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
        body = aggregates.figures(db, current_app.extensions["redis"], window)
    return body, 200, {"Cache-Control": "no-store"}
