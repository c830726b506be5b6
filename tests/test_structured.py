"""Structured-output constraints: compiled once, refused with a reason, and followed token by token."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.numpy
import pytest
import torch

from structured import Structure, StructureError

ORDER = {"type": "object", "properties": {"order": {"type": "string", "pattern": "^[0-9]{4}$"},
                                          "urgent": {"type": "boolean"}},
         "required": ["order", "urgent"], "additionalProperties": False}


def generate(tokenizer, structure: Structure, seed: int, limit: int = 200, prefix: str = "") -> str:
    """Random logits, masked by the grammar at every token: whatever the scores, the text fits. `prefix`: text the
    model is taken to have written first (it must fit the grammar too)."""
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    matcher = llguidance.LLMatcher(lltok, structure.grammar())
    mask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    assert matcher.consume_tokens(ids), "the grammar refuses the prefix"
    for _ in range(limit):
        if matcher.is_stopped():
            break
        llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
        logits = torch.randn(1, lltok.vocab_size, generator=generator).numpy()
        llguidance.numpy.apply_token_bitmask_inplace(logits, mask)
        token = int(logits.argmax())
        if token == tokenizer.eos_token_id:
            assert matcher.is_accepting()
            break
        assert matcher.consume_token(token)
        ids.append(token)
    assert matcher.is_accepting(), "the limit cut the value short"
    return tokenizer.decode(ids)


@pytest.mark.parametrize("seed", range(3))
def test_a_schema_constrains_random_logits_to_valid_json(tokenizer, seed):
    text = generate(tokenizer, Structure(ORDER), seed)
    value = json.loads(text)
    assert set(value) == {"order", "urgent"} and len(value["order"]) == 4 and value["order"].isdigit()
    assert isinstance(value["urgent"], bool)
    assert " " not in text   # compact: no room for padding


def test_wrapped_and_repeated_values(tokenizer):
    structure = Structure(ORDER, begin="<tool_call>\n", end="\n</tool_call>", repeat=True)
    texts = [generate(tokenizer, structure, seed) for seed in range(4)]
    for text in texts:
        calls = text.split("\n<tool_call>\n")
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
        for call in calls:
            body = call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
            assert set(json.loads(body)) == {"order", "urgent"}


def test_no_schema_means_any_json_object(tokenizer):
    assert isinstance(json.loads(generate(tokenizer, Structure(), seed=5)), dict)


@pytest.mark.parametrize("schema, reason", [
    ({"type": 5}, "type must be a string"),
    ({"type": "string", "pattern": "(("}, "unclosed group"),
    ({"$ref": "#/$defs/missing"}, "does not exist"),
    (["not", "an", "object"], "must be a JSON object"),
])
def test_a_schema_that_cannot_compile_says_why(schema, reason):
    with pytest.raises(StructureError, match=reason):
        Structure(schema).check()
    with pytest.raises(StructureError, match=reason):
        Structure(schema, begin="<a>", end="</a>", repeat=True).check()


def test_an_oversized_schema_is_refused():
    schema = {"type": "object", "properties": {f"field{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(StructureError, match="longer than"):
        Structure(schema).check()


def test_the_job_form_round_trips():
    structure = Structure(ORDER, begin="<a>", end="</a>", repeat=True, separator=" ")
    assert Structure.from_json(json.loads(json.dumps(structure.to_json()))) == structure
    assert Structure.from_json(structure.to_json()).key == structure.key


@pytest.mark.parametrize("seed", range(3))
def test_a_regex_a_choice_and_a_lark_grammar_constrain_the_whole_answer(tokenizer, seed):
    import re
    text = generate(tokenizer, Structure(regex=r"NW-[0-9]{5}"), seed)
    assert re.fullmatch(r"NW-[0-9]{5}", text), text
    choices = ("shipped", "delivered", "a \"quoted\" \\ reply\n")
    assert generate(tokenizer, Structure(choice=choices), seed) in choices
    lark = 'start: "Order " ID " is " STATUS\nID: /[0-9]{4}/\nSTATUS: "late" | "on time"'
    assert re.fullmatch(r"Order [0-9]{4} is (late|on time)", generate(tokenizer, Structure(lark=lark), seed))


@pytest.mark.parametrize("structure, reason", [
    (Structure(regex="(("), "The regex cannot be used: .*unclosed group"),
    (Structure(choice=()), "one or more non-empty texts"),
    (Structure(choice=("yes", "")), "one or more non-empty texts"),
    (Structure(lark="start: missing_rule"), "The grammar cannot be used: .*missing_rule"),
])
def test_a_regex_choice_or_grammar_that_cannot_compile_says_why(structure, reason):
    with pytest.raises(StructureError, match=reason):
        structure.check()


def test_the_job_form_of_a_regex_a_choice_and_a_grammar_round_trips():
    for structure in (Structure(regex="[a-z]+"), Structure(choice=("yes", "no")), Structure(lark='start: "a"')):
        back = Structure.from_json(json.loads(json.dumps(structure.to_json())))
        assert back == structure and back.key == structure.key
    assert "regex" not in Structure(ORDER).to_json(), "a JSON constraint's form is as it was"
