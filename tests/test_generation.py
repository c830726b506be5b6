"""The generation request both tiers share (messaging/generation.py): its limits, wire form and the worker's reading."""

from __future__ import annotations

import math

import pytest

from messaging import generation as g
from messaging.generation import Generation, GenerationError
from messaging.jobs import service_class
from worker.engine import SamplingParams
from worker.engine.sequence import SERVICE_CLASSES
from worker.job import sampling_params


def test_the_defaults_pass_and_go_on_the_wire_as_a_version_and_a_class() -> None:
    Generation().check()
    assert Generation().to_wire() == {"v": g.VERSION, "service_class": "standard"}


@pytest.mark.parametrize(("field", "value"), [
    ("max_new_tokens", 0), ("max_new_tokens", g.MAX_TOKENS + 1), ("max_new_tokens", 1.5), ("max_new_tokens", True),
    ("temperature", -0.1), ("temperature", g.MAX_TEMPERATURE + 0.01), ("temperature", math.nan), ("temperature", "1"),
    ("top_p", 0), ("top_p", 1.01), ("top_k", -2), ("top_k", g.MAX_TOP_K + 1), ("min_p", 1.5),
    ("repetition_penalty", 0), ("repetition_penalty", g.MAX_REPETITION_PENALTY + 0.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.1), ("logit_bias", [1]), ("logit_bias", {"x": 1}),
    ("logit_bias", {5: 100.5}), ("logit_bias", {i: 1.0 for i in range(g.MAX_LOGIT_BIAS_ENTRIES + 1)}),
    ("seed", -1), ("seed", 2**63), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [""]),
    ("stop", ["x" * (g.MAX_STOP_CHARS + 1)]), ("stop", 5), ("n", 0), ("n", g.MAX_CHOICES + 1),
    ("logprobs", g.MAX_LOGPROBS + 1), ("prompt_logprobs", -1), ("service_class", "urgent"), ("min_tokens", -1),
    ("min_tokens", g.DEFAULT_MAX_TOKENS + 1), ("ignore_eos", "yes"), ("skip_special_tokens", 0),
    ("dry_multiplier", -0.1), ("dry_multiplier", g.MAX_DRY_MULTIPLIER + 1), ("dry_base", 0.9),
    ("dry_base", g.MAX_DRY_BASE + 1), ("dry_allowed_length", 0), ("dry_penalty_last_n", -2),
    ("dry_sequence_breakers", ["\n", ""]), ("dry_sequence_breakers", ["x" * (g.MAX_DRY_BREAKER_CHARS + 1)]),
    ("dry_sequence_breakers", [str(i) for i in range(g.MAX_DRY_BREAKERS + 1)]), ("dry_sequence_breakers", "\n"),
    ("dry_include_prompt", "no"),
])
def test_a_value_past_its_limit_is_refused_naming_its_field(field: str, value: object) -> None:
    with pytest.raises(GenerationError, match=field) as caught:
        Generation(**{field: value}).check()
    assert caught.value.field == field


def test_the_clients_own_name_is_the_one_reported() -> None:
    with pytest.raises(GenerationError, match="'max_tokens' must be an integer from 1 to 4096") as caught:
        Generation(max_new_tokens=5000).check(names={"max_new_tokens": "max_tokens"})
    assert caught.value.field == "max_tokens"


def test_a_lower_ceiling_binds_and_zero_tokens_only_score_a_prompt() -> None:
    with pytest.raises(GenerationError, match="from 1 to 100"):
        Generation(max_new_tokens=101).check(max_tokens=100)
    with pytest.raises(GenerationError, match="only scores the prompt"):
        Generation(max_new_tokens=0).check(min_max_tokens=0)
    Generation(max_new_tokens=0, prompt_logprobs=0).check(min_max_tokens=0)


def test_the_wire_form_round_trips_and_the_engine_takes_every_field() -> None:
    sent = Generation(max_new_tokens=7, temperature=0.3, top_k=5, min_p=0.1, repetition_penalty=1.2,
                      presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"42": -100}, seed=9,
                      stop=["END", "x" * g.MAX_STOP_CHARS], n=2, logprobs=3, service_class="interactive",
                      dry_multiplier=0.8, dry_allowed_length=3, dry_sequence_breakers=["\n", "User:"],
                      dry_include_prompt=False)
    sent.check()
    wire = sent.to_wire()
    assert wire["v"] == g.VERSION and wire["logit_bias"] == {"42": -100} and "top_p" not in wire
    read = Generation.from_wire(wire)
    assert read == sent and read.logit_bias == {42: -100}
    params = SamplingParams(**read.engine_fields())
    params.validate()   # the engine takes whatever the contract lets through
    assert params.stop == ("END", "x" * g.MAX_STOP_CHARS) and params.n == 2
    assert params.dry and params.dry_sequence_breakers == ("\n", "User:") and not params.dry_include_prompt
    assert wire["dry_sequence_breakers"] == ["\n", "User:"] and "dry_base" not in wire


def test_a_job_from_an_older_web_process_is_read_as_version_0() -> None:
    read = Generation.from_wire({"temperature": 0, "max_new_tokens": 20, "seed": 3, "stop": ["a"]})
    assert read == Generation(temperature=0, max_new_tokens=20, seed=3, stop=("a",))


@pytest.mark.parametrize(("wire", "says"), [
    ({"v": g.VERSION + 1}, "upgrade the worker before the web app"),
    ({"v": g.VERSION, "warp_factor": 9}, "warp_factor"),
    ({"v": g.VERSION, "stop": ["a"] * 9}, "stop"),
    ([1, 2], "must be an object"),
])
def test_the_worker_refuses_a_wire_form_it_cannot_read(wire, says: str) -> None:
    with pytest.raises(GenerationError, match=says):
        Generation.from_wire(wire)


def test_the_worker_builds_the_engines_params_and_class_from_a_job() -> None:
    job = {"params": Generation(max_new_tokens=5, service_class="interactive", stop=["y" * 150]).to_wire(),
           "structure": None}
    params = sampling_params(job)
    assert service_class(job) == "interactive"
    assert params.max_new_tokens == 5 and params.stop == ("y" * 150,)


def test_the_service_classes_are_the_engines() -> None:
    assert g.SERVICE_CLASSES == SERVICE_CLASSES


def test_dry_defaults_are_the_engines() -> None:
    engine = SamplingParams()
    assert {f: getattr(Generation(), f) for f in Generation().engine_fields() if f.startswith("dry_")} == \
        {f: getattr(engine, f) for f in vars(engine) if f.startswith("dry_")}
