"""The continuous-batching engine against plain `generate`, and its scheduling, cache and API rules."""

from __future__ import annotations

import copy
import logging
import queue
import threading

import pytest
import torch

from tests.markers import BF16
from worker.engine import attention, native
from worker.engine.sampler import Sampler
from worker.engine.fused import FusedLayers
from worker.engine import (EngineConfig, InvalidParamsError, InvalidRequestError, LLMEngine, RequestFinished,
                           SamplingParams, TokenDelta)
from worker.model_loader import load_model

SYSTEM = "You are a helpful customer-support assistant for an online shop."
QUESTIONS = [
    "Where is my parcel? It was due on Monday.",
    "Can I return shoes I have worn once?",
    "Do you ship to Canada?",
    "My coffee grinder arrived broken, the lid is cracked and the motor makes a grinding noise. What now?",
    "Hi",
    "How do I change the delivery address on an order I placed an hour ago, before it ships?",
    "Is the blue teapot back in stock?",
    "Thanks!",
]


def chat_ids(tokenizer, question: str, system: str | None = SYSTEM) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def greedy(cap: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=cap, **kw)


def reference(model, ids: list[int], cap: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=cap, do_sample=False)
    return out[0, len(ids):].tolist()


def drain(engine: LLMEngine, results: dict, deltas: dict | None = None) -> None:
    for event in engine.step():
        if isinstance(event, RequestFinished):
            results[event.request_id] = event
        elif deltas is not None:
            deltas.setdefault(event.request_id, []).append(event.text)


def run_all(engine: LLMEngine) -> tuple[dict[str, RequestFinished], dict[str, list[str]]]:
    results, deltas = {}, {}
    while engine.has_unfinished():
        drain(engine, results, deltas)
    return results, deltas


@pytest.fixture(autouse=True)
def no_fallbacks(request, caplog):
    """A step whose forward pass or sampler raised is rerun one request at a time and may still give the right
    tokens: outside the tests that inject such a failure, any of them fails the test."""
    yield
    if "failure_in_one_request" not in request.node.name:
        assert [r.getMessage() for r in caplog.get_records("setup") + caplog.get_records("call")
                if r.name == "worker.engine.engine" and r.levelno >= logging.ERROR] == []


@pytest.fixture()
def ref_model(tiny_model_dir):
    return load_model(str(tiny_model_dir))[0]


@pytest.mark.parametrize("weights", ["int4", "int8", BF16, "w8a8"])
def test_greedy_matches_generate_on_the_same_low_precision_model(tiny_model_dir, weights):
    """Greedy answers equal per-prompt `generate` on the same quantised model, with requests arriving
    mid-decode, chunked prefill and a shared prefix (the kernels give a row the same result whatever the batch)."""
    model, tok = load_model(str(tiny_model_dir), weights=weights)
    ref = load_model(str(tiny_model_dir), weights=weights)[0]
    assert model.weights_report.layers == {weights: 15}
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=3, max_num_batched_tokens=20, block_size=4,
                                                num_blocks=64, attention_backend="kernel"))
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:4]]
    caps = [16, 10, 14, 8]
    for i in range(2):
        engine.add_request(str(i), prompt_token_ids=prompts[i], params=greedy(caps[i]))
    results = {}
    for _ in range(4):
        drain(engine, results)
    for i in range(2, 4):
        engine.add_request(str(i), prompt_token_ids=prompts[i], params=greedy(caps[i]))
    results.update(run_all(engine)[0])
    assert sum(r.cached_tokens for r in results.values()) > 0
    for i, ids in enumerate(prompts):
        assert results[str(i)].token_ids == reference(ref, ids, caps[i]), f"{weights}: request {i} differs"


# ---- greedy equivalence ---------------------------------------------------------------------------

# Triton's kernels run in its interpreter here, seconds a step: their static buckets are checked once, overlapped (the
# buckets' own bookkeeping without overlap runs with flex and gather).
@pytest.mark.parametrize("packed,attn,eager,decode,overlap", [
    (True, "kernel", None, None, False), (True, "gather", None, None, False), (True, "flex", None, None, False),
    (False, "kernel", None, None, False), (True, "kernel", False, "flex", False),
    (True, "kernel", False, "gather", False), (True, "gather", False, "flex", False),
    (True, "kernel", None, None, True), (True, "kernel", False, "flex", True), (True, "triton", None, None, False),
    (False, "triton", False, "triton-compiled", False), (True, "triton", False, "triton", True)],
    ids=["packed-kernel", "packed-gather", "packed-flex", "dense-kernel", "static-buckets-flex", "static-buckets-gather",
         "static-buckets-flex-gather-in-place", "overlapped-kernel", "overlapped-static-buckets-flex", "triton",
         "static-buckets-triton-compiled", "overlapped-static-buckets-triton"])
def test_greedy_matches_generate_with_staggered_arrivals_preemption_and_shared_prefix(tiny, ref_model, packed, attn,
                                                                                      eager, decode, overlap):
    model, tok = tiny
    compiled = decode == "triton-compiled"
    decode = "triton" if compiled else decode
    # A small pool forces preemption; a small token budget forces chunked prefill.
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=4,
                                                num_blocks=44, pack_cpu_linears=packed, attention_backend=attn,
                                                enforce_eager=eager, decode_attention=decode, overlap_steps=overlap,
                                                compile_layers=compiled))
    assert engine.runner.attention_backend == attn or native.load() is None
    # gather reads cached context in place (as on CUDA) where the flex decoding kernel runs the decode graphs
    assert (engine.runner.paged is not None) == (attn == "flex" or (attn == "gather" and decode == "flex"))
    graphs = engine.runner.decode_graphs
    assert (graphs is not None) == (eager is False)
    if graphs is not None:   # decode steps of 3 run in bucket 4: one padding row
        assert graphs.sizes == ([2, 4] if compiled else [1, 2, 4]) and graphs.bucket(3) == 4
        assert graphs.attention_mode == decode
        assert (graphs.compiled is not None) == compiled, graphs.not_compiled
    assert engine.runner.compiled_eager == (compiled and attn == "triton"), engine.runner.not_compiled
    arrivals = {0: [0, 1, 2], 3: [3], 5: [4, 5], 9: [6], 14: [7]}
    caps = [30, 12, 25, 20, 30, 8, 27, 16]
    prompts = {str(i): chat_ids(tok, q, SYSTEM if i != 4 else None) for i, q in enumerate(QUESTIONS)}
    results, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), prompt_token_ids=prompts[str(i)], params=greedy(caps[i]))
        drain(engine, results)
        step += 1

    assert len(results) == len(QUESTIONS)
    for i in range(len(QUESTIONS)):
        got = results[str(i)]
        assert got.token_ids == reference(ref_model, prompts[str(i)], caps[i]), f"request {i} differs"
        assert got.finish_reason in ("stop", "length")
    # The scenario really exercised what it claims to.
    assert engine.stats().preemptions > 0
    assert any(r.preemptions for r in results.values())
    assert sum(r.cached_tokens for r in results.values()) > 0
    assert max(len(p) for p in prompts.values()) > 24
    assert engine.stats().kv_blocks_used == 0
    if graphs is not None:
        # Steps ran in more than one bucket, some with padding rows that never disturbed a real one.
        assert sum(1 for n in graphs.steps_per_bucket.values() if n) > 1 and graphs.padding_rows > 0


