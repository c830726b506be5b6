"""OpenAI parity on /v1 through the real queue and worker: structured output, tools, logprobs, n, sampling
parameters and /v1/completions, driven by the official `openai` client. The tiny random model writes junk, so
only grammar-forced answers are checked for shape; everything else is checked against the plain request or the
engine run directly."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
import redis
import requests
from pydantic import BaseModel, Field
from sqlalchemy import func, select

from messaging.contract import QUEUE
from messaging.prompts import TemplateOptions
from models import RequestRecord
from tests.test_api_stack import MESSAGES, engine_direct, stream_heard
from worker.engine import EngineConfig, LLMEngine, RequestFinished, SamplingParams
from worker.model_loader import load_model, load_tokenizer
from worker.prompts import render
from worker.settings import weights_setting

LOOKUP = {"type": "function", "function": {
    "name": "lookup_order", "description": "Find an order by its number.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "integer", "minimum": 1, "maximum": 99999}},
                   "required": ["order_id"], "additionalProperties": False}}}
ESCALATE = {"type": "function", "function": {
    "name": "escalate", "description": "Hand the chat to a person.",
    "parameters": {"type": "object", "properties": {"reason": {"enum": ["angry", "complex", "other"]}},
                   "required": ["reason"], "additionalProperties": False}}}


class Order(BaseModel):
    status: Literal["shipped", "pending", "lost"]
    quantity: int = Field(ge=1, le=9)
    gift: bool


@pytest.fixture()
def client(stack):
    return openai.OpenAI(base_url=stack.web_urls[0] + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def test_parse_with_a_pydantic_model_answers_a_valid_object(client, db):
    reply = client.chat.completions.parse(model="any", messages=MESSAGES, response_format=Order, max_tokens=200,
                                          seed=3)
    message = reply.choices[0].message
    assert isinstance(message.parsed, Order)
    assert Order.model_validate_json(message.content) == message.parsed
    with db() as s:
        assert s.get(RequestRecord, reply.id.removeprefix("chatcmpl-")).finish_reason == "stop"


def test_json_object_mode_answers_a_json_object(stack):
    body = {"messages": MESSAGES, "response_format": {"type": "json_object"}, "max_tokens": 300, "temperature": 0}
    reply = requests.post(stack.web_urls[1] + "/v1/chat/completions", json=body, timeout=60).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop", "the object was complete before the token limit"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_vllms_structured_outputs_hold_answers_to_a_choice_a_regex_or_a_grammar(client):
    """vLLM's `structured_outputs` and its older `guided_*` fields, as its clients send them (extra_body), on both
    endpoints, whole and streamed."""
    choices = ["shipped", "delivered", "lost"]
    for extra in ({"structured_outputs": {"choice": choices}},
                  {"guided_choice": choices, "guided_decoding_backend": "xgrammar"}):
        reply = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=20, seed=1, extra_body=extra)
        assert reply.choices[0].message.content in choices and reply.choices[0].finish_reason == "stop", extra
    for extra in ({"guided_regex": "NW-[0-9]{5}"}, {"structured_outputs": {"regex": "NW-[0-9]{5}"}}):
        done = client.completions.create(model="any", prompt=["Order number: ", "Yours: "], max_tokens=20, seed=2,
                                         extra_body=extra)
        assert [c.finish_reason for c in done.choices] == ["stop", "stop"], extra
        assert all(re.fullmatch(r"NW-[0-9]{5}", c.text) for c in done.choices), [c.text for c in done.choices]
    lark = 'start: "Order " ID " is " STATUS\nID: /[0-9]{4}/\nSTATUS: "late" | "on time"'
    stream = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=40, seed=3, stream=True,
                                            extra_body={"structured_outputs": {"grammar": lark}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert re.fullmatch(r"Order [0-9]{4} is (late|on time)", text), text
    schema = {"type": "object", "properties": {"status": {"enum": choices}}, "required": ["status"],
              "additionalProperties": False}
    reply = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=40, seed=4,
                                           extra_body={"structured_outputs": {"json": json.dumps(schema)}})
    assert json.loads(reply.choices[0].message.content)["status"] in choices


def test_vllms_chat_template_fields_reach_the_template(client, tiny_model_dir):
    """chat_template_kwargs, add_generation_prompt and continue_final_message (a prefilled answer the model
    continues), as vLLM's clients send them: the worker renders the prompt the web counted with them."""
    served = load_tokenizer(str(tiny_model_dir))
    prefilled = [*MESSAGES, {"role": "assistant", "content": "Your order "}]
    prefill = TemplateOptions(add_generation_prompt=False, continue_final_message=True)
    no_thinking = {"enable_thinking": False}
    cases = [(MESSAGES, {"chat_template_kwargs": no_thinking}, TemplateOptions(no_thinking)),
             (prefilled, {"continue_final_message": True, "add_generation_prompt": False}, prefill),
             (prefilled, {"continue_final_message": True}, prefill),   # the generation prompt is off with it
             (prefilled, {"add_generation_prompt": False}, TemplateOptions(add_generation_prompt=False))]
    counts = []
    for messages, extra, options in cases:
        reply = client.chat.completions.create(model="any", messages=messages, max_tokens=2, extra_body=extra)
        counts.append(reply.usage.prompt_tokens)
        assert counts[-1] == len(render(served, messages, None, options)), extra
    assert counts[1] < counts[3], "the prefilled message is left open: no end of turn after it"


