"""The Socket.IO server every web process shares, and how a handler answers the connection it serves."""

from __future__ import annotations

from flask_socketio import SocketIO, emit

socketio = SocketIO()

# Large enough that an oversized chat message reaches the handler and gets a clear `message_too_long`
# error (MAX_MESSAGE_CHARS is far smaller); anything bigger still closes the connection.
SOCKET_BUFFER_BYTES = 1536 * 1024


def reply(event: str, body: dict) -> None:
    """An event for the connection whose event is being handled. That connection is always on this process, so
    it goes straight to its socket: through the Redis message queue it would cost a publish per message, a
    delivery to every web process, and, with Redis away, a wait before the customer hears why."""
    emit(event, body, ignore_queue=True)


def async_mode() -> str:
    """`gevent` under the production server (gunicorn's gevent worker patches the standard library first): every
    connection a greenlet. `threading` otherwise, for the app built inside tests and tools."""
    try:
        from gevent import monkey
    except ImportError:
        return "threading"
    return "gevent" if monkey.is_module_patched("socket") else "threading"
