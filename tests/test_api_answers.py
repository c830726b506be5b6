"""The API's answer shapes from the worker's events, without a stack: what a stream sends, and when."""

from __future__ import annotations

import json

from webapp.api_answers import Shape, completion, completion_stream

JOB = {"request_id": "r1", "enqueued_at": 1700000000.0}
PROMPT = {"text": "Where is", "logprobs": [
    {"token": "Where", "logprob": None, "top_logprobs": None, "bytes": []},
    {"token": " is", "logprob": -1.5, "top_logprobs": [{"token": " is", "logprob": -1.5, "bytes": []}], "bytes": []}]}


def token(text: str, offset: int, index: int = 0, **extra) -> dict:
    entry = {"token": text, "logprob": -0.5, "top_logprobs": [{"token": text, "logprob": -0.5, "bytes": []}],
             "bytes": []}
    return {"event": "token", "request_id": "r1", "text": text, "offset": offset, "logprobs": [entry],
            **({"index": index} if index else {}), **extra}


DONE = {"event": "done", "request_id": "r1", "prompt_tokens": 2, "completion_tokens": 4, "prompt": PROMPT,
        "choices": [{"index": 0, "text": " my parcel", "finish_reason": "length", "completion_tokens": 2,
                     "logprobs": token(" my", 0)["logprobs"] + token(" parcel", 3)["logprobs"]},
                    {"index": 1, "text": " the box", "finish_reason": "length", "completion_tokens": 2,
                     "logprobs": token(" the", 0)["logprobs"] + token(" box", 4)["logprobs"]}]}


def stream_against_events(events: list[dict], shape: Shape) -> list[tuple[int, dict]]:
    """Each chunk with how many events the stream had read when it was sent."""
    read = 0

    def source():
        nonlocal read
        for event in events:
            read += 1
            yield event

    chunks = []
    for raw in completion_stream(JOB, source(), shape):
        if raw.startswith("data: {"):
            chunks.append((read, json.loads(raw.removeprefix("data: "))))
    return chunks


def test_an_echo_streams_with_the_first_delta_that_carries_the_prompt_not_at_the_end():
    events = [token(" my", 0, prompt=PROMPT), token(" the", 0, index=1), token(" parcel", 3),
              token(" box", 4, index=1), DONE]
    shape = Shape("m", logprobs=True, echo=True)
    chunks = stream_against_events(events, shape)
    texts = [(read, c["choices"][0]["index"], c["choices"][0]["text"]) for read, c in chunks]
    assert texts[:4] == [(1, 0, "Where is"), (1, 0, " my"), (2, 1, "Where is"), (2, 1, " the")]
    assert texts[4:6] == [(3, 0, " parcel"), (4, 1, " box")]
    # The stream says what the whole answer says, choice by choice, log-probabilities and offsets included.
    whole = completion(JOB, shape, DONE)
    for choice in whole["choices"]:
        mine = [c["choices"][0] for _, c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        assert [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]] == \
            choice["logprobs"]["text_offset"]
        assert mine[-1]["finish_reason"] == "length"


def test_without_the_prompt_on_a_delta_an_echo_waits_for_the_end_and_loses_nothing():
    events = [token(" my", 0), token(" the", 0, index=1), token(" parcel", 3), token(" box", 4, index=1), DONE]
    chunks = stream_against_events(events, Shape("m", echo=True))
    assert {read for read, _ in chunks} == {5}
    assert [c["choices"][0]["text"] for _, c in chunks if c["choices"][0]["index"] == 0] == \
        ["Where is", " my", " parcel", ""]


def test_an_echo_of_a_prompt_with_no_answer_comes_with_the_end():
    done = {**DONE, "completion_tokens": 0,
            "choices": [{"index": 0, "text": "", "finish_reason": "length", "completion_tokens": 0}]}
    chunks = stream_against_events([done], Shape("m", logprobs=True, echo=True))
    assert [c["choices"][0]["text"] for _, c in chunks] == ["Where is", ""]
    assert chunks[0][1]["choices"][0]["logprobs"]["tokens"] == ["Where", " is"]