def test_a_forced_tool_call_streams_deltas_the_client_reassembles(client):
    request = dict(model="any", messages=MESSAGES, tools=[LOOKUP, ESCALATE], max_tokens=120, seed=11,
                   tool_choice={"type": "function", "function": {"name": "lookup_order"}})
    whole = client.chat.completions.create(**request)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None   # a named choice, as OpenAI
    [call] = choice.message.tool_calls
    assert call.function.name == "lookup_order" and call.id.startswith("call_")
    assert 1 <= json.loads(call.function.arguments)["order_id"] <= 99999

    chunks = list(client.chat.completions.create(**request, stream=True))
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    # How many pieces depends on how the worker's stream windows fell; tests/test_tools.py streams one per character.
    # Ids derive from the request id: the same in a stream and in the whole answer of one request.
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "lookup_order"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"
    with client.chat.completions.stream(**request) as stream:   # the client's own reassembly
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert final.choices[0].finish_reason == "stop" and streamed.id.startswith("call_")


def test_a_forced_tool_call_cut_by_max_tokens_leaks_no_markup(client):
    request = dict(model="any", messages=MESSAGES, tools=[LOOKUP, ESCALATE], max_tokens=3, seed=11,
                   tool_choice={"type": "function", "function": {"name": "lookup_order"}})
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None and not choice.message.tool_calls
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("short", [1, 4])
def test_a_call_cut_inside_its_closing_tag_keeps_its_whole_arguments(client, short):
    """The same seeded call, whole and then cut `short` tokens before its end (inside "</tool_call>"): the cut one
    has the whole call's arguments, valid JSON, and finish_reason "length", whole and streamed."""
    request = dict(model="any", messages=MESSAGES, tools=[LOOKUP, ESCALATE], seed=11,
                   tool_choice={"type": "function", "function": {"name": "lookup_order"}})
    whole = client.chat.completions.create(**request, max_tokens=120)
    [call] = whole.choices[0].message.tool_calls
    cut = client.chat.completions.create(**request, max_tokens=whole.usage.completion_tokens - short)
    assert cut.choices[0].finish_reason == "length"
    [cut_call] = cut.choices[0].message.tool_calls
    assert cut_call.function.arguments == call.function.arguments and json.loads(cut_call.function.arguments)
    chunks = list(client.chat.completions.create(**request, max_tokens=whole.usage.completion_tokens - short,
                                                 stream=True))
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_required_tool_choice_with_tool_history_calls_one_of_the_tools(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "lookup_order", "arguments": '{"order_id": 1234}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "shipped"}'},
        {"role": "user", "content": "I want a person."}]
    reply = client.chat.completions.create(model="any", messages=history, tools=[LOOKUP, ESCALATE],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=120, seed=5)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert calls[0].function.name in ("lookup_order", "escalate")
    json.loads(calls[0].function.arguments)
    plain = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=1)
    # The tools and the earlier call and its result reached the prompt.
    assert reply.usage.prompt_tokens > plain.usage.prompt_tokens + 100


