"""Web app settings from the environment; every one has a default that runs on one machine."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from werkzeug.security import generate_password_hash

from messaging import chat_tools, classes, grounding
from messaging.generation import Generation, GenerationError

log = logging.getLogger(__name__)

INSTANCE_DIR = Path(__file__).resolve().parent.parent / "instance"

DEFAULT_SYSTEM_PROMPT = (
    "You are the friendly customer-support assistant of {shop}, an online shop. Answer briefly and politely. "
    "Orders ship within 2 business days; standard delivery takes 3-7 business days. Unworn items can be "
    "returned within 30 days for a full refund. If you need an order's details, ask for the order number; "
    "never invent order information. For anything you cannot solve, offer to connect the customer with a "
    "human agent."
)


def _secret_key() -> str:
    """A stable key per installation, so sessions survive restarts and are shared by all web processes."""
    if os.environ.get("SECRET_KEY"):
        return os.environ["SECRET_KEY"]
    path = INSTANCE_DIR / "secret_key"
    if not path.exists():
        INSTANCE_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
    return path.read_text().strip()


class ConfigError(RuntimeError):
    """A setting that must be changed before the app may start; the message names it."""


# Values found in examples and tutorials: a deployment that still uses one is not configured.
KNOWN_DEFAULT_SECRETS = frozenset({
    "", "dev", "development", "secret", "secret-key", "secret_key", "changeme", "change-me", "change_me",
    "test-secret", "supportbot", "password", "operator", "admin", "default", "test",
})


def production() -> bool:
    return os.environ.get("SUPPORTBOT_ENV", "development").strip().lower() == "production"


def dev_operator_password(username: str) -> str:
    """A random operator password kept in instance/, created by whichever web process starts first."""
    path = INSTANCE_DIR / "operator_password"
    if not path.exists():
        INSTANCE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".operator_password.{os.getpid()}")
        tmp.write_text(secrets.token_urlsafe(12) + "\n")
        tmp.chmod(0o600)
        try:
            os.link(tmp, path)   # atomic: another process that got there first keeps its password
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    password = path.read_text().strip()
    log.warning("operator login: user %r, password %r (from %s; set OPERATOR_PASSWORD to choose one)",
                username, password, path)
    return password


def operator_password_hash(cfg: dict) -> str | None:
    """The configured hash, else a hash of the configured password, else (development only) a generated one."""
    if cfg.get("OPERATOR_PASSWORD_HASH"):
        return cfg["OPERATOR_PASSWORD_HASH"]
    if cfg.get("OPERATOR_PASSWORD"):
        return generate_password_hash(cfg["OPERATOR_PASSWORD"])
    if cfg.get("SUPPORTBOT_ENV") == "production":
        return None
    return generate_password_hash(dev_operator_password(cfg.get("OPERATOR_USERNAME", "operator")))


def check_production(cfg: dict) -> None:
    """Refuse to serve in production with a secret that is missing or left at a well-known value."""
    if cfg.get("SUPPORTBOT_ENV") != "production":
        return
    if cfg.get("DEBUG"):   # the Werkzeug debugger runs Python for anyone who sees its error page
        raise ConfigError("SUPPORTBOT_ENV=production refuses debug mode: unset FLASK_DEBUG.")
    secret = str(cfg.get("SECRET_KEY") or "")
    if secret.strip().lower() in KNOWN_DEFAULT_SECRETS or len(secret) < 16:
        raise ConfigError("SUPPORTBOT_ENV=production needs SECRET_KEY: set it to a long random value shared by "
                          "every web process, e.g. python -c 'import secrets; print(secrets.token_hex(32))'.")
    password, hashed = cfg.get("OPERATOR_PASSWORD"), cfg.get("OPERATOR_PASSWORD_HASH")
    if not password and not hashed:
        raise ConfigError("SUPPORTBOT_ENV=production needs OPERATOR_PASSWORD (or OPERATOR_PASSWORD_HASH, a "
                          "werkzeug.security.generate_password_hash value) for the operators' login.")
    if password is not None and (password.strip().lower() in KNOWN_DEFAULT_SECRETS or len(password) < 8):
        raise ConfigError("SUPPORTBOT_ENV=production: OPERATOR_PASSWORD is a well-known default or shorter than "
                          "8 characters; set OPERATOR_PASSWORD to a strong password.")
    if hashed and (hashed.count("$") != 2 or hashed.split(":")[0] not in ("scrypt", "pbkdf2")):
        raise ConfigError("SUPPORTBOT_ENV=production: OPERATOR_PASSWORD_HASH is not a werkzeug password hash; "
                          "make one with werkzeug.security.generate_password_hash.")
    token = cfg.get("METRICS_TOKEN")
    if token is not None and (token.strip().lower() in KNOWN_DEFAULT_SECRETS or len(token) < 16):
        raise ConfigError("SUPPORTBOT_ENV=production: METRICS_TOKEN is a well-known default or shorter than 16 "
                          "characters; set it to a long random value, or unset it to scrape with a login only.")


def flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or not value.strip():
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def optional_int(name: str) -> int | None:
    """An integer setting, or None when it is unset or empty (then its default follows the workers' capacity)."""
    value = os.environ.get(name, "").strip()
    return int(value) if value else None


def system_prompt(shop: str) -> str:
    if os.environ.get("SYSTEM_PROMPT_FILE"):
        return Path(os.environ["SYSTEM_PROMPT_FILE"]).read_text().strip()
    return os.environ.get("SYSTEM_PROMPT", DEFAULT_SYSTEM_PROMPT).replace("{shop}", shop)


def load() -> dict:
    shop = os.environ.get("SHOP_NAME", "Northwind Goods")
    return {
        # Production never invents a key: check_production() asks for one instead.
        "SECRET_KEY": os.environ.get("SECRET_KEY") if production() else _secret_key(),
        "SUPPORTBOT_ENV": "production" if production() else "development",
        "SESSION_COOKIE_SAMESITE": "Lax",
        "SESSION_COOKIE_HTTPONLY": True,
        # Production sends cookies over HTTPS only; a plain-HTTP deployment opts out with SESSION_COOKIE_SECURE=0.
        "SESSION_COOKIE_SECURE": flag("SESSION_COOKIE_SECURE", production()),
        "TRUSTED_PROXY_HOPS": int(os.environ.get("TRUSTED_PROXY_HOPS", "0")),
        "MAX_CONTENT_LENGTH": int(os.environ.get("MAX_REQUEST_BYTES", str(1024 * 1024))),
        "RATE_LIMIT_PER_SESSION": os.environ.get("RATE_LIMIT_PER_SESSION", "60/minute"),
        "RATE_LIMIT_PER_IP": os.environ.get("RATE_LIMIT_PER_IP", "600/minute"),
        "LOGIN_RATE_LIMIT": os.environ.get("LOGIN_RATE_LIMIT", "10/minute"),
        "MAX_CONNECTIONS_PER_IP": optional_int("MAX_CONNECTIONS_PER_IP"),   # None: follows the workers' slots
        "OPERATOR_USERNAME": os.environ.get("OPERATOR_USERNAME", "operator"),
        "OPERATOR_PASSWORD": os.environ.get("OPERATOR_PASSWORD") or None,
        "OPERATOR_PASSWORD_HASH": os.environ.get("OPERATOR_PASSWORD_HASH") or None,
        "METRICS_TOKEN": os.environ.get("METRICS_TOKEN") or None,
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "DATABASE_URL": os.environ.get("DATABASE_URL"),
        "SHOP_NAME": shop,
        "SYSTEM_PROMPT": system_prompt(shop),
        "MAX_MESSAGE_CHARS": int(os.environ.get("MAX_MESSAGE_CHARS", "4000")),
        "QUEUE_LIMIT": optional_int("QUEUE_LIMIT"),   # None: follows the workers' slots (webapp/capacity.py)
        **chat_generation_settings(),
        # An API answer that sends nothing for this long once a worker has started it is cancelled and ends with
        # a `timeout` error; a request no worker started within API_QUEUE_TIMEOUT_S is cancelled the same way.
        "API_ANSWER_TIMEOUT_S": float(os.environ.get("API_ANSWER_TIMEOUT_S", "120")),
        "API_QUEUE_TIMEOUT_S": float(os.environ.get("API_QUEUE_TIMEOUT_S", "600")),
        # A streamed answer with nothing to send this long sends an SSE comment, so proxies keep it open.
        "API_KEEPALIVE_S": float(os.environ.get("API_KEEPALIVE_S", "15")),
        **chat_tools_settings(),
        **class_settings(),
        "CHAT_GROUNDING": grounding_settings(),
    }


def grounding_settings() -> dict | None:
    """What the worker looks up before a chat answer (CHAT_GROUNDING, on by default), as the job carries it."""
    try:
        return grounding.settings(os.environ.get("CHAT_GROUNDING"), os.environ.get("ORDER_NUMBER_PATTERN"),
                                  os.environ.get("SUPPORT_CONTACT")).to_job()
    except ValueError as exc:
        raise ConfigError(f"{exc} Fix it in the environment (or .env).") from None


def chat_generation_settings() -> dict:
    """The chat's answer cap and sampling (MAX_NEW_TOKENS, TEMPERATURE, TOP_P) and its DRY repetition guard
    (DRY_MULTIPLIER, 0: off; DRY_BASE, DRY_ALLOWED_LENGTH; over each answer's own tokens, so an answer may quote
    the facts in its prompt), checked against the limits every request is held to (messaging/generation.py), so a
    value out of them stops the start instead of every answer."""
    try:
        cap = int(os.environ.get("MAX_NEW_TOKENS", "256"))
        temperature = float(os.environ.get("TEMPERATURE", "0.7"))
        top_p = float(os.environ.get("TOP_P", "0.9"))
        dry = {"dry_multiplier": float(os.environ.get("DRY_MULTIPLIER", "0.8")),
               "dry_base": float(os.environ.get("DRY_BASE", "1.75")),
               "dry_allowed_length": int(os.environ.get("DRY_ALLOWED_LENGTH", "2")), "dry_include_prompt": False}
    except ValueError as exc:
        raise ConfigError(f"MAX_NEW_TOKENS, TEMPERATURE, TOP_P, DRY_MULTIPLIER, DRY_BASE and DRY_ALLOWED_LENGTH must "
                          f"be numbers ({exc}); fix the environment (or .env).") from None
    try:
        Generation(max_new_tokens=cap, temperature=temperature, top_p=top_p, **dry).check(
            names={"max_new_tokens": "MAX_NEW_TOKENS", "temperature": "TEMPERATURE", "top_p": "TOP_P",
                   "dry_multiplier": "DRY_MULTIPLIER", "dry_base": "DRY_BASE",
                   "dry_allowed_length": "DRY_ALLOWED_LENGTH"})
    except GenerationError as exc:
        raise ConfigError(f"{exc} Fix it in the environment (or .env).") from None
    return {"MAX_NEW_TOKENS": cap, "TEMPERATURE": temperature, "TOP_P": top_p,
            "CHAT_DRY": dry if dry["dry_multiplier"] > 0 else {}}


def class_settings() -> dict:
    """Per service class: the time-to-first-token objective and the share of QUEUE_LIMIT it may fill."""
    try:
        switch = os.environ.get("SERVICE_CLASSES", "on").strip().lower()
        if switch not in ("on", "off"):
            raise ValueError(f"SERVICE_CLASSES must be on or off; got {switch!r}.")
        return {"TTFT_OBJECTIVES": classes.ttft_objectives(), "QUEUE_SHARES": classes.queue_shares(),
                "SERVICE_CLASSES": switch == "on"}
    except ValueError as exc:
        raise ConfigError(f"{exc} Fix it in the environment (or .env).") from None


def chat_tools_settings() -> dict:
    """The tools the chat assistant may call, run by the worker (CHAT_TOOLS, off by default), and its choice."""
    try:
        tools = chat_tools.tools_setting(os.environ.get("CHAT_TOOLS"))
        choice = chat_tools.choice_setting(os.environ.get("CHAT_TOOL_CHOICE"), tools)
    except ValueError as exc:
        raise ConfigError(f"{exc} Fix it in the environment (or .env).") from None
    return {"CHAT_TOOLS": tools, "CHAT_TOOL_CHOICE": choice}
