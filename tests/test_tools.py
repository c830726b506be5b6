"""Tool calls: forced by a grammar, read back from an answer whole or streamed, and told apart from plain text."""

from __future__ import annotations

import json
import random

import llguidance
import llguidance.hf
import pytest

from structured.tools import (BEGIN, END, OPEN, StreamParser, Tool, ToolError, call_id, call_text, forced,
                              instructions, offered, parse)
from tests.test_structured import generate

ORDER_TOOL = Tool("get_order_status", "Look up an order", {
    "type": "object", "properties": {"order_number": {"type": "string", "pattern": "^[0-9]{4}$"}},
    "required": ["order_number"], "additionalProperties": False})
HANDOVER_TOOL = Tool("hand_over", "Pass the chat to a person", {
    "type": "object", "properties": {"reason": {"enum": ["refund", "complaint", "other"]}},
    "required": ["reason"], "additionalProperties": False})

ANSWERS = [
    "Hello there, how can I help?",
    BEGIN + '{"name":"get_order_status","arguments":{"order_number":"1234"}}' + END,
    BEGIN + '{"name":"a","arguments":{"x":{"y":[1,2]}}}' + END + "\n" + BEGIN + '{"name":"b","arguments":{}}' + END,
    "Let me check.\n" + BEGIN + '{"name": "get_weather", "arguments": {"city": "Paris"}}' + END,
    BEGIN + '{"arguments": {"a": 1}, "name": "f"}' + END,
    "I use <tool_call> tags sometimes </tool_call> ok",
    BEGIN + '{"name":"get_order_status","arguments":{"order_number":"12',
    BEGIN + '{"name":"get_order_status","arguments":{"order_number":"12"}}',
    "a < b and c <tool",
    "text  \n\n",
    BEGIN + '{"name":"b","arguments":{}}' + END + "\nand some words after",
    BEGIN + '{"name": "f", "arguments": "{\\"a\\": 1, \\"b\\": [2]}"}' + END,
    BEGIN + '{"arguments": "{\\"a\\": 1}", "name": "f"}' + END,
    BEGIN + '{"name": "get_order_status", "arguments": {"order_number": "1234"}}\n</tool_',
]


def stream(text: str, seed: int, forced: bool = False) -> tuple[str | None, dict[int, dict]]:
    """The answer fed in random pieces; content and calls put together from the OpenAI deltas."""
    parser, rng, deltas, i = StreamParser("req", forced), random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        deltas += parser.feed(text[i:i + n])
        i += n
    deltas += parser.finish()
    content, calls = "", {}
    for delta in (d.to_openai() for d in deltas):
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in call:
                assert entry["id"] is None and call["type"] == "function"   # the id and name come once, first
                entry.update(id=call["id"], name=call["function"]["name"])
            entry["arguments"] += call["function"].get("arguments", "")
    return (content if content.strip() or not (calls or forced) else None), calls


@pytest.mark.parametrize("text", ["<tool", BEGIN, BEGIN + '{"na', BEGIN + '{"name":"get_order_st',
                                  BEGIN + '{"name":"get_order_status","arguments":{"order_nu'])
def test_a_forced_call_cut_short_gives_no_text(text):
    """tool_choice forced a call and max_tokens cut it: what was written is markup, never the answer's content. A
    call whose name was written keeps it and the arguments read so far (OpenAI's finish_reason is then "length")."""
    content, calls = parse(text, "req", forced=True)
    assert content is None
    named = '"arguments"' in text
    assert [(c.name, c.arguments) for c in calls] == ([("get_order_status", '{"order_nu')] if named else [])
    for seed in range(10):
        assert stream(text, seed, forced=True) == (content, {c.index: {"id": c.id, "name": c.name,
                                                                      "arguments": c.arguments} for c in calls})
    if not named:   # unforced, the same text is content: the model chose to write it
        assert parse(text, "req")[0]


