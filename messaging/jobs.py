"""A queued job's fields beyond the chat's, as the API sets them; a job without one (an older web process's) means
"not used".

    request_id, conversation_id, room, channel, source, enqueued_at, api_key   who asked, where the answer goes
    messages      chat messages: {role, content}; the API's may also be {role: "tool", content, tool_call_id}
                  and {role: "assistant", content, tool_calls: [OpenAI tool calls]}
    params        the generation's wire form (messaging/generation.py: {"v": 1, field: value} with only the fields
                  that differ from their defaults), its `service_class` (interactive, standard or bulk; absent:
                  standard) picking the queue
    structure     structured.Structure.to_json(): the answer's grammar (a JSON schema, forced tool calls)
    tools         OpenAI tool definitions the prompt offers the model (rendered by the worker)
    grounding     the chat's: what the worker looks up before the model writes (messaging/grounding.py)
    template      messaging.prompts.TemplateOptions.to_json(): vLLM's chat_template_kwargs, add_generation_prompt
                  and continue_final_message, when a request set them
    prompt        /v1/completions: the prompt as text or token ids, used as it is (no chat template); then
                  `messages` is empty
    echo          /v1/completions: the final event carries the prompt's text (and its log-probabilities when
                  params.prompt_logprobs is set)
    tokens_as_ids     log-probabilities name each token "token_id:N" (vLLM's return_tokens_as_token_ids)
    token_ids     the final event carries the prompt's token ids and each choice's (vLLM's return_token_ids)
    http_request_id   an API request's x-request-id (the client's own, or the web app's), for the worker's logs
"""

from __future__ import annotations

from messaging.contract import DEFAULT_CLASS

STRUCTURE, TOOLS, PROMPT, ECHO, TEMPLATE = "structure", "tools", "prompt", "echo", "template"
TOKENS_AS_IDS = "tokens_as_ids"   # log-probabilities name each token "token_id:N" (vLLM's return_tokens_as_token_ids)
TOKEN_IDS = "token_ids"   # the final event carries the prompt's and each choice's token ids (vLLM's return_token_ids)
HTTP_REQUEST_ID = "http_request_id"


def service_class(job: dict) -> str:
    """The job's service class: its queue, the engine's order and its latency objective."""
    return (job.get("params") or {}).get("service_class") or DEFAULT_CLASS


def choices(job: dict) -> int:
    """How many choices (`n`) the request asks for."""
    return (job.get("params") or {}).get("n", 1)


def replayable(job: dict) -> bool:
    """Whether a stored answer can be shown again as it is: one choice, no log-probabilities, no token ids (SQL keeps
    none of them).
    Other requests are generated again on redelivery, to the same tokens (their seed is fixed at acceptance)."""
    params = job.get("params") or {}
    return choices(job) == 1 and params.get("logprobs") is None and params.get("prompt_logprobs") is None \
        and not job.get(ECHO) and not job.get(TOKEN_IDS)
