"""The chat assistant's tool rounds: look up what the customer's message names (worker/grounding.py); generate; run
the tools it calls here, against the shop's data; feed their results back; answer. Only the text meant for the
customer streams out; the whole exchange is stored (worker/job.py)."""

from __future__ import annotations

import json
import logging
import queue
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache
from typing import Any

from messaging.chat_tools import CALL_ROLE, LOOKUP_ORDER, RESULT_ROLE, stored_call
from messaging.grounding import JOB_FIELD, Grounding
from messaging.jobs import service_class
from structured import Structure, StreamParser, Tool, ToolCall
from structured.tools import Delta, forced
from worker import continuation, order_tool
from worker.continuation import Shown
from worker.grounding import Grounded, ground
from worker.engine import Event, RequestFinished, SamplingParams, TokenDelta
from worker.prompts import fit_to_context
from worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)

# Generations per message that may end in tool calls; the one after the last of them answers whatever it writes.
MAX_TOOL_ROUNDS = 2
# A forced call is never shown to the customer, so the chat's answer cap does not bind it; this does.
CALL_TOKENS = 128
# After a lead, the model's line ends the answer: past it, a small model wanders (more dates, tool syntax copied
# from its prompt; bench.answers).
LEAD_STOPS = ("\n", "<tool")
# ...and so does its first sentence, at most LEAD_TOKENS long: the default model mostly ends right after the lead,
# and where it goes on, a second sentence was more invention than the first (a 255-token "...the magic box that has
# been made for you to have magic..." after a broken mug's policy; an invented phone "number" after a not-found
# order). The sentence's own mark is written back after the stop (stop strings are left out of the text).
SENTENCE_ENDS = (". ", "! ", "? ")
LEAD_TOKENS = 64
# After a lead, no token that writes a digit (OpenAI's -100, a ban): the lead states every figure the lookups
# returned, and a number the model wrote after it would be its own invention (bench.answers: dates such as
# "2026-20-24" after an order's status).
NO_NUMBER_BIAS = -100.0
# The tools this worker runs itself: name -> (session, arguments) -> result.
EXECUTORS: dict[str, Callable[[Any, dict[str, Any]], dict[str, Any]]] = {LOOKUP_ORDER: order_tool.lookup_order}


@lru_cache(maxsize=4)
def digit_tokens(tokenizer) -> frozenset[int]:
    """The vocabulary's tokens that write an ASCII digit (SmolLM2 and Qwen spell numbers a digit a token; others
    have tokens of two or three digits, or digits inside words). Byte-level and SentencePiece vocabularies spell
    ASCII digits as themselves; their stand-ins for other bytes (such as "²" for 0xB2) are no digits."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return frozenset(i for i, piece in enumerate(pieces) if piece and any("0" <= c <= "9" for c in piece))


def without_numbers(params: SamplingParams, tokenizer) -> SamplingParams:
    """`params` with every digit token banned, whatever the request's own logit bias says of them."""
    bias = {token: NO_NUMBER_BIAS for token in digit_tokens(tokenizer)}
    return replace(params, logit_bias={**(params.logit_bias or {}), **bias})


def serves(job: dict) -> bool:
    """A chat message whose assistant has tools or grounded answers: this module answers it (an API request's tools
    go back to its client instead)."""
    return job.get("source") == "chat" and (bool(job.get("tools")) or bool(job.get(JOB_FIELD)))


def grounding(job: dict) -> Grounding | None:
    """The job's grounding settings; TypeError for a job that carries them wrong."""
    return Grounding.from_job(job.get(JOB_FIELD))


def look_up(rt: WorkerRuntime, job: dict, settings: Grounding) -> Grounded:
    """The lookups the customer's newest message calls for, read from SQL (waiting out a database briefly away)."""
    def read() -> Grounded:
        with rt.sessions() as db:
            return ground(db, job["messages"], settings)
    return rt.sql_retrying(read, "looking up the orders and articles a message names")


def first_structure(tools: list[Tool], choice: str) -> Structure | None:
    """The grammar of the first generation: none for `auto`, any one call for `required`, or a named tool's call."""
    if choice == "auto":
        return None
    return forced(tools, None if choice == "required" else choice, parallel=False)