@pytest.mark.parametrize("text", ANSWERS)
def test_a_streamed_answer_reads_as_the_whole_one(text):
    content, calls = parse(text, "req")
    for seed in range(25):
        streamed_content, streamed = stream(text, seed)
        assert streamed_content == content
        assert [(c["id"], c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == \
            [(c.id, c.name, c.arguments) for c in calls]


def test_calls_and_text_are_told_apart():
    assert parse(ANSWERS[0], "r") == ("Hello there, how can I help?", [])
    content, calls = parse(ANSWERS[3], "r")
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    content, calls = parse(ANSWERS[2], "r")
    assert content is None and [c.name for c in calls] == ["a", "b"] and [c.index for c in calls] == [0, 1]
    assert parse(ANSWERS[5], "r") == (ANSWERS[5], [])   # tags around something that is not a call: text
    assert parse(ANSWERS[10], "r")[0] == "and some words after"


@pytest.mark.parametrize("cut", ["\n</tool_call", "\n</", "\n", "  \n</tool"])
def test_a_call_cut_inside_its_closing_tag_has_its_arguments_whole(cut):
    """max_tokens ended the answer inside the closing tag: the call was complete, so its arguments are valid JSON,
    without the call's own brace or the tag, in a whole answer and in a stream alike."""
    text = BEGIN + '{"name": "get_order_status", "arguments": {"order_number": "NW-1"}}' + cut
    for forced_ in (False, True):
        content, calls = parse(text, "req", forced_)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == \
            [("get_order_status", {"order_number": "NW-1"})]
        for seed in range(10):
            assert stream(text, seed, forced_)[1] == {0: {"id": calls[0].id, "name": "get_order_status",
                                                          "arguments": calls[0].arguments}}


@pytest.mark.parametrize("text", ANSWERS[11:13])
def test_arguments_written_as_a_json_string_are_decoded_in_either_key_order(text):
    _, calls = parse(text, "r")
    assert len(calls) == 1 and calls[0].name == "f" and json.loads(calls[0].arguments)["a"] == 1
    for seed in range(10):
        assert stream(text, seed)[1][0]["arguments"] == calls[0].arguments


def test_a_call_cut_short_keeps_what_was_written():
    _, calls = parse(ANSWERS[6], "r")
    assert calls[0].arguments == '{"order_number":"12'
    _, calls = parse(ANSWERS[7], "r")   # complete JSON, no closing tag: the model stopped there
    assert calls[0].arguments == '{"order_number":"12"}'


def test_call_ids_are_stable_per_request_and_index():
    assert call_id("a", 0) == call_id("a", 0) != call_id("a", 1) != call_id("b", 1)
    assert call_id("a", 0).startswith("call_") and len(call_id("a", 0)) == 29
    assert parse(ANSWERS[1], "a")[1][0].id == call_id("a", 0)


@pytest.mark.parametrize("seed", range(3))
def test_a_named_choice_forces_one_valid_call_of_that_tool(tokenizer, seed):
    text = generate(tokenizer, forced([ORDER_TOOL, HANDOVER_TOOL], "hand_over"), seed)
    content, calls = parse(text, "r")
    assert content is None and len(calls) == 1 and calls[0].name == "hand_over"
    assert json.loads(calls[0].arguments)["reason"] in ("refund", "complaint", "other")


@pytest.mark.parametrize("seed", range(3))
def test_required_forces_calls_of_any_tool(tokenizer, seed):
    text = generate(tokenizer, forced([ORDER_TOOL, HANDOVER_TOOL], None, parallel=True), seed, limit=400)
    content, calls = parse(text, "r")
    assert content is None and calls
    for call in calls:
        arguments = json.loads(call.arguments)
        assert call.name in ("get_order_status", "hand_over")
        if call.name == "get_order_status":
            assert len(arguments["order_number"]) == 4


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_holds_a_call_the_model_opens_to_the_offered_tools(tokenizer, seed, parallel):
    """tool_choice "auto": the model writes text freely, but from <tool_call> on, only a valid call of an offered
    tool fits; without parallel calls, the text after it can never open a second one."""
    text = generate(tokenizer, offered([ORDER_TOOL, HANDOVER_TOOL], parallel), seed, limit=120,
                    prefix="Let me look. " + BEGIN)
    content, calls = parse(text, "r")
    assert content.startswith("Let me look.") and calls
    for call in calls:
        arguments = json.loads(call.arguments)
        assert call.name in ("get_order_status", "hand_over")
        assert len(arguments["order_number"]) == 4 if call.name == "get_order_status" else \
            arguments["reason"] in ("refund", "complaint", "other")
    if not parallel:
        assert len(calls) == 1 and OPEN not in text[text.index(END) + len(END):]


def test_auto_refuses_an_unoffered_tool_and_a_second_call_when_not_parallel(tokenizer):
    lltok = llguidance.hf.from_tokenizer(tokenizer)

    def fits(structure, text: str) -> bool:
        matcher = llguidance.LLMatcher(lltok, structure.grammar())
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    call = BEGIN + '{"name":"hand_over","arguments":{"reason":"refund"}}' + END
    one, several = offered([ORDER_TOOL, HANDOVER_TOOL], False), offered([ORDER_TOOL, HANDOVER_TOOL], True)
    for structure in (one, several):
        assert fits(structure, "Hello! I use a < b and tool_call words.")
        assert fits(structure, "Passing you on.\n" + call + "\nSomeone will write soon.")
        assert not fits(structure, BEGIN + '{"name":"launch_rocket","arguments":{}}' + END)
        assert not fits(structure, BEGIN + '{"name":"hand_over","arguments":{"reason":"boredom"}}' + END)
        assert not fits(structure, "Sure " + OPEN + " is how I call tools")
    assert fits(several, call + "\n" + call) and not fits(one, call + "\n" + call)


def test_tool_definitions_and_choices_are_checked():
    assert Tool.from_openai(ORDER_TOOL.to_openai()) == ORDER_TOOL
    assert Tool.from_openai({"type": "function", "function": {"name": "f"}}).parameters["type"] == "object"
    for bad in ({"type": "function"}, {"type": "function", "function": {"name": "has space"}},
                {"type": "function", "function": {"name": "f", "parameters": []}}, "f"):
        with pytest.raises(ToolError):
            Tool.from_openai(bad)
    with pytest.raises(ToolError, match="not among the tools"):
        forced([ORDER_TOOL], "launch_rocket")
    with pytest.raises(ToolError, match="at least one tool"):
        forced([], None)


def test_templates_without_tools_get_the_same_format_in_words():
    text = instructions([ORDER_TOOL])
    assert "get_order_status" in text and BEGIN in text and END in text
    assert parse(call_text("f", {"a": 1}), "r")[1][0].arguments == '{"a": 1}'