def test_auto_shows_the_tools_to_the_model_and_none_does_not(client):
    def prompt_tokens(**tools) -> int:
        return client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=1, **tools).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=[LOOKUP]) == prompt_tokens(tools=[LOOKUP], tool_choice="auto") > plain + 50
    assert prompt_tokens(tools=[LOOKUP], tool_choice="none") == plain


def test_logprobs_whole_and_streamed(client):
    request = dict(model="any", messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)
    reply = client.chat.completions.create(**request)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        # Greedy: the token chosen is the most likely one.
        assert (entry.token, entry.logprob) == (entry.top_logprobs[0].token, entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    plain = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=12)
    assert reply.choices[0].message.content == plain.choices[0].message.content, "logprobs change nothing"
    assert plain.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_vllms_tokens_as_ids_name_every_logprob_token_by_its_id(client, tokenizer):
    request = dict(model="any", messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2)
    named = client.chat.completions.create(**request).choices[0]
    by_id = client.chat.completions.create(**request, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    ids = [int(e.token.removeprefix("token_id:")) for e in by_id.logprobs.content]
    assert all(e.token.startswith("token_id:") and all(t.token.startswith("token_id:") for t in e.top_logprobs)
               for e in by_id.logprobs.content)
    assert tokenizer.decode(ids, skip_special_tokens=True) == by_id.message.content == named.message.content
    assert [e.logprob for e in by_id.logprobs.content] == [e.logprob for e in named.logprobs.content]
    assert [e.bytes for e in by_id.logprobs.content] == [e.bytes for e in named.logprobs.content]
    chunks = list(client.chat.completions.create(**request, stream=True,
                                                 extra_body={"return_tokens_as_token_ids": True}))
    assert [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content] \
        == [e.token for e in by_id.logprobs.content]
    # The legacy completion's echoed prompt too: every token, and each alternative's key.
    prompt = tokenizer("Where is my parcel?")["input_ids"]
    scored = client.completions.create(model="any", prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                       logprobs=1, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert scored.logprobs.tokens[:len(prompt)] == [f"token_id:{t}" for t in prompt]
    assert all(k.startswith("token_id:") for top in scored.logprobs.top_logprobs[1:] for k in top)


def test_vllms_return_token_ids_give_the_prompts_and_each_choices_ids(client, tokenizer):
    request = dict(model="any", messages=MESSAGES, temperature=0, max_tokens=12, extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**request).model_dump()
    choice = whole["choices"][0]
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"]
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    assert tokenizer.decode(whole["prompt_token_ids"]).count(MESSAGES[-1]["content"]) == 1
    # A stream: the ids add up to the whole answer's; they and the prompt's come with the choice's end.
    chunks = [c.model_dump() for c in client.chat.completions.create(**request, stream=True)]
    assert [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []] == choice["token_ids"]
    assert [c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")] == [whole["prompt_token_ids"]]
    # Two choices streamed: each its own ids, the prompt's once.
    two = [c.model_dump() for c in client.chat.completions.create(**{**request, "n": 2}, stream=True)]
    ends = [ch for c in two for ch in c["choices"] if ch.get("finish_reason")]
    assert sorted(e["index"] for e in ends) == [0, 1] and all(e["token_ids"] == choice["token_ids"] for e in ends)
    assert [c["prompt_token_ids"] for c in two if c.get("prompt_token_ids")] == [whole["prompt_token_ids"]]
    # Not asked: none of them.
    plain = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=4).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    # Completions carry the prompt's ids on each choice: a list of prompts, each its own.
    prompts = [tokenizer("Where is my parcel?")["input_ids"], tokenizer("Hello")["input_ids"]]
    batch = client.completions.create(model="any", prompt=prompts, max_tokens=3, temperature=0,
                                      extra_body={"return_token_ids": True}).model_dump()
    assert [c["prompt_token_ids"] for c in batch["choices"]] == prompts
    assert all(tokenizer.decode(c["token_ids"], skip_special_tokens=True) == c["text"] for c in batch["choices"])
    streamed = [c.model_dump() for c in client.completions.create(model="any", prompt=prompts[0], max_tokens=3,
                                                                 temperature=0, stream=True,
                                                                 extra_body={"return_token_ids": True})]
    ends = [ch for c in streamed for ch in c["choices"] if ch.get("finish_reason")]
    assert [(e["prompt_token_ids"], e["token_ids"]) for e in ends] == [(prompts[0], batch["choices"][0]["token_ids"])]


def test_n_choices_whole_and_streamed(client):
    request = dict(model="any", messages=MESSAGES, n=3, max_tokens=10, seed=21, temperature=1.0)
    reply = client.chat.completions.create(**request)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) > 1, "seeded choices differ from each other"
    single = client.chat.completions.create(**{**request, "n": 1})
    assert single.choices[0].message.content == texts[0], "choice 0 draws with the request's own seed"
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens
    assert reply.usage.completion_tokens > single.usage.completion_tokens
    streamed: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in client.chat.completions.create(**request, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert [streamed[i] for i in range(3)] == texts
    assert [reasons[i] for i in range(3)] == [c.finish_reason for c in reply.choices]


def test_greedy_answers_are_unchanged_by_neutral_new_fields(client, tiny_model_dir):
    expected = engine_direct(tiny_model_dir, MESSAGES, 16)
    reply = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=16, n=2,
                                           presence_penalty=0, frequency_penalty=0, logit_bias={}, tools=[LOOKUP],
                                           tool_choice="none", response_format={"type": "text"})
    assert [c.message.content for c in reply.choices] == [expected, expected]


def test_logit_bias_reaches_the_sampler(client):
    plain = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=3,
                                           logprobs=True)
    first = plain.choices[0].logprobs.content[0]
    biased = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=3,
                                            logprobs=True, logit_bias={"42": 100}, presence_penalty=0.5,
                                            frequency_penalty=0.5, extra_body={"min_p": 0.05})
    assert first.token != ":"
    assert biased.choices[0].logprobs.content[0].token == ":"   # token 42 of the tokenizer


