"""What ends a request for its client: the final event, one record of its choices, and the API's extra fields."""

from __future__ import annotations

from dataclasses import replace

from messaging.jobs import ECHO, TOKEN_IDS
from worker.engine import RequestFinished, TokenLogprob
from worker.token_json import TokenJson


def outcome(job: dict, finish_reason: str, text: str, prompt_tokens: int, completion_tokens: int,
            error: str | None = None, extra: dict | None = None) -> tuple[str, dict]:
    """The event that ends a request for its client: `done`, or `error` when generation failed. `extra`: the API's
    own fields (each choice, the echoed prompt), which the chat's events never carry."""
    if finish_reason == "error":
        return "error", {"request_id": job["request_id"], "code": "generation_failed", "retryable": True,
                         "message": error or "The assistant failed while answering; please send your message again."}
    return "done", {"request_id": job["request_id"], "conversation_id": job.get("conversation_id"), "text": text,
                    "finish_reason": finish_reason, "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens, **(extra or {})}


def combined(ends: list[RequestFinished]) -> RequestFinished:
    """One record of a request's choices: the first's text and timings, every choice's tokens (and those an earlier
    delivery wrote); an error in any choice is the request's."""
    first = ends[0]
    failed = next((e for e in ends if e.finish_reason == "error"), None)
    return replace(first, completion_tokens=sum(e.completion_tokens for e in ends),
                   continued_tokens=sum(e.continued_tokens for e in ends),
                   finish_reason=failed.finish_reason if failed else first.finish_reason,
                   error=failed.error if failed else first.error,
                   first_token_time=min((e.first_token_time for e in ends if e.first_token_time is not None),
                                        default=None),
                   finished_time=max(e.finished_time for e in ends), finished=True)


def api_fields(job: dict, ends: list[RequestFinished], tokens: TokenJson | None, prompt_text) -> dict:
    """What an API client's final event carries beyond the chat's: each choice (text, end, the stop string or token
    that ended it, tokens, log-probabilities, and when asked its token ids), the prompt's token ids when asked and,
    for an echo, the prompt's text and log-probabilities."""
    tokens = tokens.for_job(job) if tokens is not None else None
    fields: dict = {"choices": [
        {"index": e.index, "text": e.text, "finish_reason": e.finish_reason, "completion_tokens": e.completion_tokens,
         "stop_reason": e.stop_reason,
         **({"logprobs": [tokens(x) for x in e.logprobs]} if e.logprobs is not None and tokens else {})}
        for e in ends]}
    if job.get(TOKEN_IDS):   # vLLM's return_token_ids
        for choice, e in zip(fields["choices"], ends):
            choice["token_ids"] = e.token_ids
        fields["prompt_token_ids"] = ends[0].prompt_token_ids
    if job.get(ECHO):
        first = ends[0]
        fields["prompt"] = echoed_prompt(prompt_text(first.prompt_token_ids), first.prompt_token_ids,
                                         first.prompt_logprobs, tokens)
    return fields


def echoed_prompt(text: str, ids: list[int], entries: list[TokenLogprob | None] | None,
                  tokens: TokenJson | None) -> dict:
    """An echo's prompt for its client: the text and, when asked, each prompt token's log-probabilities."""
    prompt: dict = {"text": text}
    if entries is not None and tokens is not None:
        prompt["logprobs"] = [tokens(entry) if entry is not None else
                              {**tokens.one(token, 0.0), "logprob": None, "top_logprobs": None}
                              for token, entry in zip(ids, entries)]
    return prompt