@pytest.mark.parametrize("arch,attn", [(arch, attn) for arch in ("qwen2", "qwen3", "gpt2") for attn in ("kernel", "gather")]
                         + [("qwen3", "flex")])
def test_greedy_matches_generate_on_other_architectures(arch, attn, tiny_model_dirs):
    model, tok = load_model(str(tiny_model_dirs[arch]))
    ref = load_model(str(tiny_model_dirs[arch]))[0]
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=3, max_num_batched_tokens=20, block_size=4,
                                                num_blocks=64, attention_backend=attn))
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:4]]
    for i, ids in enumerate(prompts[:2]):
        engine.add_request(str(i), prompt_token_ids=ids, params=greedy(15))
    results = {}
    for _ in range(4):
        drain(engine, results)
    for i, ids in enumerate(prompts[2:], start=2):
        engine.add_request(str(i), prompt_token_ids=ids, params=greedy(15))
    while engine.has_unfinished():
        drain(engine, results)
    for i, ids in enumerate(prompts):
        assert results[str(i)].token_ids == reference(ref, ids, 15), f"{arch} request {i} differs"


@pytest.mark.real_model
def test_greedy_matches_generate_on_the_real_default_model(real_model):
    model, tok = real_model
    ref = load_model()[0]
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64))
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:4]]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=ids, params=greedy(24))
    results, deltas = run_all(engine)
    for i, ids in enumerate(prompts):
        want = reference(ref, ids, 24)
        assert results[str(i)].token_ids == want, f"request {i} differs"
        assert "".join(deltas[str(i)]) == results[str(i)].text == tok.decode(want, skip_special_tokens=True)
    assert results["0"].text.strip(), "the real model should answer in words"


@pytest.mark.real_model
@pytest.mark.skipif(native.load() is None, reason="no C compiler for the paged-attention kernel")
@pytest.mark.parametrize("weights", ["int4", "int8", BF16, "w8a8"])
def test_greedy_matches_generate_on_the_kernels_attention_on_the_real_model_at_each_precision(weights):
    """At low precision on the default model, SDPA's last bits differ from the kernel's (and from its own at another
    prompt length), and rounding each layer's input magnifies them until some greedy answers part. `generate` on
    the kernel's arithmetic leaves the engine's own work to differ: packing beside other requests arriving
    mid-decode, chunked prefill, a cached shared prefix, paging. None of it may change a token."""
    model, tok = load_model(weights=weights)
    # A copy before the engine takes the model over is seconds quicker than loading it again; bfloat16's linears hold
    # oneDNN-packed weights, which torch cannot copy.
    ref = load_model(weights=weights)[0] if weights == "bfloat16" else copy.deepcopy(model)
    attention.register()
    ref.set_attn_implementation(attention.KERNEL_REFERENCE)
    FusedLayers(ref, reference=True)   # the layers' elementwise work in the same C kernels as the engine's
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=5, max_num_batched_tokens=40, block_size=16,
                                                attention_backend="kernel"))
    assert engine.runner.fused is not None
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    caps = [40, 24, 32, 40, 16, 40, 24, 16]
    results: dict = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=ids, params=greedy(caps[i]))
        for _ in range(i % 3):
            drain(engine, results)
    results.update(run_all(engine)[0])
    assert sum(r.cached_tokens for r in results.values()) > 0
    for i, ids in enumerate(prompts):
        assert results[str(i)].token_ids == reference(ref, ids, caps[i]), f"{weights}: request {i} differs"


# ---- decode steps through the static buffers and block tables that persist ------------------------------

def compiled_decode_shapes() -> list[list[int | None]]:
    """The query shape of each compiled variant of the flex decode form, read from dynamo's cache entries and
    their guards; None marks a dimension compiled symbolic, which the Triton decoding kernel cannot take."""
    import re

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from worker.engine.attention import flex

    shapes = []
    for entry in _debug_get_cache_entry_list(flex._decode_call.__code__):
        size = re.search(r"check_tensor\(L\['query'\].*?size=\[([^\]]*)\]", str(entry.guard_manager)).group(1)
        shapes.append([None if x.strip() == "None" else int(x) for x in size.split(",")])
    return shapes


def test_every_decode_bucket_runs_a_statically_compiled_kernel_and_matches_generate(tiny, ref_model):
    """Buckets 1, 2, 4 and 6 run the decode form compiled for 1, 4 and 6 rows, each with static shapes: never a
    variant with a symbolic row count (on CUDA that one would leave FlexAttention's decoding kernel)."""
    from worker.engine.attention import flex

    model, tok = tiny
    flex.start_engine()   # no compiled variants left from other tests
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=6, max_num_batched_tokens=64, block_size=4,
                                                num_blocks=203, enforce_eager=False, decode_attention="flex"))
    graphs = engine.runner.decode_graphs
    assert graphs.sizes == [1, 2, 4, 6] and graphs.paged.sizes == [1, 4, 6]
    caps = [2, 5, 8, 11, 14, 17]   # the decode batch shrinks one by one: every bucket runs
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:6]]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=ids, params=greedy(caps[i]))
    results, _ = run_all(engine)
    for i, ids in enumerate(prompts):
        assert results[str(i)].token_ids == reference(ref_model, ids, caps[i]), f"request {i} differs"
    assert all(graphs.steps_per_bucket[b] for b in graphs.sizes), graphs.steps_per_bucket
    shapes = compiled_decode_shapes()
    assert all(None not in shape for shape in shapes), shapes
    assert sorted(shape[0] for shape in shapes) == [1, 4, 6]


