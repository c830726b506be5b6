"""The SQL the summaries need that SQLite and PostgreSQL spell differently: epoch seconds and latencies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spelling:
    dialect: str

    def seconds(self, col: str) -> str:
        """Whole epoch seconds of a timestamp column."""
        if self.dialect == "sqlite":
            # Stored as 'YYYY-MM-DD HH:MM:SS.ffffff' in UTC. The fraction is cut off first: strftime works in
            # whole milliseconds and would round 59.9996 up into the next second (and minute).
            return f"CAST(strftime('%s', substr({col}, 1, 19)) AS INTEGER)"
        return f"CAST(floor(extract(epoch FROM {col})) AS BIGINT)"

    def between(self, start: str, end: str) -> str:
        """Seconds from `start` to `end` as a float, to the microsecond."""
        if self.dialect == "sqlite":
            def epoch(col: str) -> str:
                return f"(CAST(strftime('%s', substr({col}, 1, 19)) AS REAL) + CAST(substr({col}, 20) AS REAL))"
            return f"({epoch(end)} - {epoch(start)})"
        return f"CAST(extract(epoch FROM ({end} - {start})) AS DOUBLE PRECISION)"

    def latency(self, name: str) -> tuple[str, str]:
        """(expression, condition under which it is defined) with RequestRecord's own definitions."""
        if name == "queue_wait":
            return self.between("enqueued_at", "admitted_at"), "admitted_at IS NOT NULL"
        if name == "ttft":
            return self.between("enqueued_at", "first_token_at"), "first_token_at IS NOT NULL"
        if name == "tpot":
            return (f"{self.between('first_token_at', 'finished_at')} / (completion_tokens - 1)",
                    "first_token_at IS NOT NULL AND completion_tokens >= 2")
        if name == "e2e":
            return self.between("enqueued_at", "finished_at"), "finished_at IS NOT NULL"
        raise ValueError(name)
