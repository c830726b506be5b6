"""Serve the web app: `python -m webapp` runs gunicorn's gevent worker on HOST:PORT (webapp/gunicorn.conf.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

CONF = Path(__file__).resolve().parent / "gunicorn.conf.py"


def argv() -> list[str]:
    return [sys.executable, "-m", "gunicorn", "-c", str(CONF)]


def main() -> None:
    # Replaced by gunicorn, so this process's id is the server's (a supervisor's SIGTERM reaches it), and the
    # worker starts from a fresh interpreter that gevent patches before anything of the web app is loaded.
    sys.stdout.flush()
    os.execv(sys.executable, argv())


if __name__ == "__main__":
    main()