@pytest.mark.parametrize("decode", ["flex", "gather"])
def test_a_steady_decode_writes_block_ids_only_on_block_boundaries(tiny, decode):
    model, tok = tiny
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:4]]

    def engine_with(eager: bool) -> LLMEngine:
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, block_size=4,
                                                    num_blocks=200, enforce_eager=eager, decode_attention=decode))
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), prompt_token_ids=ids, params=greedy(30, ignore_eos=True))
        return engine

    engine = engine_with(False)
    runner = engine.runner
    tables = runner.decode_graphs.paged.slots if decode == "flex" else runner.decode_graphs.tables
    bs = 4

    def ids_in_use(context: int) -> int:   # a decode row's ids: full blocks (flex), every block covering it (gather)
        return (context - 1) // bs if decode == "flex" else -(-context // bs)

    results = {}
    drain(engine, results)   # all four prefilled in one step
    seqs = list(engine.seqs.values())
    drain(engine, results)   # the first decode step writes each row whole
    assert tables.entries_written == sum(ids_in_use(seq.num_tokens - 1) for seq in seqs)
    writes = []
    for _ in range(20):
        contexts = {seq: seq.num_tokens for seq in seqs}   # what this step's rows attend
        before = tables.entries_written
        drain(engine, results)
        writes.append(tables.entries_written - before)
        assert writes[-1] == sum(ids_in_use(c) - ids_in_use(c - 1) for c in contexts.values())
        for seq in seqs:   # each device row holds its sequence's ids in use, in the row the sequence keeps
            count = ids_in_use(contexts[seq])
            assert tables.tables[runner.row_order.row(seq), :count].tolist() == seq.block_table[:count]
    assert sum(writes) == 4 * 20 // bs   # one id per row every block_size steps, where rebuilding wrote them all
    finished, _ = run_all(engine)
    eager = engine_with(True)
    want, _ = run_all(eager)
    assert {r: f.token_ids for r, f in finished.items()} == {r: f.token_ids for r, f in want.items()}


def test_mixed_steps_read_a_long_row_and_cached_prefixes_in_place_and_match_generate(tiny_model_dirs, tokenizer):
    """The gather backend as on CUDA (with flex decode graphs): long prompts prefilled in chunks beside decodes,
    chunks whose prefix is cached read it in place; every answer equals generate."""
    from tests.tiny_model import make_tiny_model_dir

    root = tiny_model_dirs["llama"].parent / "llama-long"
    if not root.exists():
        make_tiny_model_dir(root, tokenizer, "llama", max_position_embeddings=2048)
    model, tok = load_model(str(root))
    ref = load_model(str(root))[0]
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=6, max_num_batched_tokens=96, block_size=4,
                                                num_blocks=800, attention_backend="gather", enforce_eager=False,
                                                decode_attention="flex"))
    paged = engine.runner.paged
    assert paged is engine.runner.decode_graphs.paged
    long_ids = chat_ids(tok, " ".join(QUESTIONS * 8))
    assert len(long_ids) > 600
    prompts = {"short0": chat_ids(tok, QUESTIONS[0]), "short1": chat_ids(tok, QUESTIONS[1]),
               "short2": chat_ids(tok, QUESTIONS[2]), "long": long_ids,
               "long-again": long_ids[:-7] + chat_ids(tok, "Thanks!", system=None)}
    caps = {"short0": 40, "short1": 40, "short2": 30, "long": 12, "long-again": 10}
    results, step = {}, 0
    for rid in ("short0", "short1", "short2", "long"):
        engine.add_request(rid, prompt_token_ids=prompts[rid], params=greedy(caps[rid]))
    while engine.has_unfinished():
        if step == 14:   # shares the long prompt's blocks, once they are cached: chunks over a cached prefix
            engine.add_request("long-again", prompt_token_ids=prompts["long-again"], params=greedy(caps["long-again"]))
        drain(engine, results)
        step += 1
    for rid, ids in prompts.items():
        assert results[rid].token_ids == reference(ref, ids, caps[rid]), rid
    assert results["long-again"].cached_tokens > 600
    assert paged.logical is not None   # a chunk with a cached prefix went through FlexAttention's prefill form


# ---- scheduling ------------------------------------------------------------------------------------

def test_a_freed_slot_is_refilled_in_the_next_step(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, num_blocks=32))
    engine.add_request("a", prompt_token_ids=chat_ids(tok, "Hi"), params=greedy(3, ignore_eos=True))
    engine.add_request("b", prompt_token_ids=chat_ids(tok, "Hello"), params=greedy(2, ignore_eos=True))
    results = {}
    for _ in range(3):   # a: one prefill step (first token) and two decode steps
        drain(engine, results)
        assert engine.stats().waiting == 1
    assert results["a"].finish_reason == "length"
    drain(engine, results)
    assert engine.stats().running == 1 and engine.stats().last_batch_seqs == 1   # b started at once
    drain(engine, results)
    assert results["b"].completion_tokens == 2 and engine.steps == 5


def test_requests_are_admitted_in_order_of_arrival_not_of_submission(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, num_blocks=32))
    for rid, arrived in (("late", 30.0), ("first", 10.0), ("second", 20.0)):
        engine.add_request(rid, prompt_token_ids=chat_ids(tok, "Hi"), params=greedy(1, ignore_eos=True),
                           arrival_time=arrived)
    order = []
    while engine.has_unfinished():
        order += [e.request_id for e in engine.step() if isinstance(e, RequestFinished)]
    assert order == ["first", "second", "late"]


