"""End-to-end check of `python -m bench` on a tiny random model: JSON schema and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_model import make_tiny_model_dir
from bench import engine as bench
from worker.engine import native
from worker.model_loader import load_tokenizer

WORKLOAD = str(bench.REPO_ROOT / "bench" / "data" / "workload.json")

METRIC_TYPES = {
    "tokens_per_s": float, "wall_s": float, "e2e_p50_s": float, "e2e_p95_s": float, "ttft_p50_s": float,
    "ttft_p95_s": float, "peak_rss_mb": float, "greedy_matches": int, "requests": int,
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("bench-model") / "llama", load_tokenizer(), "llama")


def test_bench_writes_full_schema_and_plot(tiny_dir, tmp_path):
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    result = bench.main(["--model", str(tiny_dir), "--workload", WORKLOAD, "--device", "cpu", "--limit", "6",
                         "--slots", "2", "--ablate", "--json", str(out_json), "--plot", str(out_png)])

    data = json.loads(out_json.read_text())
    assert data == json.loads(json.dumps(result))
    assert set(data) == {"slots", "budget", "device", "dtype", "model", "workload", "methods", "transformers_cb",
                         "weights", "weights_mb", "reference", "engine_outputs"}
    assert data["weights"] == "float32" and set(data["engine_outputs"]) == set(data["reference"])
    assert data["slots"] == 2 and data["device"] == "cpu" and data["dtype"] == "float32"
    assert data["budget"] == 512 and data["transformers_cb"]["max_batch_tokens"] == 512   # the CPU default, both
    assert data["workload"] == "workload.json"
    assert data["transformers_cb"]["attn"] == "sdpa" and data["transformers_cb"]["use_cuda_graph"] is False
    assert set(data["methods"]) == {*bench.METHODS, "engine_dense"}
    for name, metrics in data["methods"].items():
        assert set(metrics) == set(METRIC_TYPES) | {"peak_device_mb"}, name
        assert metrics["peak_device_mb"] is None, "CUDA memory is reported only for a CUDA run"
        for key, kind in METRIC_TYPES.items():
            value = metrics[key]
            # JSON turns a whole float into an int only if it was one; ints are fine where floats are asked.
            assert isinstance(value, (int, float) if kind is float else int), (name, key, value)
            assert not isinstance(value, bool), (name, key)
            assert value >= 0, (name, key, value)
        assert metrics["requests"] == 6
        assert metrics["greedy_matches"] <= 6
        if name.startswith("engine"):
            assert metrics["greedy_matches"] == 6, f"{name} must reproduce sequential greedy decoding"
        assert metrics["tokens_per_s"] > 0
        assert metrics["e2e_p50_s"] <= metrics["e2e_p95_s"] <= metrics["wall_s"] + 1e-6
        assert metrics["ttft_p50_s"] <= metrics["e2e_p50_s"]
    assert out_png.is_file() and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_skip_leaves_methods_out_and_reference_off(tiny_dir, tmp_path):
    out_json = tmp_path / "out.json"
    bench.main(["--model", str(tiny_dir), "--workload", WORKLOAD, "--device", "cpu", "--limit", "2", "--slots", "2",
                "--skip", "reference,transformers_cb,engine,engine_best", "--json", str(out_json)])
    methods = json.loads(out_json.read_text())["methods"]
    assert set(methods) == {"static"}
    assert methods["static"]["greedy_matches"] is None


TINY_RANDOM_CONFIG = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                      "max_position_embeddings": 128, "tie_word_embeddings": True}


@pytest.fixture()
def tiny_config(tmp_path):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(TINY_RANDOM_CONFIG))
    return path


def test_nano_workload_has_nano_vllms_shape():
    requests = bench.nano_workload()
    assert len(requests) == 256 and len({r.id for r in requests}) == 256
    prompt_lengths = [len(r.prompt_ids) for r in requests]
    caps = [r.cap for r in requests]
    for lengths in (prompt_lengths, caps):
        assert 100 <= min(lengths) and max(lengths) <= 1024
        assert max(lengths) - min(lengths) > 800, "lengths should spread over the whole range"
    ids = [t for r in requests for t in r.prompt_ids]
    assert min(ids) >= 0 and max(ids) <= 10000 and len(set(ids)) > 9000
    again = bench.nano_workload()
    assert [(r.prompt_ids, r.cap) for r in again] == [(r.prompt_ids, r.cap) for r in requests]
    small = bench.nano_workload(3, (8, 16))
    assert len(small) == 3 and all(8 <= len(r.prompt_ids) <= 16 and 8 <= r.cap <= 16 for r in small)


def test_nano_on_random_weights_runs_every_method_to_its_cap(tiny_config, tmp_path):
    out_json = tmp_path / "nano.json"
    result = bench.main(["--workload", "nano", "--requests", "3", "--nano-lengths", "8,16", "--random-weights",
                         str(tiny_config.parent), "--device", "cpu", "--slots", "2", "--json", str(out_json)])
    caps = sum(r.cap for r in bench.nano_workload(3, (8, 16)))
    assert result["model"].startswith("random:") and result["workload"] == "nano"
    assert set(result["methods"]) == set(bench.METHODS)
    for name, metrics in result["methods"].items():
        # ignore_eos: every method generates exactly the caps, whatever random tokens come out.
        assert round(metrics["tokens_per_s"] * metrics["wall_s"]) == caps, name
        assert metrics["greedy_matches"] is None, "sampled runs have no greedy reference"
        assert metrics["requests"] == 3
    assert result["transformers_cb"]["attn"] == "sdpa"
    assert json.loads(out_json.read_text())["methods"].keys() == result["methods"].keys()


def test_step_profile_times_decode_steps_against_operator_time(tiny_config):
    result = bench.main(["--workload", "nano", "--requests", "2", "--nano-lengths", "8,16", "--random-weights",
                         str(tiny_config), "--device", "cpu", "--step-profile", "2,3", "--profile-steps", "2"])
    rows = result["step_profile"]
    assert [(r["seqs"], r["sampling"]) for r in rows] == [(n, s) for n in (2, 3) for s in ("greedy", "sampled", "chat")]
    for row in rows:
        assert row["busy_kind"] == "cpu_ops" and row["steps"] == 2
        assert row["wall_ms"] > 0 and row["busy_ms"] > 0 and row["wall_over_busy"] > 0


@pytest.mark.skipif(native.load_layer_ops() is None, reason="no C compiler for the layer kernels")
def test_a_cpu_step_profile_counts_the_c_kernels_time_as_busy():
    lib = native.load_layer_ops()
    call = lib.rms_norm_f32
    x, w, out = torch.randn(4, 64), torch.ones(64), torch.empty(4, 64)
    step_lib, top_k_lib = native.load_layer_step(), native.load_top_k()
    layer_step = step_lib.layer_step
    scores, values, indices = torch.randn(2, 64), torch.empty(2, 4), torch.empty(2, 4, dtype=torch.int64)
    with bench.c_kernels_profiled(torch.device("cpu")), torch.profiler.profile() as prof:
        lib.rms_norm_f32(x.data_ptr(), 4, 64, 64, w.data_ptr(), 1e-5, out.data_ptr(), 1)
        top_k_lib.top_k_f32(scores.data_ptr(), 2, 64, 64, 4, values.data_ptr(), indices.data_ptr(), 1)
        top_k_lib.first_largest_f32(scores.data_ptr(), 2, 64, 64, indices.data_ptr(), 1)
        assert step_lib.layer_step is not layer_step   # a whole layer's call is timed too
    assert sorted(e.key for e in prof.key_averages() if e.key.startswith("c::")) == [
        "c::first_largest_f32", "c::rms_norm_f32", "c::top_k_f32"]
    assert lib.rms_norm_f32 is call and step_lib.layer_step is layer_step   # put back as they were


def test_random_weights_resolve_paths_directories_and_builtin_shapes(tiny_config):
    from transformers import AutoConfig

    from worker.model_loader import ModelLoadError
    from bench.random_model import builtin_configs, resolve_config

    assert resolve_config(str(tiny_config)) == resolve_config(str(tiny_config.parent)) == tiny_config
    assert {"qwen3-0.6b", "smollm2-135m"} <= set(builtin_configs())
    settings = json.loads(resolve_config("qwen3-0.6b").read_text())
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    assert (config.num_hidden_layers, config.hidden_size, config.head_dim) == (28, 1024, 128)
    with pytest.raises(ModelLoadError, match="built-in: .*qwen3-0.6b"):
        resolve_config("no-such-shape")


def test_workload_names_and_nano_options_are_checked():
    path = bench.resolve_workload("workload-256")
    assert len(json.loads(path.read_text())["requests"]) == 256
    with pytest.raises(SystemExit, match="workload-256"):
        bench.resolve_workload("no-such-workload")
    for argv in (["--requests", "8"], ["--workload", "nano", "--nano-lengths", "9,3"],
                 ["--workload", "nano", "--step-profile", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_unknown_skip_is_rejected():
    with pytest.raises(SystemExit):
        bench.parse_args(["--skip", "nope"])


def test_sweep_measures_the_engine_at_each_slot_count(tiny_dir, tmp_path):
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    bench.main(["--model", str(tiny_dir), "--workload", WORKLOAD, "--device", "cpu", "--limit", "4",
                "--sweep-slots", "1,4",
                "--json", str(out_json), "--plot", str(out_png)])
    data = json.loads(out_json.read_text())
    assert data["slots"] == [1, 4] and set(data["sweep"]) == {"1", "4"}
    assert all(m["requests"] == 4 and m["tokens_per_s"] > 0 for m in data["sweep"].values())
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_engine_run_hands_the_model_back_unchanged(tiny_dir):
    from worker.engine.weights.packed import PackedLinear
    from worker.model_loader import load_model

    model, tokenizer = load_model(str(tiny_dir))
    setup = bench.Setup(model, tokenizer, bench.load_workload(Path(WORKLOAD), tokenizer, 2),
                        bench.eos_ids_of(model, tokenizer), tokenizer.pad_token_id)
    before = model.config._attn_implementation
    bench.run_engine(setup, 2, 64)
    assert model.config._attn_implementation == before
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


def test_stack_bench_runs_the_workload_through_socketio_and_matches_the_engine(tiny_model_dir, tmp_path):
    from bench import stack as stack_bench

    figures = stack_bench.main(["--model", str(tiny_model_dir), "--limit", "4", "--slots", "2", "--rounds", "2",
                                "--alone", "2", "--json", str(tmp_path / "stack.json")])
    assert figures["errors"] == 0 and figures["requests"] == 4 and len(figures["rounds"]) == 2
    assert figures["identical"] == 4   # greedy answers through the stack equal the engine's own, in every round
    assert figures["stack_tok_s"] > 0 and figures["engine_tok_s"] > 0
    assert figures["alone_stack_ttft_p50_s"] > 0 and figures["alone_engine_ttft_p50_s"] > 0
    for r in figures["rounds"]:   # 2 slots: the second admission of each side, read from SQL and from the engine
        assert 0 < r["engine_batch_full_s"] < r["engine_wall_s"] and 0 < r["stack_batch_full_s"] < r["stack_wall_s"]
    assert json.loads((tmp_path / "stack.json").read_text())["identical"] == 4


def test_stack_bench_can_give_the_engine_cpus_of_its_own():
    from bench.stack import Placement

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: there is nothing to place apart")
    placement = Placement({cpus[0]})
    assert (placement.engine, placement.rest) == ({cpus[0]}, set(cpus[1:]))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             preexec_fn=placement.launcher(placement.engine))
    try:
        assert os.sched_getaffinity(child.pid) == {cpus[0]}
        placement.pin(child.pid, placement.rest)
        assert os.sched_getaffinity(child.pid) == set(cpus[1:])
    finally:
        child.kill()
        child.wait()
    before = os.sched_getaffinity(0)
    with placement.engine_thread():
        assert os.sched_getaffinity(0) == {cpus[0]}
    assert os.sched_getaffinity(0) == before
    with pytest.raises(SystemExit, match="at least one"):
        Placement(set(cpus))
    with pytest.raises(SystemExit, match="may run on CPUs"):
        Placement({max(cpus) + 1})


def test_stack_bench_burst_reports_refusals_instead_of_failing(stack):
    """A burst against a web process whose queue counts as full: every refusal is counted, nothing crashes."""
    from bench import stack as stack_bench

    url = stack.web_with(QUEUE_LIMIT="0")
    figures = stack_bench.main(["--url", url, "--customers", "30", "--max-new-tokens", "2"])
    assert figures["connected"] == 30 and figures["asked"] == 30 and figures["lost"] == 0
    assert figures["refused"] == 30 and figures["error_codes"] == {"queue_full": 30}
    assert figures["answered"] == 0 and figures["failed"] == 0 and figures["ttft_s"]["p50"] is None
    assert figures["healthz"]["probes"] > 0
    http = stack_bench.main(["--url", url, "--customers", "5", "--protocol", "http"])
    assert http["refused"] == 5 and http["error_codes"] == {"queue_full": 5}


def test_stack_bench_burst_answers_every_customer(stack):
    from bench import stack as stack_bench

    figures = stack_bench.main(["--url", stack.web_urls[0], "--customers", "30", "--max-new-tokens", "2"])
    assert (figures["answered"], figures["refused"], figures["failed"], figures["lost"]) == (30, 0, 0, 0)
    assert figures["ttft_s"]["p50"] > 0 and figures["healthz"]["probes"] > 0


def test_stack_bench_burst_over_http_answers_everyone(stack):
    from bench import stack as stack_bench

    figures = stack_bench.main(["--url", stack.web_urls[0], "--customers", "20", "--protocol", "http",
                                "--max-new-tokens", "2"])
    assert (figures["answered"], figures["refused"], figures["failed"], figures["lost"]) == (20, 0, 0, 0)


def test_stack_bench_ceiling_streams_synthetic_text_to_open_chats(tmp_path):
    from bench import stack as stack_bench

    figures = stack_bench.main(["--ceiling", "--open", "40", "--streaming", "10", "--token-rate", "40",
                                "--warmup", "1", "--duration", "3", "--json", str(tmp_path / "ceiling.json")])
    assert figures["open"] == 40 and figures["streaming"] == 10 and figures["streaming_at_end"] == 10
    assert figures["errors"] == [] and figures["delivered_tokens_per_s"] > 0
    assert json.loads((tmp_path / "ceiling.json").read_text())["mode"] == "ceiling"


def test_grammar_bench_measures_every_section_on_a_tiny_model(tiny_dir, tmp_path):
    from bench import grammar

    out_json = tmp_path / "grammar.json"
    result = grammar.main(["--model", str(tiny_dir), "--workload", WORKLOAD, "--rows", "4", "--repeats", "1",
                           "--mask-steps", "3", "--engine-new-tokens", "4", "--json", str(out_json)])
    assert json.loads(out_json.read_text()) == json.loads(json.dumps(result))
    assert {"compile", "masks", "coverage", "sampler", "engine"} <= set(result)
    assert result["coverage"]["llguidance"]["pydantic Ticket"] == "yes"
    assert result["coverage"]["llguidance"]["uniqueItems"].startswith("no: ")
    assert {r["kind"] for r in result["sampler"]} == set(grammar.KINDS) - grammar.NEW_ONLY
    for table in result["engine"].values():
        assert table["none"]["steps"] == table["constrained"]["steps"] > 0
        assert table["constrained_vs_none"] > 0


def test_attention_bits_finds_the_kernel_gives_every_row_its_bits_at_any_length_and_sdpa_does_not(capsys):
    from bench import attention_bits
    from worker.engine import native

    if native.load() is None:
        pytest.skip("no C compiler for the paged-attention kernel")
    assert attention_bits.rows_that_differ(attention_bits.kernel, 50, 9, 3, 64, seed=1) == (0, 0)
    prefix, decode = attention_bits.rows_that_differ(attention_bits.sdpa, 50, 9, 3, 64, seed=1)
    assert prefix + decode > 0   # SDPA blocks its work by prompt length: the tool must see that, or it sees nothing
    attention_bits.main(["--lengths", "20"])
    out = capsys.readouterr().out
    assert "kernel        20                             0/19                          0/20" in out


def test_weights_bench_reports_each_precisions_agreement_on_a_tiny_model(tiny_dir, tmp_path):
    from bench import weights as weights_bench
    from worker.engine import native

    rows = weights_bench.main(["--model", str(tiny_dir), "--weights", "float32,w8a8", "--slots", "2", "--limit", "3",
                               "--agree", "2", "--json", str(tmp_path / "weights.json")])
    assert set(rows) == {"float32", "w8a8"}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["peak_rss_mb"] > 0 and row["loglik_of_float32_answers"] < 0
        assert row["equal_to_engine_alone"] == "2/2"
        assert row["equal_to_generate_on_kernel"] == ("2/2" if native.load() is not None else "-")
    assert rows["float32"]["answers_as_float32"] == "3/3"
    assert json.loads((tmp_path / "weights.json").read_text()) == rows


def test_sampler_bench_times_the_bias_rebuild_each_way(capsys):
    from bench import sampler as sampler_bench

    result = sampler_bench.main(["--rows", "", "--engine-slots", "0", "--rebuild-rows", "8", "--rebuild-biases",
                                 "0,3", "--rebuild-vocab", "64", "--repeats", "3"])
    assert [(r["rows"], r["bias_entries"]) for r in result["rebuild"]] == [(8, 0), (8, 3)]
    assert all(r[k] >= 0 for r in result["rebuild"] for k in ("kept_ms", "from_dicts_ms", "previous_ms",
                                                                "whole_rebuild_ms"))
    assert "3 entries a row" in capsys.readouterr().out


def test_sampler_bench_times_both_paths_over_peaked_logits_without_the_models_weights():
    from bench import sampler as sampler_bench

    logits, histories = sampler_bench.peaked_logits(16, 151936, torch.device("cpu"))
    probs = torch.softmax(logits / 0.7, dim=-1).sort(dim=-1, descending=True).values
    nucleus = ((probs.cumsum(dim=-1) - probs) < 0.9).sum(dim=-1)
    assert 5 <= int(nucleus.min()) and int(nucleus.max()) <= 12   # as the docstring says: a model's, not flat
    assert len(histories) == 16 and all(len(h) == 300 for h in histories)

    result = sampler_bench.main(["--rows", "3", "--engine-slots", "0", "--rebuild-rows", "0", "--logits", "peaked",
                                 "--vocab", "2048", "--device", "cpu", "--repeats", "1"])
    assert result["info"]["logits"] == "peaked, vocab 2048"
    assert {r["kind"] for r in result["sampler"]} == set(sampler_bench.KINDS)
    assert all(r["vocab"] == 2048 and r["new_ms"] > 0 and r["full_sort_ms"] > 0 for r in result["sampler"])
    with pytest.raises(SystemExit):   # no model to run the engine with
        sampler_bench.main(["--rows", "3", "--logits", "peaked"])


def test_host_time_splits_decode_steps_of_every_row_into_their_parts(capsys):
    from bench import host_time

    result = host_time.main(["--rows", "6", "--steps", "4", "--warmup", "1", "--prompt", "5", "--stop", "ORDER-END"])
    ms = result["ms_per_step"]
    assert result["rows"] == 6 and result["stop"] == ["ORDER-END"]
    assert all(ms[part] > 0 for part in host_time.PARTS)
    assert sum(ms[part] for part in host_time.PARTS) <= ms["step"]
    assert result["us_per_row"]["append"] == pytest.approx(1e3 * ms["append"] / 6)
    assert "append" in capsys.readouterr().out


def test_step_trace_times_every_step_by_kind_and_profiles_a_mixed_one(tiny_config, capsys):
    from bench import step_trace

    result = step_trace.main(["--random-weights", str(tiny_config), "--device", "cpu", "--requests", "4",
                              "--lengths", "8,16", "--slots", "2", "--budget", "8", "--profile", "1"])
    requests = bench.nano_workload(4, (8, 16))
    steps = result["steps"]
    # Every prompt token and every token after a request's first is one row of one step (a prompt's last
    # token may run as a decode row).
    rows = sum(len(r.prompt_ids) + r.cap - 1 for r in requests)
    assert sum(s["prefill"] + s["decodes"] for s in steps) == rows
    assert sum(s["prefill"] for s in steps) >= rows - sum(r.cap for r in requests)
    assert all(s["wall_ms"] > 0 for s in steps)
    profiled = [s for s in steps if s["profiled"]]
    assert len(profiled) == 1 and profiled[0]["prefill"]
    out = capsys.readouterr().out
    assert "-- by host time" in out and "finished" in out and "\nmixed " in out


def test_attention_kernel_bench_times_both_paths_and_checks_them_against_float64():
    from worker.engine import native

    if native.load() is None:
        pytest.skip("no C compiler for the paged-attention kernel")
    from bench import attention_kernel

    result = attention_kernel.main(["--contexts", "20,40", "--rows", "2", "--chunk", "8", "--repeats", "2"])
    rows = result["rows"]
    assert [(r["shape"], r["context"], r["pool"]) for r in rows] == [
        (name, context, pool) for name, *_ in attention_kernel.SHAPES for context in (20, 40, 32)
        for pool in ("float32", "float16")]
    assert result["path"] == native.attention_path()
    for row in rows:
        assert row["err_portable"] < 1e-5 and row["err_vector"] < 1e-5
        assert row["portable_us"] > 0 and row["vector_us"] > 0
        assert ("f32_over_f16" in row) == (row["pool"] == "float16")
    with pytest.raises(SystemExit, match="unknown pool dtype 'bfloat16'"):
        attention_kernel.main(["--pools", "float32,bfloat16"])


def test_attention_kernel_bench_times_another_version_of_the_source_beside_this_one(tmp_path):
    from worker.engine import native

    if native.load() is None:
        pytest.skip("no C compiler for the paged-attention kernel")
    from bench import attention_kernel

    same, other = tmp_path / "same.c", tmp_path / "other.c"
    same.write_bytes(native.SOURCE.read_bytes())
    source = native.SOURCE.read_text()
    assert source.count("    call_args a = CALL_ARGS;") == 2
    other.write_text(source.replace("    call_args a = CALL_ARGS;",
                                    "    scale *= 1.01f;\n    call_args a = CALL_ARGS;"))
    args = ["--contexts", "20", "--rows", "2", "--chunk", "8", "--repeats", "2", "--pools", "float32,float16"]
    for against, bits in ((same, True), (other, False)):
        rows = attention_kernel.main([*args, "--against", str(against)])["rows"]
        assert len(rows) == 2 * 2 * len(attention_kernel.SHAPES)
        for row in rows:
            assert row["same_bits"] is bits and row["against_us"] > 0
            assert row["speedup"] == pytest.approx(row["against_us"] / row["vector_us"])
    with pytest.raises(SystemExit, match="no such file"):
        attention_kernel.main([*args, "--against", str(tmp_path / "missing.c")])
    (tmp_path / "broken.c").write_text("this is not C")
    with pytest.raises(SystemExit, match="broken.c did not build"):
        attention_kernel.main([*args, "--against", str(tmp_path / "broken.c")])


def test_long_prompts_bench_times_prefill_then_the_decode_steps_for_each_pool(tiny_model_dir, capsys):
    from bench import long_prompts

    result = long_prompts.main(["--model", str(tiny_model_dir), "--weights", "float32", "--prompt-tokens", "40",
                                "--requests", "2", "--decode-tokens", "3", "--budget", "32"])
    assert [row["kv"] for row in result["rows"]] == ["float32", "float16"]
    for row in result["rows"]:
        # 80 prompt tokens in steps of 32: the second request's first token comes in the third step, and it has
        # three more to go
        assert row["prefill_s"] > 0 and row["decode_ms"] > 0 and row["decode_steps"] == 3
        assert row["prefill_tok_s"] == pytest.approx(80 / row["prefill_s"])
    assert "over a float16 KV pool" in result["rows"][1]["steps"]
    assert "prefill 2x40" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown KV pool dtype 'bfloat16'"):
        long_prompts.main(["--kv", "bfloat16"])


def test_stack_bench_mixed_runs_chats_beside_bulk_streams_with_classes_on_and_off(tiny_model_dir, tmp_path):
    from bench import stack as stack_bench

    figures = stack_bench.main(["--mixed", "--model", str(tiny_model_dir), "--slots", "2", "--bulk-streams", "6",
                                "--bulk-tokens", "48", "--chats", "3", "--chat-interval", "0.5", "--chat-tokens", "8",
                                "--chats-alone", "2", "--bulk-warmup", "2", "--bulk-window", "3",
                                "--json", str(tmp_path / "mixed.json")])
    assert [h["label"] for h in figures["halves"]] == ["classes on", "classes off (one FIFO)"]
    for half in figures["halves"]:
        assert half["answered"] == half["chats"] == 3 and half["errors"] == {}
        assert half["bulk_alone_tok_s"] > 0 and half["chat_ttft_p50_s"] > 0
        # no bulk answer ends before its cap: the end-of-text tokens are biased away; the streams run on until
        # as many answers as streams have ended, however slow the machine
        assert set(half["bulk_finish_reasons"]) == {"length"} and half["bulk_finish_reasons"]["length"] >= 6
    assert figures["alone_chat_ttft_p50_s"] > 0
    assert json.loads((tmp_path / "mixed.json").read_text())["halves"][0]["chats"] == 3


def test_the_rate_limit_bench_measures_the_script_against_the_limits_package(capsys):
    pytest.importorskip("limits", reason="pip install -r requirements-test.txt")
    from bench import ratelimit

    ratelimit.main(["--checks", "20"])
    out = capsys.readouterr().out
    assert "1.00x the Lua script's time" in out and out.count("x the Lua script's time") == 5
    # Refused requests spend nothing with the script; with a hit of each rule they drain the address's budget.
    assert "lua (one EVAL, all rules)                        admitted 5, address slots left for everyone else 45" in out


def test_keyspace_bench_finds_the_workers_each_way_and_prints_the_ratio(capsys):
    from bench import keyspace

    keyspace.main(["--sizes", "200,2000", "--tries", "1"])   # each lookup asserts it found both workers
    lines = [line for line in capsys.readouterr().out.splitlines() if "scan / names" in line]
    assert len(lines) == 2 and "2,003 keys" in lines[1]


def test_publisher_bench_streams_every_answer_and_reads_back_whole_records(capsys):
    from bench import publisher

    publisher.main(["--requests", "8", "--rate", "50", "--seconds", "0.4", "--repeats", "1"])
    [line] = [line for line in capsys.readouterr().out.splitlines() if "tok/s" in line]
    assert "records complete" in line


def test_continued_bench_shows_the_seam_a_regenerated_answer_would_have(tiny_model_dir, tmp_path, tokenizer, capsys):
    from bench import continued

    other = make_tiny_model_dir(tmp_path / "next", tokenizer, seed=1)
    got = continued.main(["--model", str(tiny_model_dir), "--next-model", str(other), "--weights", "float32",
                          "--next-weights", "float32", "--shown", "8", "--max-new-tokens", "16"])
    assert got["continued"].startswith(got["shown"]) and got["continued"] != got["shown"]
    assert got["parted"] < 8 and not got["regenerated"].startswith(got["continued"][:len(got["shown"]) + 8])
    assert "continued starts with what was shown: True" in capsys.readouterr().out


def test_int8_matmul_bench_checks_each_kernel_against_torch_and_times_every_row_count(tiny_config, capsys):
    from bench import int8_matmul

    result = int8_matmul.main(["--config", str(tiny_config), "--rows", "1,17", "--repeats", "2"])
    assert result["kernels"][-1] == "torch._int_mm"
    assert set(result["kernels"]) - {"torch._int_mm"} == set(native.int8_tile_kernels())
    assert [line["rows"] for line in result["results"]] == [1, 17]
    for line in result["results"]:
        assert all(line[kernel]["ms"] > 0 and line[kernel]["gb_per_s"] > 0 for kernel in result["kernels"])
    # 2 layers of 4 stacked matmuls and the head, 64 wide: q/k/v 128, o 64, gate/up 256, down 64 outputs
    assert result["weight_bytes"] == 2 * 64 * (128 + 64 + 256) + 2 * 128 * 64 + 64 * 151936
    assert "torch._int_mm" in capsys.readouterr().out


def test_int8_matmul_bench_takes_the_default_models_builtin_shape():
    from bench import int8_matmul

    result = int8_matmul.main(["--rows", "1", "--repeats", "1", "--kernels", "torch._int_mm"])
    layer = 576 * (960 + 576 + 3072) + 1536 * 576   # q/k/v, o, gate/up, down
    assert result["weight_bytes"] == 30 * layer + 49152 * 576


def test_int8_matmul_bench_stops_when_a_kernel_differs_from_torch(tiny_config, monkeypatch):
    from bench import int8_matmul

    if not native.int8_tile_kernels():
        pytest.skip("no w8a8 tile kernel on this CPU")
    real = int8_matmul.tile_matmul

    def off_by_one(lib, flat, kernel, tiles, shift, scales, out):
        real(lib, flat, kernel, tiles, shift, scales, out)
        out[0, 0] += 1

    monkeypatch.setattr(int8_matmul, "tile_matmul", off_by_one)
    with pytest.raises(SystemExit, match="differs from torch._int_mm's"):
        int8_matmul.main(["--config", str(tiny_config), "--rows", "1", "--repeats", "1"])


def test_the_answers_bench_checks_small_talk_replies_as_a_customer_reads_them():
    from bench.answers import Case, checks

    greeting, thanks = Case("greeting", ("hi",), offers=True), Case("thanks", ("thanks!",), welcome=True)
    offer = ("Hello! I can look up your orders (give me the order number, like NW-10042, or the e-mail address you "
             "ordered with) and answer questions about returns and exchanges and refunds. What can I do for you?")
    assert checks(greeting, offer, "stop", "NW-10042") == {
        "no loop": True, "within limit": True, "no leak": True, "no invented number": True, "offers help": True}
    assert not checks(greeting, "Welcome to our little shop! Ask me about custom items.", "stop")["offers help"]
    assert not checks(greeting, "I don't know; give me your order number or ask about returns.", "stop")["offers help"]
    assert checks(thanks, "You're welcome! If anything else comes up, just ask.", "stop")["welcome"]
    assert not checks(thanks, "I'm sorry, I don't know the answer to that.", "stop")["welcome"]
    assert not checks(greeting, offer, "length", "NW-10042")["within limit"]
