"""WSGI entry for production servers: `gunicorn -w 1 --threads 100 -b 0.0.0.0:5000 webapp.wsgi:app`."""

from webapp import create_app

app = create_app()