def test_long_prompt_is_prefilled_in_chunks_without_stalling_decodes(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, num_blocks=64,
                                                enable_prefix_caching=False))
    engine.add_request("short", prompt_token_ids=chat_ids(tok, "Hi"), params=greedy(40, ignore_eos=True))
    results = {}
    while engine.seqs["short"].num_uncomputed > 1:
        drain(engine, results)
    long_ids = chat_ids(tok, " ".join(QUESTIONS))
    engine.add_request("long", prompt_token_ids=long_ids, params=greedy(2, ignore_eos=True))
    steps = 0
    while engine.seqs["long"].num_completion_tokens == 0:
        before = engine.seqs["short"].num_completion_tokens
        drain(engine, results)
        steps += 1
        assert engine.seqs["short"].num_completion_tokens == before + 1, "the decode starved"
        assert engine.stats().last_batch_tokens <= 16
    assert steps == -(-len(long_ids) // 15)   # 15 tokens of prefill beside the one decode per step


def test_a_request_that_does_not_fit_the_pool_waits(tiny):
    model, tok = tiny
    ids = chat_ids(tok, "Where is my parcel?")
    prompt_blocks, blocks = -(-len(ids) // 16), -(-(len(ids) + 10) // 16)
    assert 2 * prompt_blocks > blocks, "both prompts must not fit at once"
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, num_blocks=blocks, enable_prefix_caching=False))
    engine.add_request("first", prompt_token_ids=ids, params=greedy(10, ignore_eos=True))
    engine.add_request("second", prompt_token_ids=ids, params=greedy(10, ignore_eos=True))
    results = {}
    drain(engine, results)
    assert engine.stats().running == 1 and engine.stats().waiting == 1
    results, _ = run_all(engine)
    assert results["second"].admitted_time >= results["first"].finished_time
    assert results["first"].token_ids == results["second"].token_ids


def test_a_sequence_larger_than_the_whole_pool_ends_with_length(tiny):
    model, tok = tiny
    ids = chat_ids(tok, "Hi", system=None)
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, block_size=16, num_blocks=3))
    engine.add_request("big", prompt_token_ids=ids, params=greedy(200, ignore_eos=True))
    results, _ = run_all(engine)
    assert results["big"].finish_reason == "length"
    # 48 cached positions; the last sampled token needed no slot of its own.
    assert results["big"].prompt_tokens + results["big"].completion_tokens == 3 * 16 + 1


def test_abort_frees_the_slot_and_blocks(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1, num_blocks=32, enable_prefix_caching=False))
    engine.add_request("a", prompt_token_ids=chat_ids(tok, "Hi"), params=greedy(50, ignore_eos=True))
    engine.add_request("b", prompt_token_ids=chat_ids(tok, "Hello"), params=greedy(5, ignore_eos=True))
    results = {}
    for _ in range(3):
        drain(engine, results)
    assert engine.stats().kv_blocks_used > 0 and engine.stats().waiting == 1
    events = engine.abort_request("a")
    assert isinstance(events[-1], RequestFinished) and events[-1].finish_reason == "cancelled"
    assert events[-1].completion_tokens == 3
    assert engine.stats().kv_blocks_used == 0 and engine.stats().running == 0
    drain(engine, results)
    assert engine.stats().running == 1   # b took the slot
    assert engine.abort_request("unknown") == []


def test_prefix_cache_serves_the_shared_system_prompt(tiny, ref_model):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, block_size=4, num_blocks=128))
    first, second = chat_ids(tok, QUESTIONS[0]), chat_ids(tok, QUESTIONS[1])
    shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)
    engine.add_request("1", prompt_token_ids=first, params=greedy(5))
    run_all(engine)
    engine.add_request("2", prompt_token_ids=second, params=greedy(5))
    results, _ = run_all(engine)
    assert results["2"].cached_tokens == shared // 4 * 4 > 0
    assert engine.stats().prefix_cache_hit_tokens == results["2"].cached_tokens
    assert results["2"].token_ids == reference(ref_model, second, 5)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_the_next_turn_reuses_the_blocks_the_last_answer_filled(tiny, ref_model, overlap):
    """A conversation's next prompt holds the last answer: the blocks its decode steps filled are shared too."""
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, block_size=4, num_blocks=128, overlap_steps=overlap))
    first = chat_ids(tok, QUESTIONS[0])
    engine.add_request("1", prompt_token_ids=first, params=greedy(21, ignore_eos=True))
    answer = run_all(engine)[0]["1"].token_ids
    follow_up = first + answer + chat_ids(tok, "And when will it arrive?", system=None)
    engine.add_request("2", prompt_token_ids=follow_up, params=greedy(5))
    results, _ = run_all(engine)
    # Every block the first request filled, whose last (21st) token was sampled but never computed.
    assert results["2"].cached_tokens == (len(first) + 20) // 4 * 4
    assert results["2"].token_ids == reference(ref_model, follow_up, 5)


def test_identical_prompt_never_skips_its_last_token(tiny, ref_model):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64))
    ids = chat_ids(tok, "Hi")[:16]   # a whole number of blocks
    for rid in ("x", "y"):
        engine.add_request(rid, prompt_token_ids=ids, params=greedy(4))
        results, _ = run_all(engine)
    assert results["y"].cached_tokens == 12
    assert results["y"].token_ids == reference(ref_model, ids, 4)


# ---- bad input ---------------------------------------------------------------------------------------

def test_prompt_over_the_context_is_refused_with_a_clear_error(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_model_len=64, num_blocks=64))
    with pytest.raises(InvalidRequestError, match=r"80 tokens.*context holds 64.*Shorten"):
        engine.add_request("long", prompt_token_ids=list(range(100, 180)))
    assert not engine.has_unfinished()


def test_invalid_requests_are_refused_at_submission(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=16))
    with pytest.raises(InvalidParamsError, match="temperature"):
        engine.add_request("a", prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=-1))
    with pytest.raises(InvalidParamsError, match="top_p"):
        engine.add_request("a", prompt_token_ids=[1, 2, 3], params=SamplingParams(top_p=0))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", prompt_token_ids=[])
    with pytest.raises(InvalidRequestError, match="exactly one"):
        engine.add_request("a")
    with pytest.raises(InvalidRequestError, match="KV cache holds only 256"):
        engine.add_request("a", prompt_token_ids=list(range(100, 400)))
    engine.add_request("a", prompt_token_ids=[1, 2, 3], params=greedy(2))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", prompt_token_ids=[1, 2, 3])
    assert len(engine.seqs) == 1