class Relay:
    """Hands the customer's part of each generation to the publisher, as if it came from the engine under the
    request's id; the calls stay here."""

    def __init__(self, outbox: queue.Queue[list[Event]], request_id: str) -> None:
        self.outbox, self.request_id = outbox, request_id
        self.parts: list[str] = []
        # When the engine first admitted a generation of this exchange (one whose text the customer may never see,
        # a tool call's, included): the next delta sent carries it, as the engine's first delta does.
        self.admitted: float | None = None
        self.unsent_admission = False

    def admit(self, admitted_time: float | None) -> None:
        if admitted_time is not None and self.admitted is None:
            self.admitted, self.unsent_admission = admitted_time, True

    def send(self, deltas: list[Delta], text: str = "", tokens: list[int] | None = None) -> bool:
        """Send what a tool parser let through of the model's `text` (written by `tokens`): with those tokens where
        it is the whole text, else with none known."""
        content = "".join(d.content for d in deltas if d.content)
        return self.show(content, tokens if content == text and tokens else [])

    def show(self, text: str, tokens: list[int]) -> bool:
        """Send the model's `text`, written by `tokens` (empty: not known)."""
        if text or tokens:
            self.parts.append(text)
            admitted = self.admitted if self.unsent_admission else None
            self.unsent_admission = False
            self.outbox.put([TokenDelta(self.request_id, text, list(tokens), admitted_time=admitted)])
        return bool(text)

    def write(self, text: str) -> None:
        """Send text the worker wrote itself (a grounded answer's lead)."""
        self.parts.append(text)
        self.outbox.put([continuation.Written(self.request_id, text, [])])

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def end(self, done: RequestFinished) -> None:
        self.outbox.put([done])


