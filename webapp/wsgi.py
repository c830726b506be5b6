"""WSGI entry for gunicorn: `gunicorn -c webapp/gunicorn.conf.py` (what `python -m webapp` runs)."""

from webapp import create_app

app = create_app()
# Listen to the workers' answers from the start, not only from the first Socket.IO connection.
app.extensions["stream"].start()