def test_engine_config_is_validated(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLMEngine(model, tok, EngineConfig(max_num_seqs=0))
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        LLMEngine(model, tok, EngineConfig(max_num_seqs=64, max_num_batched_tokens=32))
    with pytest.raises(ValueError, match="sampler_candidates"):
        LLMEngine(model, tok, EngineConfig(sampler_candidates=-1))


# ---- sampling through the engine ------------------------------------------------------------------------

def test_same_seed_same_output_whatever_shares_the_batch(tiny):
    model, tok = tiny
    ids = chat_ids(tok, "Recommend a teapot")
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, repetition_penalty=1.2, seed=7,
                            max_new_tokens=20, ignore_eos=True)

    def run(extra: int, seed: int = 7, candidates: int | None = None) -> list[int]:
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, num_blocks=64, sampler_candidates=candidates))
        for j in range(extra):
            engine.add_request(f"other{j}", prompt_token_ids=chat_ids(tok, QUESTIONS[j]),
                               params=SamplingParams(temperature=1.3, max_new_tokens=25))
        engine.add_request("me", prompt_token_ids=ids,
                           params=SamplingParams(**{**params.__dict__, "seed": seed}))
        return run_all(engine)[0]["me"].token_ids

    alone = run(0)
    assert run(3) == alone
    assert run(0, seed=8) != alone
    # The top-k/top-p cut-off found by a full sort draws the same tokens as among the best candidates.
    assert run(3, candidates=0) == alone


def test_seeded_request_is_batch_independent_in_any_arrival_order_and_unseeded_ones_vary(tiny):
    model, tok = tiny
    mine = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=11,
                          max_new_tokens=16, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True)

    def run(before: int, after: int) -> dict[str, list[int]]:
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, num_blocks=96))
        for j in range(before):
            engine.add_request(f"b{j}", prompt_token_ids=chat_ids(tok, QUESTIONS[j]), params=unseeded)
        engine.add_request("me", prompt_token_ids=chat_ids(tok, "Recommend a teapot"), params=mine)
        for j in range(after):
            engine.add_request(f"a{j}", prompt_token_ids=chat_ids(tok, QUESTIONS[j]),
                               params=SamplingParams(temperature=0.0, max_new_tokens=10))
        return {rid: r.token_ids for rid, r in run_all(engine)[0].items()}

    alone = run(0, 0)["me"]
    first, second = run(2, 1), run(1, 2)
    assert first["me"] == second["me"] == alone
    # Same prompt, same parameters, no seed: drawn differently each time.
    assert first["b0"] != second["b0"]
    # Greedy batch mates are unaffected by sampled ones.
    assert first["a0"] == second["a0"]


def test_the_chats_sampling_draws_the_same_alone_as_beside_another_request(tiny, two_threads):
    """Top-p without top-k (the chat's) normalises by the whole row's mass. At two threads torch's sum adds a lone
    row in another order than a row in a batch; with it, this request's 26th token alone differed on a Xeon."""
    model, tok = tiny
    chat = SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_new_tokens=40, ignore_eos=True)

    def run(mates: list[int]) -> list[int]:
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4))
        for i in [*mates, 0]:
            engine.add_request(f"r{i}", prompt_token_ids=chat_ids(tok, QUESTIONS[i]),
                               params=SamplingParams(**{**chat.__dict__, "seed": 11 + i}))
        return run_all(engine)[0]["r0"].token_ids

    assert run([1]) == run([])


def test_greedy_with_repetition_penalty_matches_generate(tiny, ref_model):
    model, tok = tiny
    ids = chat_ids(tok, QUESTIONS[3])
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=64))
    engine.add_request("p", prompt_token_ids=ids, params=greedy(20, repetition_penalty=1.5))
    got = run_all(engine)[0]["p"].token_ids
    want = ref_model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                              repetition_penalty=1.5)[0, len(ids):].tolist()
    assert got == want


# ---- overlapped steps ----------------------------------------------------------------------------------------

def test_overlapped_steps_give_the_same_answers_and_stream(tiny_model_dir):
    """Tokens left on the device for a step change when they are streamed, never what is streamed: sampled,
    penalised, stopped and cut answers come out as without overlap, and a finish found a step late loses
    nothing to the row the next pass already ran."""
    def engine(overlap: bool, eager: bool | None = None) -> LLMEngine:
        model, tok = load_model(str(tiny_model_dir))
        return LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                                                  num_blocks=48, enforce_eager=eager, overlap_steps=overlap))

    plain = engine(False)
    tok = plain.tokenizer
    prompts = {str(i): chat_ids(tok, q) for i, q in enumerate(QUESTIONS[:6])}
    params = {"0": greedy(30, ignore_eos=True),
              "1": SamplingParams(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=3,
                                  max_new_tokens=25, ignore_eos=True),
              "2": greedy(30, ignore_eos=True), "3": greedy(12, repetition_penalty=1.5),
              "4": SamplingParams(temperature=1.2, seed=5, max_new_tokens=20, ignore_eos=True),
              "5": greedy(24, ignore_eos=True)}
    for rid, ids in prompts.items():
        plain.add_request(rid, prompt_token_ids=ids, params=params[rid])
    full = run_all(plain)[0]["2"].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    params["2"] = greedy(30, ignore_eos=True, stop=[stop])

    def answers(e: LLMEngine) -> tuple[dict, dict]:
        for rid, ids in prompts.items():   # six requests in four slots: two wait for a finish
            e.add_request(rid, prompt_token_ids=ids, params=params[rid])
        results, deltas = run_all(e)
        return ({rid: (r.token_ids, r.text, r.finish_reason) for rid, r in results.items()},
                {rid: "".join(d) for rid, d in deltas.items()})

    for penalties in (True, False):   # a penalty reads the token still in flight from the device
        if not penalties:
            params = {rid: SamplingParams(**{**p.__dict__, "repetition_penalty": 1.0}) for rid, p in params.items()}
        want = answers(engine(False))
        assert want[0]["2"][2] == "stop" and want[0]["2"][1] == full[:full.index(stop)]
        for overlapped in (engine(True), engine(True, eager=False)):
            assert answers(overlapped) == want
            assert overlapped.stats().kv_blocks_used == 0 and not overlapped.has_unfinished()


