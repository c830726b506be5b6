"""Headers every HTTP response carries: its request id (`x-request-id`), `Retry-After` on every 429 and 503, and
OpenAI's `x-ratelimit-*-requests` on every request a rate limit counted."""

from __future__ import annotations

import re
import uuid

from flask import Flask, Response, g, has_request_context, request

HEADER = "X-Request-Id"
# A client's own id is echoed when it is one a log line and a header can carry as it is.
USABLE = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")
# Seconds to wait before trying again, for a 429 or 503 whose handler did not say.
DEFAULT_RETRY_AFTER_S = 5


def request_id() -> str | None:
    """This HTTP request's id: the client's X-Request-Id, else one made when the request came in."""
    return g.get("request_id") if has_request_context() else None


def _assign() -> None:
    sent = request.headers.get(HEADER, "")
    g.request_id = sent if USABLE.match(sent) else f"req_{uuid.uuid4().hex}"


def duration(seconds: float) -> str:
    """Seconds as OpenAI's rate-limit headers write them (Go's durations): `20ms`, `1.5s`, `6m0s`, `1h0m0s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    hours, rest = divmod(round(seconds, 3), 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{int(hours)}h{int(minutes)}m{text}"
    return f"{int(minutes)}m{text}" if minutes else text


def _complete(response: Response) -> Response:
    if (rid := request_id()) is not None:
        response.headers[HEADER] = rid
    budget = g.get("rate_limit")
    if budget is not None and budget.limit is not None:   # the tightest of the rules that counted this request
        response.headers["x-ratelimit-limit-requests"] = str(budget.limit)
        response.headers["x-ratelimit-remaining-requests"] = str(budget.remaining)
        response.headers["x-ratelimit-reset-requests"] = duration(budget.reset_s)
    if response.status_code in (429, 503) and "Retry-After" not in response.headers:
        response.headers["Retry-After"] = str(DEFAULT_RETRY_AFTER_S)
    return response


def init_app(app: Flask) -> None:
    app.before_request(_assign)
    app.after_request(_complete)
