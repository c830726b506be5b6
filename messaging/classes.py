"""Service classes' objectives and limits: time to first token per class and each class's share of the queue."""

from __future__ import annotations

import os

from messaging.contract import CLASS_QUEUES

CLASSES = tuple(CLASS_QUEUES)   # most urgent first: interactive, standard, bulk
# Seconds from acceptance to the first token that a request of the class should meet (TTFT_OBJECTIVE_<CLASS>_S).
DEFAULT_TTFT_OBJECTIVE_S = {"interactive": 1.0, "standard": 5.0, "bulk": 60.0}
# A class is refused once everything queued reaches this share of QUEUE_LIMIT (QUEUE_SHARE_<CLASS>): bulk first,
# then standard, so the rest of the queue stays free for interactive requests.
DEFAULT_QUEUE_SHARE = {"interactive": 1.0, "standard": 0.9, "bulk": 0.75}
# Seconds a refused client is told to wait before it tries again (Retry-After), per class.
RETRY_AFTER_S = {"interactive": 2, "standard": 5, "bulk": 10}


def _per_class(prefix: str, suffix: str, defaults: dict[str, float], low: float, high: float) -> dict[str, float]:
    out = {}
    for name, default in defaults.items():
        var = f"{prefix}{name.upper()}{suffix}"
        raw = os.environ.get(var, "").strip()
        try:
            value = float(raw) if raw else default
        except ValueError:
            raise ValueError(f"{var} must be a number from {low:g} to {high:g}; got {raw!r}.") from None
        if not low < value <= high:
            raise ValueError(f"{var} must be a number above {low:g} and at most {high:g}; got {raw!r}.")
        out[name] = value
    return out


def ttft_objectives() -> dict[str, float]:
    """Each class's time-to-first-token objective in seconds, from TTFT_OBJECTIVE_<CLASS>_S or the defaults."""
    return _per_class("TTFT_OBJECTIVE_", "_S", DEFAULT_TTFT_OBJECTIVE_S, 0, 86400)


def queue_shares() -> dict[str, float]:
    """Each class's share of the queue limit, from QUEUE_SHARE_<CLASS> or the defaults; interactive keeps all."""
    shares = _per_class("QUEUE_SHARE_", "", DEFAULT_QUEUE_SHARE, 0, 1)
    shares["interactive"] = 1.0
    return shares
