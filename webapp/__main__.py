"""Serve the web app: `python -m webapp` (HOST, PORT from the environment)."""

from __future__ import annotations

import os

from . import create_app, socketio


def main() -> None:
    app = create_app()
    socketio.run(app, host=os.environ.get("HOST", "127.0.0.1"), port=int(os.environ.get("PORT", "5000")),
                 allow_unsafe_werkzeug=True, log_output=False)


if __name__ == "__main__":
    main()
