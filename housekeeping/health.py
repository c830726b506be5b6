"""`python -m housekeeping.health`: exit 0 while some housekeeping process holds a live lease (the health check)."""

from __future__ import annotations

import sys
import time

from sqlalchemy import select

from models import JobState
from models.db import make_engine

from .lease import HOUSEKEEPING


def main() -> int:
    engine = make_engine()
    try:
        with engine.connect() as conn:
            until = conn.execute(select(JobState.lease_until).where(JobState.name == HOUSEKEEPING)).scalar()
    finally:
        engine.dispose()
    return 0 if until is not None and until > time.time() else 1


if __name__ == "__main__":
    sys.exit(main())
