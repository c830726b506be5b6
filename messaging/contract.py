"""The queue contract between the web app and the workers: task and queue names, Redis keys and channels."""

from __future__ import annotations

QUEUE = "generate"                              # the Celery queue of standard requests (the API's default)
# One Celery queue per service class, most urgent first: workers take from them in this order (messaging/queue.py),
# so an interactive request never waits in Redis behind a standard or bulk one.
CLASS_QUEUES = {"interactive": "generate.interactive", "standard": QUEUE, "bulk": "generate.bulk"}
QUEUES = tuple(CLASS_QUEUES.values())
DEFAULT_CLASS = "standard"
GENERATE_TASK = "supportbot.generate"
CANCEL_CHANNEL = "supportbot:cancel"            # web -> worker: abort this request id
HEARTBEAT_PREFIX = "supportbot:workers:"        # worker -> web: a key per live worker, short TTL
# worker -> web: the set of worker names, added to with each heartbeat, so readers look up each worker's keys
# rather than scan the keyspace (messaging/workers.py)
WORKER_NAMES_KEY = "supportbot:worker-names"
# worker -> web: one hash of every worker's model, {worker name: {"model", "time"}}, refreshed with the heartbeat,
# so /v1/models reads one key instead of scanning the keyspace; an entry older than MODEL_ENTRY_TTL_S is a gone
# worker's.
MODELS_KEY = "supportbot:models"
MODEL_ENTRY_TTL_S = 10
METRICS_PREFIX = "supportbot:metrics:"          # + worker name: that worker's latest Prometheus exposition text
SOCKETIO_CHANNEL = "flask-socketio"             # Flask-SocketIO's message queue channel, shared by every web process
# worker -> every web process: batches of answer events (text deltas, ends) for any number of requests;
# messaging/stream.py says what a batch holds.
STREAM_CHANNEL = "supportbot:stream"
FINAL_TTL_S = 3600
# An API request's final event larger than this is not broadcast on STREAM_CHANNEL (every web process would take
# it, and Redis drops a subscriber whose unread messages pass its pub/sub buffer limit, 32 MB by default, and
# with it every stream on that connection): the stream carries {request_id, stored: true} instead, and the web
# process that waits for the request reads the event from final_key. n=8 choices of 4096 tokens with 20
# alternatives each make about 40 MB.
INLINE_FINAL_BYTES = 256 * 1024
JOB_TTL_S = 86400                               # a queued request's copy outlives any wait in the queue
STREAMED_TTL_S = 3600


def queue_for(service_class: str | None) -> str:
    """The queue of a request's class; a job without one (an older web process's) is standard."""
    return CLASS_QUEUES[service_class or DEFAULT_CLASS]


def cancelled_key(request_id: str) -> str:
    """Set when a request is cancelled, so a worker that has not started it yet skips it."""
    return f"supportbot:cancelled:{request_id}"


def events_channel(request_id: str) -> str:
    """Names an API request's events in its job (`channel`): a job that has one is awaited by an HTTP client,
    and its events on STREAM_CHANNEL say so."""
    return f"supportbot:events:{request_id}"


def final_key(request_id: str) -> str:
    """The last event of an API request, kept a while for a listener that was away when it was published."""
    return f"supportbot:final:{request_id}"


def job_key(request_id: str) -> str:
    """A copy of a queued request, kept until it is answered, so a message lost in transit can be sent again."""
    return f"supportbot:job:{request_id}"


def _choice(index: int) -> str:
    return f":{index}" if index else ""


def streamed_key(request_id: str, index: int = 0) -> str:
    """How many characters of a request's answer (of its choice `index`) its clients were sent: a redelivery
    resumes after them."""
    return f"supportbot:streamed:{request_id}{_choice(index)}"


def shown_key(request_id: str, index: int = 0) -> str:
    """What clients were sent of a request's answer (of its choice `index`), as a list of pieces
    (worker/continuation.py) beside its count in streamed_key: a redelivery goes on from those tokens. Deleted with
    the answer's end."""
    return f"supportbot:shown:{request_id}{_choice(index)}"


def shown_at_key(request_id: str) -> str:
    """When clients were first sent text of a request's answer (seconds since the epoch): a redelivered answer's
    time to first token is the one its customer saw. Deleted with the answer's end."""
    return f"supportbot:shown_at:{request_id}"


def admitted_at_key(request_id: str) -> str:
    """When an engine first admitted a request whose answer clients were sent text of (seconds since the epoch): a
    redelivered answer's queue wait is the one its customer had. Deleted with the answer's end."""
    return f"supportbot:admitted_at:{request_id}"


def snapshot_key(worker: str) -> str:
    """A worker's latest metrics exposition."""
    return METRICS_PREFIX + worker
