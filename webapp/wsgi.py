"""WSGI entry for gunicorn: `gunicorn -c webapp/gunicorn.conf.py` (what `python -m webapp` runs)."""

import logging
import os
import sys

from webapp import create_app

# The app's own lines (webapp, messaging) go to stderr beside gunicorn's, at WEB_LOG_LEVEL (info by default); other
# libraries keep Python's default (warnings and worse).
_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter("[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s"))
for _name in ("webapp", "messaging"):
    logging.getLogger(_name).addHandler(_handler)
    logging.getLogger(_name).setLevel(os.environ.get("WEB_LOG_LEVEL", "info").upper())
    logging.getLogger(_name).propagate = False

app = create_app()
# Listen to the workers' answers from the start, not only from the first Socket.IO connection.
app.extensions["stream"].start()
