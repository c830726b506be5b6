"""The customer chat: the page, and the Socket.IO events that queue messages and cancel answers."""

from __future__ import annotations

import re
import time
import uuid

from flask import Blueprint, current_app, render_template, request, session
from flask_socketio import ConnectionRefusedError, join_room

from messaging import chat_tools, grounding
from messaging.generation import Generation, GenerationError
from models import ROLES, Conversation, Message, RequestRecord, new_conversation_id

from . import limits, queue
from .sockets import reply, socketio
from .metrics import CHAT_OUTCOMES_KEY, CONNECTION_OUTCOMES_KEY, count
from .queue import UserError
from .security import clean_text

bp = Blueprint("chat", __name__)

# Conversation and request ids are uuid4 hex; anything else is not looked up at all.
ID = re.compile(r"^[0-9a-f]{32}$")
MESSAGE_FIELDS = ("text", "conversation_id", "max_new_tokens")
# Pages and JSON that hold a customer's conversation: never kept by a shared cache or the back button.
PRIVATE = {"Cache-Control": "no-store"}

# Request ids in flight per socket, so a closed tab cancels its answers.
_in_flight: dict[str, set[str]] = {}


def owner_id() -> str:
    if "owner" not in session:
        session["owner"] = uuid.uuid4().hex
    return session["owner"]


def own_conversation(db, conversation_id: object) -> Conversation:
    """The caller's conversation; someone else's reads exactly like one that does not exist."""
    valid = isinstance(conversation_id, str) and ID.match(conversation_id)
    conv = db.get(Conversation, conversation_id) if valid else None
    if conv is None or conv.owner != owner_id():
        raise UserError("unknown_conversation", "This conversation does not exist or is not yours; "
                                                "start a new conversation.")
    return conv


@bp.get("/")
def page():
    history, conversation_id = [], request.args.get("c")
    if conversation_id:
        with current_app.extensions["db"]() as db:
            try:
                conv = own_conversation(db, conversation_id)
                history = [{"role": m.role, "content": m.content} for m in conv.messages if m.role in ROLES]
            except UserError:
                conversation_id = None
    owner_id()
    return render_template("chat.html", conversation_id=conversation_id, history=history,
                           shop_name=current_app.config["SHOP_NAME"]), PRIVATE


def chat_generation(payload: dict) -> Generation:
    """How to answer a chat message: the shop's sampling, served as interactive; `max_new_tokens` may ask for a
    shorter answer (load tests, embedded widgets), the shop's limit being the ceiling."""
    cfg = current_app.config
    limit = cfg["MAX_NEW_TOKENS"]
    generation = Generation(max_new_tokens=payload.get("max_new_tokens", limit), temperature=cfg["TEMPERATURE"],
                            top_p=cfg["TOP_P"], service_class=queue.served_class("interactive"), **cfg["CHAT_DRY"])
    try:
        generation.check(max_tokens=limit)
    except GenerationError as exc:
        raise UserError("invalid_value", f"max_new_tokens must be a whole number from 1 to {limit}; omit it for "
                                         "the default." if exc.field == "max_new_tokens" else exc.message) from None
    return generation


def validate_message(payload: object) -> tuple[str, str | None]:
    """The message's text, cleaned of control characters, and its conversation id; or a UserError."""
    if not isinstance(payload, dict):
        raise UserError("bad_request", "Send an object like {\"text\": \"...\", \"conversation_id\": \"...\"}.")
    unknown = sorted(str(k) for k in payload if k not in MESSAGE_FIELDS)
    if unknown:
        raise UserError("unknown_field", f"Unknown field {', '.join(map(repr, unknown))[:200]}; a message has only "
                                         f"{', '.join(MESSAGE_FIELDS)}.")
    text, conversation_id = payload.get("text"), payload.get("conversation_id")
    if text is not None and not isinstance(text, str):
        raise UserError("empty_message", "'text' must be a string: type a message before sending.")
    limit = current_app.config["MAX_MESSAGE_CHARS"]
    if text is not None and len(text) > limit:
        raise UserError("message_too_long", f"Messages can be at most {limit} characters; "
                                            f"this one has {len(text)}. Shorten it or split it.")
    text = clean_text(text or "").strip()
    if not text:
        raise UserError("empty_message", "Type a message before sending.")
    if conversation_id is not None and not isinstance(conversation_id, str):
        raise UserError("bad_request", "conversation_id must be a string; omit it to start a new conversation.")
    return text, conversation_id


def emit_error(exc: UserError, request_id: str | None = None) -> None:
    body = {"code": exc.code, "message": exc.message, "retryable": exc.retryable}
    if request_id is not None:
        body["request_id"] = request_id
    if exc.retry_after:
        body["retry_after"] = exc.retry_after
    reply("error", body)


@socketio.on("connect")
def on_connect(auth=None):
    owner_id()
    counter = current_app.extensions["limits"].connections
    if not counter.acquire(limits.client_address(), request.sid):
        count(CONNECTION_OUTCOMES_KEY, "too_many_connections")
        message = (f"Too many open chat connections from your address (at most {counter.limit}); "
                   "close other chat tabs and try again.")
        raise ConnectionRefusedError(message, {"code": "too_many_connections", "message": message,
                                               "retryable": True})
    count(CONNECTION_OUTCOMES_KEY, "accepted")
    _in_flight[request.sid] = set()


