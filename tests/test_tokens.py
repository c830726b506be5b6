"""/tokenize and /detokenize through the real stack, in vLLM's and llama.cpp's shapes: the web process tokenizes
as the worker does, from what the worker publishes."""

from __future__ import annotations

import openai
import pytest
import requests

from worker.model_loader import load_tokenizer
from worker.prompts import text_ids

TEXT = "Where is order NW-10042? héllo 🤖"
MESSAGES = [{"role": "system", "content": "You answer questions about orders."},
            {"role": "user", "content": "Can I change the delivery address of order 1234?"}]


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def post(stack, path: str, body: dict) -> requests.Response:
    return requests.post(stack.web_urls[0] + path, json=body, timeout=30)


def test_a_text_is_tokenized_as_the_worker_tokenizes_a_completions_prompt(stack, served):
    out = post(stack, "/tokenize", {"model": "any", "prompt": TEXT}).json()
    assert out["tokens"] == text_ids(served, TEXT) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 512 and out["token_strs"] is None
    bare = post(stack, "/tokenize", {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == served(TEXT, add_special_tokens=False)["input_ids"]
    assert bare["token_strs"] == served.convert_ids_to_tokens(bare["tokens"])
    # llama.cpp's shape: `content`, no special tokens unless asked, pieces on request.
    llama = post(stack, "/tokenize", {"content": TEXT, "with_pieces": True}).json()
    assert [t["id"] for t in llama["tokens"]] == bare["tokens"]
    ascii_text = "Where is order NW-10042?"   # each piece whole characters, so they join back
    pieces = post(stack, "/tokenize", {"content": ascii_text, "with_pieces": True}).json()["tokens"]
    assert "".join(t["piece"] for t in pieces) == ascii_text


def test_chat_messages_count_what_a_chat_completion_is_charged(stack):
    out = post(stack, "/tokenize", {"messages": MESSAGES}).json()
    client = openai.OpenAI(base_url=stack.web_urls[0] + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=1)
    assert out["count"] == reply.usage.prompt_tokens == len(out["tokens"])
    prefilled = post(stack, "/tokenize", {"messages": [*MESSAGES, {"role": "assistant", "content": "Yes, "}],
                                          "continue_final_message": True}).json()
    assert prefilled["count"] > out["count"]


def test_ids_are_detokenized_in_both_shapes(stack, served):
    ids = text_ids(served, TEXT)
    out = post(stack, "/detokenize", {"tokens": ids}).json()
    assert out["prompt"] == out["content"] == served.decode(ids)


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": "any"}, "content"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [1, "two"]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(stack, path, body, param):
    response = post(stack, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
