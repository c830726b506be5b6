"""Operator login: one account from the environment, a session cookie and CSRF tokens on every form."""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from functools import wraps
from urllib.parse import urlsplit

from flask import Blueprint, Flask, abort, current_app, redirect, render_template, request, session, url_for
from werkzeug.security import check_password_hash

from . import config, limits

bp = Blueprint("auth", __name__)

OPERATOR_KEY = "operator"
CSRF_KEY = "csrf"


def init_app(app: Flask) -> None:
    """Resolve the operator's password hash once; the plain password does not stay in the config."""
    app.config["OPERATOR_PASSWORD_HASH"] = config.operator_password_hash(app.config)
    app.config["OPERATOR_PASSWORD"] = None
    app.context_processor(lambda: {"csrf_token": csrf_token})
    app.register_blueprint(bp)


def csrf_token() -> str:
    if CSRF_KEY not in session:
        session[CSRF_KEY] = secrets.token_urlsafe(32)
    return session[CSRF_KEY]


def check_csrf() -> None:
    sent, expected = request.form.get("csrf_token", ""), session.get(CSRF_KEY, "")
    if not expected or not hmac.compare_digest(sent.encode(), expected.encode()):
        abort(400, "The form expired or did not come from this site; reload the page and try again.")


def logged_in() -> bool:
    username = session.get(OPERATOR_KEY)
    return username is not None and username == current_app.config["OPERATOR_USERNAME"]


def bearer_ok() -> bool:
    """`Authorization: Bearer $METRICS_TOKEN`, for scrapers that cannot log in."""
    token = current_app.config.get("METRICS_TOKEN")
    scheme, _, sent = request.headers.get("Authorization", "").partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode(), token.encode())


def operator_required(page: bool = False) -> Callable:
    """Pages send a logged-out visitor to the login form; data endpoints answer 401."""
    def decorate(view: Callable) -> Callable:
        @wraps(view)
        def guarded(*args, **kwargs):
            if logged_in():
                return view(*args, **kwargs)
            if page:
                return redirect(url_for("auth.login", next=request.full_path.rstrip("?")))
            return {"error": {"code": "login_required", "message": "Log in as an operator at /login."}}, 401
        return guarded
    return decorate


def safe_next(target: str | None) -> str:
    """Only a path on this site, so the login form cannot bounce an operator elsewhere."""
    parts = urlsplit(target or "")
    if not target or parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//") \
            or "\\" in target:
        return url_for("dashboard.page")
    return target


@bp.route("/login", methods=["GET", "POST"])
def login():
    error, status = None, 200
    if request.method == "POST":
        check_csrf()
        username, password = request.form.get("username", ""), request.form.get("password", "")
        try:
            # Per address and per username, so neither one client nor many guessing one name get far.
            attempt_keys, attempt = limits.limit_login(username)
        except limits.RateLimited as exc:
            return render_template("login.html", error=exc.message, next=request.form.get("next", ""),
                                   username=username), 429, {"Retry-After": str(exc.retry_after)}
        hashed = current_app.config["OPERATOR_PASSWORD_HASH"]
        user_ok = hmac.compare_digest(username.encode(), current_app.config["OPERATOR_USERNAME"].encode())
        # The hash is checked even for a wrong name, so the answer's timing does not reveal valid names.
        password_ok = bool(hashed) and check_password_hash(hashed, password)
        if user_ok and password_ok:
            limits.refund(current_app.extensions["redis"], attempt_keys, attempt)   # only failures count
            session.pop(CSRF_KEY, None)   # a fresh CSRF token for the logged-in operator
            session[OPERATOR_KEY] = username
            return redirect(safe_next(request.form.get("next")))
        error, status = "Wrong username or password.", 401
    elif logged_in():
        return redirect(safe_next(request.args.get("next")))
    return render_template("login.html", error=error, next=request.values.get("next", ""),
                           username=request.form.get("username", "")), status


@bp.post("/logout")
def logout():
    check_csrf()
    session.pop(OPERATOR_KEY, None)
    session.pop(CSRF_KEY, None)
    return redirect(url_for("auth.login"))