def test_dry_fields_as_llama_cpp_clients_send_them_reach_the_sampler(client, tiny_model_dir, tokenizer):
    """Top-level DRY fields (extra_body in the openai client): the answer is the engine's with the same DRY, and
    not the plain one (the tiny model's greedy answer to "no" loops)."""
    dry = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
           "dry_sequence_breakers": "\"\\n\", \":\""}   # text-generation-webui's string form
    reply = client.completions.create(model="any", prompt="no", temperature=0, max_tokens=80, extra_body=dry)
    model, _ = load_model(str(tiny_model_dir), weights=weights_setting())
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64))
    ids = tokenizer.encode("no")
    params = SamplingParams(temperature=0, max_new_tokens=80, **{**dry, "dry_sequence_breakers": ["\n", ":"]})
    engine.add_request("direct", prompt_token_ids=ids, params=params)
    engine.add_request("plain", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_new_tokens=80))
    answers = {}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, RequestFinished):
                answers[event.request_id] = event.text
    assert reply.choices[0].text == answers["direct"]
    assert answers["direct"] != answers["plain"]


def direct_completion(model_dir, ids: list[int], max_tokens: int, **params) -> str:
    return direct_answer(model_dir, ids, max_tokens, **params).text


def direct_answer(model_dir, ids: list[int], max_tokens: int, **params) -> RequestFinished:
    model, tokenizer = load_model(str(model_dir), weights=weights_setting())   # the worker's precision
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64))
    engine.add_request("direct", prompt_token_ids=ids,
                       params=SamplingParams(temperature=0, max_new_tokens=max_tokens, **params))
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, RequestFinished):
                return event
    raise AssertionError("no answer")


