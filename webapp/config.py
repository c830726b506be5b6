"""Web app settings from the environment; every one has a default that runs on one machine."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

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


def system_prompt(shop: str) -> str:
    if os.environ.get("SYSTEM_PROMPT_FILE"):
        return Path(os.environ["SYSTEM_PROMPT_FILE"]).read_text().strip()
    return os.environ.get("SYSTEM_PROMPT", DEFAULT_SYSTEM_PROMPT).replace("{shop}", shop)


def load() -> dict:
    shop = os.environ.get("SHOP_NAME", "Northwind Goods")
    return {
        "SECRET_KEY": _secret_key(),
        "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        "DATABASE_URL": os.environ.get("DATABASE_URL"),
        "SHOP_NAME": shop,
        "SYSTEM_PROMPT": system_prompt(shop),
        "MAX_MESSAGE_CHARS": int(os.environ.get("MAX_MESSAGE_CHARS", "4000")),
        "QUEUE_LIMIT": int(os.environ.get("QUEUE_LIMIT", "200")),
        "MAX_NEW_TOKENS": int(os.environ.get("MAX_NEW_TOKENS", "256")),
        "TEMPERATURE": float(os.environ.get("TEMPERATURE", "0.7")),
        "TOP_P": float(os.environ.get("TOP_P", "0.9")),
    }
