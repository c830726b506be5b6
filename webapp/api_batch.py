"""/v1/completions with a list of prompts (lm-evaluation-harness sends its batches so): one job per prompt, answered
as one completion whose choices run prompt by prompt, n each (choice i * n + j is prompt i's choice j), as OpenAI's
and vLLM's do."""

from __future__ import annotations

import json
from collections.abc import Iterator

from . import api_answers, queue
from .disconnect import ClientGone, final_event

Part = tuple[dict, Iterator[dict]]   # a prompt's job and its events


def finals(parts: list[Part]) -> list[dict | None]:
    """Each job's last event (done or error; None: it never came). The jobs run at once; they are waited for in
    order. Raises ClientGone, every subscription closed, once the client has left."""
    out = []
    for i, (_, events) in enumerate(parts):
        try:
            out.append(final_event(events))
        except ClientGone:
            for _, later in parts[i + 1:]:
                later.close()
            raise
    return out


def completion(parts: list[Part], shape: api_answers.Shape, done: list[dict], n: int) -> dict:
    """The whole answer: the first job's id, every prompt's choices renumbered, their usage summed."""
    bodies = [api_answers.completion(job, shape, final) for (job, _), final in zip(parts, done)]
    merged = bodies[0]
    merged["choices"] = [{**c, "index": i * n + c["index"]} for i, body in enumerate(bodies) for c in body["choices"]]
    merged["usage"] = summed([body["usage"] for body in bodies])
    return merged


def summed(usages: list[dict]) -> dict:
    return {key: sum(u[key] for u in usages) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def stream(parts: list[Part], shape: api_answers.Shape, n: int) -> Iterator[str]:
    """Each prompt's chunks in turn (the later ones are generated meanwhile and wait in their subscriptions),
    under the first job's id with their choices renumbered; one usage chunk at the end when asked; one [DONE].
    A client that goes away cancels every job not finished."""
    first_id = f"cmpl-{parts[0][0]['request_id']}"
    usages: list[dict] = []
    ended = 0
    try:
        for i, (job, events) in enumerate(parts):
            for line in api_answers.completion_stream(job, events, shape):
                if not line.startswith("data: "):   # a keep-alive comment
                    yield line
                    continue
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    yield line
                    continue
                if chunk.get("usage") is not None and not chunk["choices"]:
                    usages.append(chunk["usage"])
                    continue
                chunk["id"] = first_id
                for choice in chunk["choices"]:
                    choice["index"] = i * n + choice["index"]
                yield f"data: {json.dumps(chunk)}\n\n"
            ended = i + 1
        if shape.include_usage and usages:
            last = {"id": first_id, "object": "text_completion", "created": int(parts[0][0]["enqueued_at"]),
                    "model": shape.model, "choices": [], "usage": summed(usages)}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for job, _ in parts[ended:]:   # a job finished already ignores its cancel
            queue.cancel(job["request_id"])
