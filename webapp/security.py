"""Browser-facing hardening in one place: response headers, cookie flags, proxies, and text hygiene."""

from __future__ import annotations

import logging
import re

from flask import Flask, Response, request
from werkzeug.middleware.proxy_fix import ProxyFix

log = logging.getLogger(__name__)

# Every page loads scripts and styles only from this site, never inline: an injected <script> or
# onerror= attribute does not run even if some text were ever rendered as HTML.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HSTS = "max-age=31536000; includeSubDomains"

HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
}

# C0 controls but tab and newline, DEL, C1 controls, and lone surrogates (which no database or
# browser can store or show): removed from every text a client sends.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def clean_text(text: str) -> str:
    """Line breaks made uniform, then unprintable characters dropped; the rest is kept verbatim."""
    return _UNPRINTABLE.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


def secure_headers(response: Response) -> Response:
    for name, value in HEADERS.items():
        response.headers.setdefault(name, value)
    if request.is_secure:
        response.headers.setdefault("Strict-Transport-Security", HSTS)
    return response


_warned_plain_http = False


def warn_on_plain_http(response: Response) -> Response:
    """A Secure cookie sent over plain HTTP is dropped by the browser: every page load starts a new session."""
    global _warned_plain_http
    if not request.is_secure and not _warned_plain_http:
        _warned_plain_http = True
        log.warning("SESSION_COOKIE_SECURE is on but %s came over plain HTTP: browsers will not send the session "
                    "cookie back. Serve over HTTPS (behind a proxy: TRUSTED_PROXY_HOPS=1) or set "
                    "SESSION_COOKIE_SECURE=0.", request.path)
    return response


def init_app(app: Flask) -> None:
    app.after_request(secure_headers)
    if app.config.get("SESSION_COOKIE_SECURE"):
        app.after_request(warn_on_plain_http)


def trust_proxies(app: Flask) -> None:
    """Behind N reverse proxies, take the client's address and scheme from their X-Forwarded-* headers."""
    hops = int(app.config.get("TRUSTED_PROXY_HOPS") or 0)
    if hops > 0:
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=hops, x_port=hops)