def test_overlapped_steps_under_a_random_mix_of_requests_arrivals_and_cancels(tiny_model_dir):
    """Random parameters, arrivals and cancels on a pool small enough to preempt: every request that was not
    cancelled ends exactly as without overlap, and a cancelled one keeps a prefix of that answer."""
    import random

    rng = random.Random(7)
    tok = load_model(str(tiny_model_dir))[1]
    plans = []
    for i in range(18):
        kind = rng.choice(["greedy", "sampled", "penalised"])
        params = dict(max_new_tokens=rng.randint(3, 28), ignore_eos=rng.random() < 0.5, seed=i)
        if kind != "greedy":
            params.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 20]))
        if kind == "penalised":
            params["repetition_penalty"] = rng.choice([1.2, 0.8])
        if rng.random() < 0.4:
            params["stop"] = [rng.choice(["e", "a", "."])]
        plans.append((str(i), chat_ids(tok, rng.choice(QUESTIONS), rng.choice([SYSTEM, None])),
                      SamplingParams(**params), rng.randint(0, 20), rng.randint(2, 30) if rng.random() < 0.3 else None))

    def run(overlap: bool) -> dict[str, RequestFinished]:
        model, tok = load_model(str(tiny_model_dir))
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=5, max_num_batched_tokens=40, block_size=4,
                                                    num_blocks=36, overlap_steps=overlap))
        results, step = {}, 0
        while step <= 60 or engine.has_unfinished():
            for rid, ids, params, arrive, cancel in plans:
                if step == arrive:
                    engine.add_request(rid, prompt_token_ids=ids, params=params)
                if cancel is not None and step == arrive + cancel:
                    results.update((e.request_id, e) for e in engine.abort_request(rid)
                                   if isinstance(e, RequestFinished))
            drain(engine, results)
            step += 1
        assert engine.stats().kv_blocks_used == 0 and engine.stats().preemptions > 0
        return results

    plain, overlapped = run(False), run(True)
    assert set(plain) == set(overlapped) == {rid for rid, *_ in plans}
    assert {"stop", "length", "cancelled"} <= {r.finish_reason for r in plain.values()}   # the mix is a mix
    for rid in plain:
        a, b = plain[rid], overlapped[rid]
        if "cancelled" in (a.finish_reason, b.finish_reason):
            shorter, longer = sorted((a.token_ids, b.token_ids), key=len)
            assert longer[:len(shorter)] == shorter, rid
        else:
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), rid


def test_an_overlapped_request_cancelled_in_flight_keeps_only_tokens_read_back(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, num_blocks=64, overlap_steps=True))
    engine.add_request("a", prompt_token_ids=chat_ids(tok, QUESTIONS[0]), params=greedy(30, ignore_eos=True))
    deltas = []
    for _ in range(3):   # prefill, then two decodes: each step reads back the one before it
        deltas += [e for e in engine.step() if isinstance(e, TokenDelta)]
    seq = engine.seqs["a"]
    assert seq.pending is not None and seq.token_ids[-1] < 0   # the third step's token is still in flight
    finished = [e for e in engine.abort_request("a") if isinstance(e, RequestFinished)][0]
    assert finished.finish_reason == "cancelled"
    assert finished.token_ids == [t for d in deltas for t in d.token_ids] and len(finished.token_ids) == 2
    assert all(t >= 0 for t in finished.token_ids)
    assert engine.step() == [] and not engine.has_unfinished() and engine.stats().kv_blocks_used == 0


def test_overlapped_steps_are_off_by_default_on_cpu(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=64))
    assert engine.config.overlap_steps is False   # resolved from the device's default
    engine.add_request("a", prompt_token_ids=chat_ids(tok, QUESTIONS[0]), params=greedy(5))
    assert [e.token_ids for e in engine.step() if isinstance(e, TokenDelta)] != []   # tokens come out at once
    assert engine.seqs["a"].pending is None


# ---- streaming text --------------------------------------------------------------------------------------

def test_deltas_add_up_to_the_final_text(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, num_blocks=64))
    for i, q in enumerate(QUESTIONS[:4]):
        engine.add_request(str(i), prompt_token_ids=chat_ids(tok, q), params=greedy(30))
    results, deltas = run_all(engine)
    for rid, done in results.items():
        assert "".join(deltas[rid]) == done.text == tok.decode(done.token_ids, skip_special_tokens=True)
        assert all("\ufffd" not in d for d in deltas[rid]) or "\ufffd" in done.text


def test_stop_string_ends_the_answer_and_is_never_streamed(tiny):
    model, tok = tiny
    ids = chat_ids(tok, QUESTIONS[2])
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=64))
    engine.add_request("full", prompt_token_ids=ids, params=greedy(30, ignore_eos=True))
    full = run_all(engine)[0]["full"].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full.index(stop)
    engine.add_request("cut", prompt_token_ids=ids, params=greedy(30, ignore_eos=True, stop=[stop, "\x00never"]))
    results, deltas = run_all(engine)
    assert results["cut"].finish_reason == "stop"
    assert results["cut"].text == full[:cut] == "".join(deltas["cut"])


def detokenizer(tokenizer, mode: str, stop: tuple[str, ...] = ()):
    """The default tokenizer's streaming decoder, or the windowed decoding that other tokenizers get."""
    from worker.engine.detokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, stop)
    assert detok.stream is not None, "the default tokenizer should stream"
    if mode == "window":
        detok.stream = None
    return detok


@pytest.mark.parametrize("mode", ["stream", "window"])
def test_multibyte_characters_are_never_split(tokenizer, mode):
    text = "Grüße aus Köln 👋 — 東京への配送は3日です 🚚📦 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = detokenizer(tokenizer, mode)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1], "some token should end inside a character, or this test proves nothing"