def test_completions_take_ids_or_text_as_they_are(client, tiny_model_dir, tokenizer):
    text = "Order 1234 was shipped on"
    ids = tokenizer(text)["input_ids"]
    by_ids = client.completions.create(model="any", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.object == "text_completion" and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == direct_completion(tiny_model_dir, ids, 8)
    by_text = client.completions.create(model="any", prompt=[text], max_tokens=8, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(model="any", prompt=text, max_tokens=8,
                                                                   temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == by_ids.choices[0].text and len([p for p in pieces if p]) > 1


def test_vllms_stop_token_ids_and_stop_reason_whole_and_streamed(client, tiny_model_dir, tokenizer):
    """A stop token ends the answer where the model first draws it, and each choice says what stopped it (vLLM's
    stop_reason): the token id, the stop string (kept in the text when asked), or null for the length cap."""
    ids = tokenizer("Order 1234 was shipped on")["input_ids"]
    full = direct_answer(tiny_model_dir, ids, 12, ignore_eos=True)
    token = full.token_ids[4]
    first = full.token_ids.index(token)
    eos = {"ignore_eos": True}
    capped = client.completions.create(model="any", prompt=ids, max_tokens=12, temperature=0, extra_body=eos)
    assert capped.choices[0].text == full.text and capped.choices[0].finish_reason == "length"
    assert capped.choices[0].model_extra["stop_reason"] is None
    by_token = client.completions.create(model="any", prompt=ids, max_tokens=12, temperature=0,
                                         extra_body={**eos, "stop_token_ids": [token]})
    assert by_token.choices[0].finish_reason == "stop" and by_token.choices[0].model_extra["stop_reason"] == token
    assert by_token.choices[0].text == tokenizer.decode(full.token_ids[:first + 1], skip_special_tokens=True)
    assert by_token.usage.completion_tokens == first + 1
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    cut = full.text.index(stop)
    for include in (False, True):
        body = {**eos, "include_stop_str_in_output": include}
        whole = client.completions.create(model="any", prompt=ids, max_tokens=12, temperature=0, stop=[stop],
                                          extra_body=body)
        assert whole.choices[0].text == full.text[:cut + (len(stop) if include else 0)]
        assert whole.choices[0].model_extra["stop_reason"] == stop
        chunks = list(client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=12, temperature=0,
                                                     stop=[stop], stream=True, extra_body=body))
        ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
        chat = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=12, temperature=0,
                                              stop=[stop], extra_body=body)
        assert len(ends) == 1 and ends[0].model_extra["stop_reason"] == chat.choices[0].model_extra["stop_reason"]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            chat.choices[0].message.content


def test_a_stop_token_the_model_lacks_is_a_400_naming_it(stack, tokenizer):
    too_big = len(tokenizer) + 10
    response = requests.post(stack.web_urls[0] + "/v1/completions", timeout=30,
                             json={"prompt": "hi", "max_tokens": 4, "stop_token_ids": [too_big]})
    assert response.status_code == 400, response.text
    assert "stop_token_ids" in response.json()["error"]["message"] and str(too_big) in response.json()["error"]["message"]


def test_completions_echo_and_logprobs_score_a_prompt(client, tokenizer):
    text = "Where is my parcel?"
    ids = tokenizer(text)["input_ids"]
    scored = client.completions.create(model="any", prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == text and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(2 <= len(d) <= 3 for d in lp.top_logprobs[1:])
    answered = client.completions.create(model="any", prompt=text, max_tokens=5, echo=True, logprobs=1,
                                         temperature=0, n=2)
    for c in answered.choices:
        assert c.text.startswith(text) and len(c.logprobs.tokens) == len(ids) + 5
        assert c.logprobs.token_logprobs[:len(ids)] == lp.token_logprobs
        assert c.logprobs.text_offset[len(ids)] == len(text)
    chunks = [c for c in client.completions.create(model="any", prompt=text, max_tokens=5, echo=True, logprobs=1,
                                                   temperature=0, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == answered.choices[0].text
    assert [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == \
        answered.choices[0].logprobs.tokens


def test_a_streamed_echo_leaves_the_worker_with_the_answers_first_delta(stack, client):
    """The prompt (text and log-probabilities) rides on choice 0's first delta, so the web streams the echo and the
    answer as they come instead of holding them to the end."""
    text = "Where is my parcel?"
    with stream_heard(stack.env["REDIS_URL"]) as heard:
        chunks = [c for c in client.completions.create(model="any", prompt=text, max_tokens=12, echo=True, logprobs=1,
                                                       temperature=0, stream=True) if c.choices]
    rid = chunks[0].id.removeprefix("cmpl-")
    mine = [e for e in heard if e.data["request_id"] == rid]
    first = next(i for i, e in enumerate(mine) if e.name == "token")
    done = next(i for i, e in enumerate(mine) if e.name == "done")
    assert first < done and mine[first].data["prompt"] == mine[done].data["prompt"]
    assert mine[first].data["prompt"]["text"] == text and len(mine[first].data["prompt"]["logprobs"]) > 1
    assert [e.data.get("prompt") for e in mine[first + 1:done] if e.name == "token"] == [None] * (done - first - 1)
    assert chunks[0].choices[0].text == text and "".join(c.choices[0].text for c in chunks).startswith(text)


BAD = [
    ("/chat/completions", {"n": 9}, "n"),
    ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/chat/completions", {"logit_bias": {"abc": 5}}, "logit_bias"),
    ("/chat/completions", {"logit_bias": {"42": 101}}, "logit_bias"),
    ("/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/chat/completions", {"min_p": -0.1}, "min_p"),
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}}, "response_format"),
    ("/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "uniqueItems": True, "not": {}}}}}, "response_format"),
    ("/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/chat/completions", {"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "refund"}}},
     "tool_choice"),
    ("/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ("/completions", {"prompt": "hi", "logprobs": 6}, "logprobs"),
    ("/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/completions", {"prompt": ["a", 5]}, "prompt"),
    ("/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/chat/completions", {"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
    ("/chat/completions", {"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
    ("/chat/completions", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ("/chat/completions", {"guided_json": {"type": "strnig"}}, "guided_json"),
    ("/chat/completions", {"guided_choice": []}, "guided_choice"),
    ("/chat/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ("/completions", {"prompt": "hi", "structured_outputs": {"grammar": "start: nowhere"}},
     "structured_outputs.grammar"),
    ("/chat/completions", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/chat/completions", {"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ("/chat/completions", {"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ("/chat/completions", {"continue_final_message": True}, "continue_final_message"),   # the last message is a user's
    ("/chat/completions", {"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ("/chat/completions", {"dry_multiplier": -0.5}, "dry_multiplier"),
    ("/chat/completions", {"dry_multiplier": 0.8, "dry_base": 0.5}, "dry_base"),
    ("/chat/completions", {"dry_allowed_length": 0}, "dry_allowed_length"),
    ("/chat/completions", {"dry_sequence_breakers": ["\n", ""]}, "dry_sequence_breakers"),
    ("/completions", {"prompt": "hi", "dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ("/chat/completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("/completions", {"prompt": "hi", "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ("/chat/completions", {"stop_token_ids": [2**31]}, "stop_token_ids"),
    ("/chat/completions", {"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ("/completions", {"prompt": "hi", "return_tokens_as_token_ids": 1}, "return_tokens_as_token_ids"),
]


def test_bad_input_gets_an_openai_error_naming_the_parameter_and_nothing_is_queued(stack, db):
    r = redis.Redis.from_url(stack.env["REDIS_URL"])

    def state() -> tuple:
        with db() as s:
            records = s.scalar(select(func.count()).select_from(RequestRecord))
        return records, sum(1 for _ in r.scan_iter("supportbot:job:*")), r.llen(QUEUE)

    before = state()
    for path, fields, param in BAD:
        body = {"messages": MESSAGES, **fields} if path == "/chat/completions" else fields
        response = requests.post(stack.web_urls[0] + "/v1" + path, json=body, timeout=10)
        assert response.status_code == 400, (fields, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (fields, error)
        assert len(error["message"]) > 20, error
    assert state() == before, "nothing queued and no record stored for a refused request"


def test_the_openai_client_sees_an_invalid_schema_and_an_unknown_tool_as_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="strnig"):
        client.chat.completions.create(model="any", messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}})
    with pytest.raises(openai.BadRequestError, match="'refund', which is not among the tools"):
        client.chat.completions.create(model="any", messages=MESSAGES, tools=[LOOKUP],
                                       tool_choice={"type": "function", "function": {"name": "refund"}})