def converse(rt: WorkerRuntime, job: dict, tools: list[Tool], base: SamplingParams, first: Structure | None,
             relay: Relay, was_cancelled: Callable[[], bool], grounded: Grounded | None = None,
             lead: bool = False, shown: Shown | None = None) -> RequestFinished:
    """Generate until an answer calls no tool (at most MAX_TOOL_ROUNDS rounds of calls); the calls and results go
    in `job["tool_messages"]` for the answer's record, and one RequestFinished sums the generations. A cancel
    found between rounds (`was_cancelled`) ends it. The lookups in `grounded` come first; with `lead`, the first
    answer the customer sees starts with their sentence. `shown`: what an earlier delivery showed the customer; the
    first generation that may write to the customer goes on from it, its lead as it was shown."""
    rid, messages, specs = job["request_id"], list(job["messages"]), job.get("tools") or []
    offered = {t.name for t in tools}
    rounds: list[RequestFinished] = []
    visible_from: RequestFinished | None = None   # the first generation whose text the customer saw
    exchange: list[tuple[str, str]] = []
    if grounded is not None:
        messages, exchange = grounded.messages(messages), grounded.stored()
    lead_text = grounded.lead if grounded is not None and lead else ""
    cancelled = False
    for n in range(MAX_TOOL_ROUNDS + 1):
        if n and was_cancelled():   # stopped while a tool ran
            cancelled = True
            break
        structure = first if n == 0 else None
        params = replace(base, structure=structure,
                         max_new_tokens=max(base.max_new_tokens, CALL_TOKENS) if structure else base.max_new_tokens)
        reserve = min(params.max_new_tokens, rt.engine.max_model_len // 4)
        # The answer starts with the facts; the model goes on from there.
        opening = lead_text + " " if lead_text and structure is None else ""
        continued = None
        if shown is not None and structure is None:   # as it was shown: its lead, then the model's tokens
            shown_lead, written = shown.split_lead()
            continued = written.tokens(rt.engine.tokenizer, params.skip_special_tokens)
            if continued is not None:
                opening, shown = shown_lead, None
        lead_ids = rt.engine.tokenizer(opening, add_special_tokens=False)["input_ids"] if opening else []
        _, ids = fit_to_context(rt.engine, messages, reserve + len(lead_ids), tools=specs)
        if opening:
            relay.write(opening)
            ids, lead_text = ids + lead_ids, ""
            params = without_numbers(replace(params, stop=(*params.stop, *LEAD_STOPS, *SENTENCE_ENDS),
                                             max_new_tokens=min(params.max_new_tokens, LEAD_TOKENS)),
                                     rt.engine.tokenizer)
        # The request's own id, one generation at a time, so a cancel reaches whichever is running.
        stream = continuation.submit(rt.engine, rid, ids, [continued] if continued else None, params=params,
                                     arrival_time=job.get("enqueued_at"), service_class=service_class(job))
        parser, seen = StreamParser(f"{rid}:{n}"), False
        last: RequestFinished | None = None
        for event in stream:
            if isinstance(event, TokenDelta):
                relay.admit(event.admitted_time)
                # Without tools nothing the model writes is a call: its text goes to the customer as it is.
                seen |= relay.send(parser.feed(event.text), event.text, event.token_ids) if tools \
                    else relay.show(event.text, event.token_ids)
            elif isinstance(event, RequestFinished):
                last = event
        if tools:
            seen |= relay.send(parser.finish())
        if opening and last.stop_reason in SENTENCE_ENDS:   # the model's sentence keeps its full stop
            relay.write(last.stop_reason.rstrip())
        rounds.append(last)
        if seen and visible_from is None:
            visible_from = last
        calls = list(parser.calls)
        if last.finish_reason != "stop" or not calls or n == MAX_TOOL_ROUNDS:
            break
        results = [execute(rt, call, offered) for call in calls]
        messages.append({"role": "assistant", "content": None, "tool_calls": [c.to_openai() for c in calls]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, results)]
        exchange += [(CALL_ROLE, stored_call(c.id, c.name, c.arguments)) for c in calls]
        exchange += [(RESULT_ROLE, r) for r in results]
    job["tool_messages"] = exchange
    return combined(rid, rounds, relay.text, visible_from, "cancelled" if cancelled else None)


def execute(rt: WorkerRuntime, call: ToolCall, offered: set[str]) -> str:
    """A call's result as JSON text for the model: a clear error for a tool or arguments it got wrong."""
    executor = EXECUTORS.get(call.name) if call.name in offered else None
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        arguments = None
    if executor is None:
        result = {"error": "unknown tool", "message": f"There is no tool {call.name!r}; use one of "
                                                      f"{', '.join(sorted(offered))}."}
    elif not isinstance(arguments, dict):
        result = {"error": "invalid arguments", "message": "The arguments must be a JSON object."}
    else:
        def read() -> dict[str, Any]:
            with rt.sessions() as db:
                return executor(db, arguments)
        result = rt.sql_retrying(read, f"running the tool {call.name}")
    log.debug("tool %s(%s) -> %s", call.name, call.arguments, result)
    return json.dumps(result, ensure_ascii=False, separators=(",", ":"))


def combined(rid: str, rounds: list[RequestFinished], text: str, visible_from: RequestFinished | None,
             finish_reason: str | None) -> RequestFinished:
    """One end for the whole exchange: every generation's tokens, the customer's text, the first token they saw."""
    first, last = rounds[0], rounds[-1]
    weights = [max(1, r.completion_tokens) for r in rounds]
    return RequestFinished(
        request_id=rid, text=text, token_ids=[t for r in rounds for t in r.token_ids],
        finish_reason=finish_reason or last.finish_reason,
        prompt_tokens=sum(r.prompt_tokens for r in rounds), completion_tokens=sum(r.completion_tokens for r in rounds),
        cached_tokens=sum(r.cached_tokens for r in rounds), arrival_time=first.arrival_time,
        admitted_time=first.admitted_time, first_token_time=(visible_from or last).first_token_time,
        finished_time=last.finished_time, preemptions=sum(r.preemptions for r in rounds), error=last.error,
        continued_tokens=sum(r.continued_tokens for r in rounds),
        mean_batch_size=sum(r.mean_batch_size * w for r, w in zip(rounds, weights)) / sum(weights))