@socketio.on("disconnect")
def on_disconnect(*_):
    current_app.extensions["limits"].connections.release(request.sid)
    for request_id in _in_flight.pop(request.sid, set()):
        queue.cancel(request_id)


@socketio.on("join")
def on_join(payload=None):
    """Re-attach a reloaded page to its conversation's room, so answers still streaming reach it."""
    try:
        conversation_id = payload.get("conversation_id") if isinstance(payload, dict) else None
        with current_app.extensions["db"]() as db:
            own_conversation(db, conversation_id)
        join_room(conversation_id)
    except UserError as exc:
        emit_error(exc)


@socketio.on("chat_message")
def on_chat_message(payload=None):
    # Taken first: concurrent messages wait on the database in no fair order, but are answered in this one.
    received_at = time.time()
    with queue.intake():
        take_message(payload, received_at)


def take_message(payload: object, received_at: float) -> None:
    try:
        # Counted before anything else, so a flood of malformed messages is throttled too.
        limits.limit_message(owner_id())
        text, conversation_id = validate_message(payload)
        generation = chat_generation(payload)
        queue.check_room(generation.service_class)   # the chat page is interactive
        job = store_chat(text, conversation_id, generation, received_at)
    except UserError as exc:
        count(CHAT_OUTCOMES_KEY, exc.code)
        emit_error(exc)
        return
    # Joined and told before the job is queued, so even a fast worker's first token finds the client ready.
    join_room(job["conversation_id"])
    reply("accepted", {"request_id": job["request_id"], "conversation_id": job["conversation_id"]})
    try:
        queue.send(job)
    except UserError as exc:
        count(CHAT_OUTCOMES_KEY, exc.code)
        emit_error(exc, job["request_id"])
        return
    count(CHAT_OUTCOMES_KEY, "accepted")
    _in_flight.setdefault(request.sid, set()).add(job["request_id"])


def store_chat(text: str, conversation_id: str | None, generation: Generation,
               received_at: float | None = None) -> dict:
    """Store the message and its request record; the job to queue comes back."""
    cfg = current_app.config
    with current_app.extensions["db"]() as db:
        # Every read comes before the first write: on SQLite a writer holds the file's one write lock from
        # its first INSERT to its commit, and a burst of messages queues for it one after another.
        if conversation_id:
            conv = own_conversation(db, conversation_id)
            history = chat_tools.history([(m.role, m.content) for m in conv.messages], bool(cfg["CHAT_TOOLS"]))
        else:
            conv, history = Conversation(id=new_conversation_id(), owner=owner_id()), []
            db.add(conv)
        job = queue.new_job([{"role": "system", "content": cfg["SYSTEM_PROMPT"]}, *history,
                             {"role": "user", "content": text}],
                            generation, source="chat", conversation_id=conv.id, received_at=received_at)
        if cfg["CHAT_TOOLS"]:   # the worker runs these tools itself and answers with their results
            job.update(tools=cfg["CHAT_TOOLS"], tool_choice=cfg["CHAT_TOOL_CHOICE"])
        if cfg["CHAT_GROUNDING"]:   # the worker looks up the orders and articles the message names first
            job[grounding.JOB_FIELD] = cfg["CHAT_GROUNDING"]
        db.add(Message(conversation_id=conv.id, role="user", content=text))
        db.add(queue.record_for(job))
        db.commit()
    return job


@socketio.on("cancel")
def on_cancel(payload=None):
    request_id = payload.get("request_id") if isinstance(payload, dict) else None
    with current_app.extensions["db"]() as db:
        valid = isinstance(request_id, str) and ID.match(request_id)
        record = db.get(RequestRecord, request_id) if valid else None
        owned = record is not None and record.conversation_id is not None
        if owned:
            try:
                own_conversation(db, record.conversation_id)
            except UserError:
                owned = False
    if not owned:
        echo = request_id if isinstance(request_id, str) and len(request_id) <= 64 else None
        reply("error", {"request_id": echo, "code": "unknown_request",
                        "retryable": False, "message": "There is no answer of yours with that id to stop."})
        return
    queue.cancel(request_id)


@bp.get("/conversations/<conversation_id>")
def conversation_json(conversation_id: str):
    with current_app.extensions["db"]() as db:
        try:
            conv = own_conversation(db, conversation_id)
        except UserError as exc:
            return {"error": {"code": exc.code, "message": exc.message}}, 404, PRIVATE
        # Request ids and the answers still under way let a reconnecting page settle what it missed.
        unfinished = [r.request_id for r in db.query(RequestRecord.request_id)
                      .filter_by(conversation_id=conv.id, finished_at=None).order_by(RequestRecord.enqueued_at)]
        return {"id": conv.id, "unfinished": unfinished,
                "messages": [{"role": m.role, "content": m.content, "request_id": m.request_id}
                             for m in conv.messages if m.role in ROLES]}, 200, PRIVATE
