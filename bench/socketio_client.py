"""A python-socketio client that handles a connection's events one at a time, in the order they arrive."""

from __future__ import annotations

import engineio
import socketio


class _InOrderEngineIO(engineio.Client):
    def _trigger_event(self, event, *args, **kwargs):
        if event == "message":   # engineio's client starts a thread for each message
            kwargs["run_async"] = False
        return super()._trigger_event(event, *args, **kwargs)


class InOrderClient(socketio.Client):
    """socketio.Client whose handlers see a connection's events in the order the server sent them, as a browser's
    do. The stock client hands each message to a new thread, so two events that arrive together can reach their
    handlers swapped: two text deltas, or `done` before the last delta. Handlers run on the reading thread, so
    they must not wait on this connection (no `call`)."""

    def _engineio_client_class(self):
        return _InOrderEngineIO
