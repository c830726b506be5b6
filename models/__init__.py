"""SQLAlchemy models shared by the web app and the worker: conversations, messages, latency records."""
