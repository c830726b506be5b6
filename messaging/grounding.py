"""Grounded chat answers, as both tiers see them: the settings a chat job carries (CHAT_GROUNDING,
ORDER_NUMBER_PATTERN, SUPPORT_CONTACT) and what a customer's message names (order numbers, e-mail addresses)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

# The job's field: the grounding settings as a dict (absent or None: no grounding).
JOB_FIELD = "grounding"
# `lead`: the facts are looked up, recorded as tool calls, and the answer starts with them in a fixed sentence the
# model continues; `facts`: looked up and recorded, and the model writes the whole answer; `off`: nothing.
MODES = ("lead", "facts", "off")
DEFAULT_ORDER_PATTERN = r"NW-\d{3,10}"
DEFAULT_CONTACT = "e-mail support@northwind.example or call +1 555 0100 (Monday to Friday, 9:00-17:00)"
EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,24}")


@dataclass(frozen=True)
class Grounding:
    mode: str = "lead"
    order_pattern: str = DEFAULT_ORDER_PATTERN
    contact: str = DEFAULT_CONTACT

    def to_job(self) -> dict | None:
        return None if self.mode == "off" else asdict(self)

    @classmethod
    def from_job(cls, value: dict | None) -> Grounding | None:
        return cls(**value) if value else None


def settings(mode: str | None, pattern: str | None, contact: str | None) -> Grounding:
    """The grounding settings from their environment values (unset: the defaults); ValueError says what to fix."""
    mode = (mode or "lead").strip().lower()
    if mode in ("0", "false", "no", "none"):
        mode = "off"
    if mode not in MODES:
        raise ValueError(f"CHAT_GROUNDING must be one of {', '.join(MODES)}; got {mode!r}.")
    pattern = (pattern or DEFAULT_ORDER_PATTERN).strip()
    try:
        compiled = re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"ORDER_NUMBER_PATTERN is not a regular expression ({exc}): {pattern!r}.") from None
    if compiled.match(""):
        raise ValueError(f"ORDER_NUMBER_PATTERN matches an empty string; it must match order numbers such as "
                         f"NW-10042: {pattern!r}.")
    return Grounding(mode, pattern, (contact or DEFAULT_CONTACT).strip())


def order_numbers(text: str, pattern: str) -> list[str]:
    """The order numbers a message names (whole words matching the shop's pattern, any case), upper-cased, in
    order, each once."""
    found = re.finditer(rf"(?<![A-Za-z0-9])(?:{pattern})(?![A-Za-z0-9])", text, re.IGNORECASE)
    return list(dict.fromkeys(m.group(0).upper() for m in found))


def emails(text: str) -> list[str]:
    """The e-mail addresses a message names, lower-cased, in order, each once."""
    return list(dict.fromkeys(m.group(0).lower() for m in EMAIL.finditer(text)))