@pytest.mark.parametrize("mode", ["stream", "window"])
def test_an_answer_cut_inside_a_character_shows_what_it_has(tokenizer, mode):
    ids = tokenizer.encode("ok 👋", add_special_tokens=False)
    detok = detokenizer(tokenizer, mode)
    shown = "".join(detok.push([i]) for i in ids[:-1])
    assert shown == "ok"   # the emoji's first bytes are held
    assert shown + detok.flush() == tokenizer.decode(ids[:-1]) == detok.text
    assert detok.text.endswith("\ufffd")


@pytest.mark.parametrize("mode", ["stream", "window"])
def test_held_back_text_is_released_when_it_is_not_a_stop(tokenizer, mode):
    detok = detokenizer(tokenizer, mode, stop=("ORDER-END",))
    ids = tokenizer.encode("Your ORDER-EN is ready, ORDER-END and more", add_special_tokens=False)
    shown = []
    for i in ids:
        shown.append(detok.push([i]))
        if "".join(shown).endswith("ORDER") or "".join(shown).endswith("ORDER-"):
            pytest.fail("a possible start of the stop string was shown early")
    shown.append(detok.flush())
    assert "".join(shown) == "Your ORDER-EN is ready, " and detok.stopped
    assert detok.push(tokenizer.encode(" more", add_special_tokens=False)) == ""


@pytest.mark.parametrize("mode", ["stream", "window"])
@pytest.mark.parametrize("stop", [(), ("ORDER-END", "\n\n"), ("\n", "<tool", "😀x")])
def test_pushing_one_token_shows_what_pushing_a_list_of_one_shows(tokenizer, mode, stop):
    """The engine pushes each row's token with push_token, the common case written out; its deltas, held-back text
    and stop are push's."""
    text = "Grüße 👋 ORDER-EN, Your ORDER-END\nnext 😀 <to <tool\n\nend 😀x and more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    one, listed = detokenizer(tokenizer, mode, stop), detokenizer(tokenizer, mode, stop)
    for i, token in enumerate(ids):
        one.armed = listed.armed = i > 3   # stop strings looked for after min_tokens, as the engine does
        assert one.push_token(token) == listed.push([token]), f"token {i}"
        assert (one.text, one.emitted, one.stopped) == (listed.text, listed.emitted, listed.stopped)
    assert one.flush() == listed.flush()
    assert one.stopped == bool(stop)

# ---- threaded API ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_threaded_submit_stream_and_cancel(tiny, overlap):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, num_blocks=64, overlap_steps=overlap))
    engine.start()
    try:
        finals, texts = {}, {}

        def consume(i: int) -> None:
            stream = engine.submit(f"t{i}", messages=[{"role": "user", "content": QUESTIONS[i]}],
                                   params=greedy(400 if i == 0 else 12, ignore_eos=True))
            parts = []
            for event in stream:
                if isinstance(event, TokenDelta):
                    parts.append(event.text)
                    if i == 0 and len(parts) == 3:
                        stream.cancel()
                else:
                    finals[i] = event
            texts[i] = "".join(parts)

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert finals[0].finish_reason == "cancelled" and finals[0].completion_tokens < 400
        assert finals[1].finish_reason == finals[2].finish_reason == "length"
        assert all(texts[i] == finals[i].text for i in range(3))
        with pytest.raises(InvalidParamsError):
            engine.submit("bad", prompt_token_ids=[1, 2], params=SamplingParams(max_new_tokens=0))
        stats = engine.stats()
        assert stats.running == 0 and stats.kv_blocks_used == 0
    finally:
        engine.shutdown()


def test_an_outbox_gets_each_step_of_every_request_sharing_it_as_one_list(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, num_blocks=64))
    outbox: queue.Queue = queue.Queue()
    for i in range(3):   # the same requests in the synchronous API, for comparison
        engine.add_request(f"o{i}", prompt_token_ids=chat_ids(tok, QUESTIONS[i]), params=greedy(6 + i, ignore_eos=True))
    alone = run_all(engine)[0]
    engine.start()
    try:
        for i in range(3):
            engine.submit(f"o{i}", prompt_token_ids=chat_ids(tok, QUESTIONS[i]), params=greedy(6 + i, ignore_eos=True),
                          outbox=outbox)
        steps, finals = [], {}
        while len(finals) < 3:
            steps.append(outbox.get(timeout=60))
            finals.update({e.request_id: e for e in steps[-1] if isinstance(e, RequestFinished)})
    finally:
        engine.shutdown()
    assert any(len({e.request_id for e in step}) > 1 for step in steps), "a step's events should come together"
    for rid, final in finals.items():
        text = "".join(e.text for step in steps for e in step if isinstance(e, TokenDelta) and e.request_id == rid)
        assert text == final.text and final.token_ids == alone[rid].token_ids


def test_launch_builds_the_engine_in_the_thread_that_runs_it(tiny):
    model, tok = tiny
    built_in = []

    def build() -> LLMEngine:
        built_in.append(threading.current_thread())
        return LLMEngine(model, tok, EngineConfig(max_num_seqs=2, num_blocks=64))

    engine = LLMEngine.launch(build)
    try:
        assert built_in == [engine._thread] and built_in[0] is not threading.current_thread()
        final = [e for e in engine.submit("a", prompt_token_ids=chat_ids(tok, "Hi"), params=greedy(5))][-1]
        assert final.finish_reason == "length" and final.completion_tokens == 5
    finally:
        engine.shutdown()
    assert not built_in[0].is_alive()


def test_launch_raises_what_the_build_raised():
    def build() -> LLMEngine:
        raise FileNotFoundError("no such model: ./nowhere")

    with pytest.raises(FileNotFoundError, match="nowhere"):
        LLMEngine.launch(build)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_step_that_fails_outside_any_request_ends_its_requests_and_the_engine_goes_on(tiny, overlap, monkeypatch,
                                                                                        caplog):
    """A device fault, say, surfacing where no single request can be blamed: the requests it held end with an
    error instead of waiting forever, and the next requests are served."""
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, num_blocks=64, overlap_steps=overlap))
    schedule, steps = engine.scheduler.schedule, []

    def schedule_failing_once():
        steps.append(1)
        if len(steps) == 4:
            raise RuntimeError("forced device fault")
        return schedule()
    monkeypatch.setattr(engine.scheduler, "schedule", schedule_failing_once)
    engine.start()
    try:
        streams = [engine.submit(f"r{i}", prompt_token_ids=chat_ids(tok, QUESTIONS[i]), params=greedy(30))
                   for i in range(2)]
        finals = [list(stream)[-1] for stream in streams]
        assert [f.finish_reason for f in finals] == ["error", "error"]
        assert "forced device fault" in finals[0].error and "retry" in finals[0].error
        assert all(t >= 0 for f in finals for t in f.token_ids)
        after = list(engine.submit("next", prompt_token_ids=chat_ids(tok, QUESTIONS[2]), params=greedy(5)))[-1]
        assert after.finish_reason == "length" and after.completion_tokens == 5
        assert engine.stats().kv_blocks_used == 0
    finally:
        engine.shutdown()
    assert any("engine step failed" in r.getMessage() for r in caplog.records)
    caplog.clear()   # logged, as it should be: not a silent fallback


def test_shutdown_ends_open_streams_with_an_error(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1, num_blocks=64))
    engine.start()
    stream = engine.submit("slow", prompt_token_ids=chat_ids(tok, "Hi"), params=greedy(10_000, ignore_eos=True))
    first = next(iter(stream))
    assert isinstance(first, TokenDelta)
    engine.shutdown()
    final = [e for e in stream][-1]
    assert final.finish_reason == "error" and "retry" in final.error
    with pytest.raises(RuntimeError, match="start"):
        engine.submit("late", prompt_token_ids=[1, 2, 3])


def test_shutdown_fails_requests_that_were_never_scheduled(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1, num_blocks=64))
    engine.start()
    with engine._lock:   # hold the loop back so the requests stay in the inbox
        streams = [engine.submit(f"q{i}", prompt_token_ids=chat_ids(tok, "Hi"), params=greedy(5)) for i in range(3)]
        engine._stopping = True
        engine._lock.notify()
    engine.shutdown()
    for stream in streams:
        final = list(stream)[-1]
        assert isinstance(final, RequestFinished) and final.finish_reason == "error"


@pytest.mark.parametrize("where", ["forward", "sampling", "detokenizer"])
def test_a_failure_in_one_request_fails_only_that_request(tiny, ref_model, where, monkeypatch):
    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=4, num_blocks=64))
    prompts = {f"ok{i}": chat_ids(tokenizer, q) for i, q in enumerate(QUESTIONS[:3])}
    prompts["bad"] = chat_ids(tokenizer, QUESTIONS[3])
    for rid, ids in prompts.items():
        engine.add_request(rid, prompt_token_ids=ids, params=greedy(8))
    engine.step()   # all four prefilled together; the fault strikes while they decode side by side
    bad = engine.seqs["bad"]
    if where == "forward":
        run = engine.runner.run

        def run_failing_with_bad(batch):
            if bad in batch.decodes or any(seq is bad for seq, _ in batch.prefills):
                raise RuntimeError("forced failure")
            return run(batch)
        monkeypatch.setattr(engine.runner, "run", run_failing_with_bad)
    elif where == "sampling":
        class FailingWithBad(Sampler):
            def __call__(self, logits, params, histories, *args, **kwargs):
                if any(h is bad.token_ids for h in histories):
                    raise RuntimeError("forced failure")
                return super().__call__(logits, params, histories, *args, **kwargs)
        monkeypatch.setattr(engine, "sampler", FailingWithBad())
    else:
        def push_failing(ids):
            raise UnicodeError("forced failure")
        monkeypatch.setattr(bad.detokenizer, "push", push_failing)
        monkeypatch.setattr(bad.detokenizer, "push_token", push_failing)

    results, _ = run_all(engine)
    assert results["bad"].finish_reason == "error" and "forced failure" in results["bad"].error
    for rid in ("ok0", "ok1", "ok2"):
        assert results[rid].finish_reason in ("stop", "length")
        assert results[rid].token_ids == reference(ref_model, prompts[rid], 8), rid
    assert engine.stats().running == 0 and engine.blocks.num_used == 0


# ---- CUDA: run wherever a GPU is present -----------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("eager,decode,overlap", [(None, "triton", False), (None, "flex", False), (None, "gather", False),
                                                 (True, None, False), (None, "flex", True)],
                         ids=["decode-graphs-triton", "decode-graphs-flex", "decode-graphs-gather", "eager",
                              "decode-graphs-flex-overlapped"])
def test_greedy_matches_generate_on_cuda(tiny_model_dir, eager, decode, overlap):
    model, tok = load_model(str(tiny_model_dir), device="cuda", dtype="float32")
    ref = load_model(str(tiny_model_dir), device="cuda", dtype="float32")[0]
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=4,
                                                num_blocks=44, enforce_eager=eager, decode_attention=decode,
                                                overlap_steps=overlap))
    graphs = engine.runner.decode_graphs
    assert (graphs is not None and len(graphs.graphs) == len(graphs.sizes)) == (eager is None)
    assert graphs is None or graphs.attention_mode == decode
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    caps = [30, 12, 25, 20, 30, 8, 27, 16]
    for i, ids in enumerate(prompts[:3]):
        engine.add_request(str(i), prompt_token_ids=ids, params=greedy(caps[i]))
    results = {}
    for _ in range(5):
        drain(engine, results)
    for i, ids in enumerate(prompts[3:], start=3):
        engine.add_request(str(i), prompt_token_ids=ids, params=greedy(caps[i]))
    while engine.has_unfinished():
        drain(engine, results)
    for i, ids in enumerate(prompts):
        want = ref.generate(torch.tensor([ids], device="cuda"), max_new_tokens=caps[i], do_sample=False,
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"))
        assert results[str(i)].token_ids == want[0, len(ids):].tolist(), f"request {i} differs"
    assert engine.stats().preemptions > 0
    if graphs is not None:
        assert sum(graphs.steps_per_bucket.values()) > 0
