"""Structured output: grammar compile and mask times, JSON-schema coverage, and what constrained rows cost a step.

`python -m bench.grammar` measures, in one run:
  compile   per schema: the grammar text, the first matcher, its first mask; then a cached copy
  masks     per step, the allowed-token masks of a batch of constrained rows, walking their grammars
  coverage  which JSON-schema features compile
  sampler   the batched sampler without constrained rows against the sampler before structured output (read from
            git), and with every row constrained (the mask applied; the masks given)
  engine    a batch of requests on the model, every row constrained against none, stepped in turn
xgrammar's compile, mask and coverage figures come too when it is importable (it is not a requirement).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from enum import Enum
from importlib import metadata
from pathlib import Path
from typing import Literal

import llguidance
import llguidance.hf
import llguidance.numpy
import torch
from pydantic import BaseModel, ConfigDict, Field

from bench.engine import DEFAULT_WORKLOAD, REPO_ROOT, load_workload
from bench.sampler import KINDS, NEW_ONLY, model_logits
from structured import Structure
from worker.engine import EngineConfig, LLMEngine, SamplingParams
from worker.engine.grammar import Grammars
from worker.engine.sampler import Sampler
from worker.model_loader import load_model

BASELINE_COMMIT = "35a66a4"   # the sampler before structured output and the new processors


# ---- schemas: a pydantic-generated form and a tool-call wrapper -------------------------------------------------


class Strict(BaseModel):
    """additionalProperties: false, as strict tool schemas have (else any key name, of any length, fits)."""

    model_config = ConfigDict(extra="forbid")


class Priority(str, Enum):
    low = "low"
    normal = "normal"
    urgent = "urgent"


class Item(Strict):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    quantity: int = Field(ge=1, le=20)
    note: str = Field(max_length=40)


class Address(Strict):
    street: str = Field(max_length=60)
    city: str = Field(max_length=30)
    postcode: str = Field(pattern=r"^[0-9]{5}$")
    country: Literal["DE", "FR", "GB", "US"]


class Ticket(Strict):
    order_id: int = Field(ge=100000, le=999999)
    priority: Priority
    category: Literal["delivery", "refund", "damaged", "other"]
    items: list[Item] = Field(min_length=1, max_length=3)
    address: Address | None = None
    summary: str = Field(max_length=120)
    escalate: bool


def tools_schema() -> dict:
    """One call of any of four shop tools, as OpenAI's tools become one schema: a name and its arguments."""
    tools = {
        "get_order": {"type": "object", "properties": {"order_id": {"type": "integer", "minimum": 1}},
                      "required": ["order_id"], "additionalProperties": False},
        "track_parcel": {"type": "object", "properties": {"tracking": {"type": "string", "pattern": "^[A-Z0-9]{10}$"},
                                                          "carrier": {"enum": ["dhl", "ups", "dpd"]}},
                         "required": ["tracking"], "additionalProperties": False},
        "refund": {"type": "object", "properties": {"order_id": {"type": "integer"},
                                                    "amount": {"type": "number", "minimum": 0},
                                                    "reason": {"type": "string", "maxLength": 200}},
                   "required": ["order_id", "amount"], "additionalProperties": False},
        "escalate": Ticket.model_json_schema(),
    }
    defs = tools["escalate"].pop("$defs")   # "#/$defs/..." references name the document's root
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": args},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for name, args in tools.items()], "$defs": defs}


def long_schema() -> dict:
    """Tickets, at least 20 of them: an answer that outlasts any step count the engine run uses."""
    ticket = Ticket.model_json_schema()
    return {"type": "object", "properties": {"tickets": {"type": "array", "items": {"$ref": "#/$defs/Ticket"},
                                                         "minItems": 20}},
            "required": ["tickets"], "additionalProperties": False,
            "$defs": {**ticket.pop("$defs"), "Ticket": ticket}}


def structures() -> dict[str, Structure]:
    return {
        "pydantic Ticket": Structure(Ticket.model_json_schema()),
        "tool call (4 tools), wrapped, repeated": Structure(tools_schema(), begin="<tool_call>\n",
                                                            end="\n</tool_call>", repeat=True),
        "any JSON object": Structure(),
    }


COVERAGE: dict[str, dict] = {
    "enum, const": {"type": "object", "properties": {"a": {"enum": ["x", 1, None]}, "b": {"const": "k"}}},
    "string length bounds": {"type": "string", "minLength": 2, "maxLength": 8},
    "pattern": {"type": "string", "pattern": "^[a-z]+-[0-9]{2,4}$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format email": {"type": "string", "format": "email"},
    "format uuid": {"type": "string", "format": "uuid"},
    "integer bounds": {"type": "integer", "minimum": -5, "exclusiveMaximum": 1000},
    "number bounds": {"type": "number", "minimum": 0.5, "maximum": 99.5},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string", "maxLength": 3}, {"type": "boolean"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}}]},
    "recursive $ref": {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
    "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "min/maxProperties": {"type": "object", "minProperties": 1, "maxProperties": 2},
    "if/then/else": {"type": "object", "if": {"properties": {"a": {"const": 1}}},
                     "then": {"required": ["b"]}, "else": {"required": ["c"]}},
    "not": {"not": {"type": "string"}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "pydantic Ticket": Ticket.model_json_schema(),
    "tool call (4 tools)": tools_schema(),
}


def timed(fn, repeats: int = 1) -> tuple[float, object]:
    """Median seconds of `repeats` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


# ---- llguidance (what the engine uses) and xgrammar (measured against it) -------------------------------------------

def compile_llguidance(tokenizer, vocab: int, repeats: int) -> dict:
    out: dict = {}
    out["tokenizer_s"], lltok = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    for name, structure in structures().items():
        def cold():
            from structured import grammar as module
            module._grammar.cache_clear()   # the grammar text too: a schema never seen
            text = structure.grammar()
            matcher = llguidance.LLMatcher(lltok, text, log_level=0)
            mask = llguidance.numpy.allocate_token_bitmask(1, lltok.vocab_size)
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            return matcher
        cold_s, matcher = timed(cold, repeats)
        grammars = Grammars(tokenizer, {tokenizer.eos_token_id}, vocab)
        grammars._lltokenizer = lltok
        grammars.matcher(structure)
        warm_s, _ = timed(lambda: grammars.matcher(structure), repeats)
        out[name] = {"cold_ms": cold_s * 1e3, "cached_copy_ms": warm_s * 1e3}
    return out


def coverage_llguidance() -> dict[str, str]:
    result = {}
    for name, schema in COVERAGE.items():
        try:
            Structure(schema).check()
            result[name] = "yes"
        except ValueError as exc:
            result[name] = f"no: {str(exc)[:90]}"
    return result


# Compact JSON, as structured/grammar.py asks of llguidance (xgrammar's default separators have spaces).
XGRAMMAR_COMPACT = {"any_whitespace": False, "separators": (",", ":")}


def xgrammar_module():
    if importlib.util.find_spec("xgrammar") is None:
        return None
    import xgrammar
    return xgrammar


def xgrammar_wrapped(xgr, structure: Structure) -> str:
    """The wrapped, repeated structure as xgrammar EBNF: the schema's own rules (its root renamed) inside literal
    begin and end, repeated with the separator, as llguidance's lark grammar in structured/grammar.py does."""
    inner = str(xgr.Grammar.from_json_schema(json.dumps(structure.schema), **XGRAMMAR_COMPACT))
    begin, end, sep = (json.dumps(s) for s in (structure.begin, structure.end, structure.separator))
    rules = re.sub(r"\broot\b", "wrapped_value", inner)
    return f"root ::= wrapped_item ({sep} wrapped_item)*\nwrapped_item ::= {begin} wrapped_value {end}\n{rules}"


def compile_xgrammar(xgr, tokenizer, vocab: int, repeats: int) -> dict:
    out: dict = {}
    out["tokenizer_s"], info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    for name, structure in structures().items():
        if structure.begin or structure.repeat:
            # xgrammar wraps with a structural tag; the same tag-delimited repetition, written as EBNF around the
            # schema's own rules, is what it compiles here.
            ebnf = xgrammar_wrapped(xgr, structure)
            make = lambda c, ebnf=ebnf: c.compile_grammar(ebnf)
        else:
            schema = structure.schema or {"type": "object"}
            make = lambda c, schema=schema: c.compile_json_schema(json.dumps(schema), **XGRAMMAR_COMPACT)

        def cold(make=make):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            compiled = make(compiler)
            matcher = xgr.GrammarMatcher(compiled)
            mask = xgr.allocate_token_bitmask(1, info.vocab_size)
            matcher.fill_next_token_bitmask(mask)
            return matcher
        cold_s, _ = timed(cold, repeats)
        cached = xgr.GrammarCompiler(info, max_threads=1)
        make(cached)
        warm_s, _ = timed(lambda make=make: xgr.GrammarMatcher(make(cached)), repeats)
        out[name] = {"cold_ms": cold_s * 1e3, "cached_copy_ms": warm_s * 1e3}
    return out


def coverage_xgrammar(xgr, tokenizer, vocab: int) -> dict[str, str]:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    result = {}
    for name, schema in COVERAGE.items():
        try:
            compiler.compile_json_schema(json.dumps(schema), **XGRAMMAR_COMPACT)
            result[name] = "yes"
        except Exception as exc:   # xgrammar raises RuntimeError or its own errors
            result[name] = f"no: {str(exc).splitlines()[0][:90]}"
    return result


def mask_walk(tokenizer, vocab: int, rows: int, steps: int, xgr=None) -> dict:
    """Per step, the masks of `rows` matchers of the tool-call structure, each consuming a random allowed token
    (a fixed seed), as in decoding: llguidance in parallel without the GIL, and xgrammar's batch matcher."""
    structure = structures()["tool call (4 tools), wrapped, repeated"]
    eos = tokenizer.eos_token_id
    out = {}
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    executor = llguidance.LLExecutor()
    matchers = [llguidance.LLMatcher(lltok, structure.grammar(), log_level=0) for _ in range(rows)]
    bits = torch.full(llguidance.numpy.get_bitmask_shape(rows, lltok.vocab_size), -1, dtype=torch.int32)

    def walk(fill, consume) -> list[float]:
        generator = torch.Generator().manual_seed(0)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            fill()
            times.append(time.perf_counter() - start)
            allowed = torch.zeros(rows, bits.shape[1] * 32, dtype=torch.bool)
            for r in range(rows):
                allowed[r] = ((bits[r].view(torch.uint8).unsqueeze(1).long() >> torch.arange(8)) & 1).flatten().bool()
            allowed[:, eos] = False   # keep every row going
            scores = torch.rand(rows, allowed.shape[1], generator=generator).masked_fill_(~allowed, -1.0)
            consume(scores.argmax(dim=-1).tolist())
        return times

    ll = walk(lambda: llguidance.numpy.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)],
                                                                    bits.numpy()),
              lambda tokens: [m.consume_token(t) for m, t in zip(matchers, tokens)])
    out["llguidance_ms"] = {"mean": statistics.mean(ll) * 1e3, "p50": statistics.median(ll) * 1e3,
                            "max": max(ll) * 1e3}
    if xgr is not None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        compiled = xgr.GrammarCompiler(info).compile_grammar(xgrammar_wrapped(xgr, structure))
        xmatchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        batch = xgr.BatchGrammarMatcher()
        xbits = bits   # the same layout
        xg = walk(lambda: batch.batch_fill_next_token_bitmask(xmatchers, xbits),
                  lambda tokens: [m.accept_token(t) for m, t in zip(xmatchers, tokens)])
        out["xgrammar_ms"] = {"mean": statistics.mean(xg) * 1e3, "p50": statistics.median(xg) * 1e3,
                              "max": max(xg) * 1e3}
    return out


# ---- the sampler: without constrained rows against the one before, and all rows constrained -------------------------

def baseline_sampler_class():
    """The sampler at BASELINE_COMMIT, loaded from git into a module of its own."""
    source = subprocess.run(["git", "show", f"{BASELINE_COMMIT}:worker/engine/sampler.py"], cwd=REPO_ROOT,
                            check=True, capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("baseline_sampler", loader=None)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_sampler"] = module   # dataclasses look their module up there
    exec(compile(source, f"{BASELINE_COMMIT}:worker/engine/sampler.py", "exec"), module.__dict__)
    return module.Sampler


def sampler_table(model, tokenizer, rows: int, repeats: int, workload: Path) -> list[dict]:
    """Median ms per call over `repeats` rounds; in each round every variant runs once, in turn, so load from
    elsewhere falls on all of them alike. Histories grow by the token drawn, as in decoding."""
    logits, prompts = model_logits(model, tokenizer, rows, workload)
    vocab = logits.shape[1]
    grammars = Grammars(tokenizer, {tokenizer.eos_token_id}, vocab)
    structure = structures()["tool call (4 tools), wrapped, repeated"]
    matchers = [grammars.matcher(structure) for _ in range(rows)]
    masks = grammars.masks(matchers, logits.device)   # the first step's masks: any masks cost the same to apply
    Baseline = baseline_sampler_class()
    results = []
    for kind, config in KINDS.items():
        if kind in NEW_ONLY:   # the baseline sampler cannot draw these (bench.sampler times them)
            continue
        params = [SamplingParams(**config) for _ in range(rows)]
        seeds = list(range(rows))
        variants = {"baseline": (Baseline(), {}), "new": (Sampler(), {}),
                    "new_constrained": (Sampler(), {"masks": masks})}
        histories = {name: [list(p) for p in prompts] for name in variants}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(repeats + 2):
            for name, (sampler, extra) in variants.items():
                start = time.perf_counter()
                tokens = sampler(logits, params, histories[name], seeds, **extra).tolist()
                elapsed = time.perf_counter() - start
                for history, token in zip(histories[name], tokens):
                    history.append(token)
                if i >= 2:
                    times[name].append(elapsed)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        results.append({"rows": rows, "kind": kind, **{f"{k}_ms": v for k, v in ms.items()},
                        "new_vs_baseline": ms["new"] / ms["baseline"],
                        "constrained_vs_new": ms["new_constrained"] / ms["new"]})
    return results


# ---- the engine: every row constrained against none ------------------------------------------------------------------

def engine_table(model_source, tokenizer, rows: int, new_tokens: int, workload: Path, sampling: dict) -> dict:
    """Two engines on their own copies of the model, `rows` requests each (the same prompts, the same parameters),
    one constrained to long JSON, stepped in turn; time inside step() for decode-only steps with every row."""
    prompts = [r.prompt_ids for r in load_workload(workload, tokenizer, rows)]
    structure = Structure(long_schema())
    engines, mask_s = {}, [0.0]
    for name in ("none", "constrained"):
        model, _ = load_model(model_source)
        engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=rows, num_blocks=2048))
        for i, ids in enumerate(prompts):
            params = SamplingParams(**sampling, seed=i, max_new_tokens=new_tokens, ignore_eos=True,
                                    structure=structure if name == "constrained" else None)
            engine.add_request(str(i), prompt_token_ids=ids, params=params)
        engines[name] = engine
    masks = engines["constrained"].grammars.masks

    def timed_masks(*args, **kwargs):
        start = time.perf_counter()
        result = masks(*args, **kwargs)
        mask_s[0] += time.perf_counter() - start
        return result
    engines["constrained"].grammars.masks = timed_masks
    runs = {name: {"steps": 0, "decode_s": 0.0, "answers": []} for name in engines}
    while any(e.has_unfinished() for e in engines.values()):
        full = all(e.stats().running == rows for e in engines.values())
        for name, engine in engines.items():
            if not engine.has_unfinished():
                continue
            before = mask_s[0]
            start = time.perf_counter()
            events = engine.step()
            elapsed = time.perf_counter() - start
            runs[name]["answers"] += [e.text for e in events if e.finished]
            seqs, batched = engine.last_batch
            if full and seqs == batched == rows:
                runs[name]["steps"] += 1
                runs[name]["decode_s"] += elapsed
                if name == "constrained":
                    runs[name].setdefault("mask_s", 0.0)
                    runs[name]["mask_s"] += mask_s[0] - before
    out = {}
    for name, run in runs.items():
        out[name] = {"steps": run["steps"], "step_ms": run["decode_s"] / max(run["steps"], 1) * 1e3}
        if "mask_s" in run:
            out[name]["mask_fill_ms"] = run["mask_s"] / max(run["steps"], 1) * 1e3
    out["constrained_vs_none"] = out["constrained"]["step_ms"] / out["none"]["step_ms"]
    out["sample_answer"] = runs["constrained"]["answers"][0][:160] if runs["constrained"]["answers"] else ""
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.environ.get("MODEL") or None)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--mask-steps", type=int, default=200)
    parser.add_argument("--engine-new-tokens", type=int, default=48, help="0 skips the engine runs")
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--skip", default="", help="comma-separated sections to skip")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: one per core); 1 keeps a shared machine's noise down")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(args.threads or cores)
    model, tokenizer = load_model(args.model)
    vocab = LLMEngine._logits_width(model)
    xgr = xgrammar_module()
    info = {"device": str(model.device), "dtype": str(model.dtype).removeprefix("torch."), "vocab": vocab,
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "llguidance": metadata.version("llguidance"),
            "xgrammar": metadata.version("xgrammar") if xgr else None}
    print(json.dumps(info))
    result: dict = {"info": info}
    if "compile" not in skip:
        result["compile"] = {"llguidance": compile_llguidance(tokenizer, vocab, args.repeats)}
        if xgr:
            result["compile"]["xgrammar"] = compile_xgrammar(xgr, tokenizer, vocab, args.repeats)
        print("compile (ms, median): cold = grammar + matcher + first mask; cached = a copy from the cache")
        for lib, table in result["compile"].items():
            print(f"  {lib}: tokenizer {table['tokenizer_s']:.2f} s")
            for name, t in table.items():
                if name != "tokenizer_s":
                    print(f"    {name:<42} cold {t['cold_ms']:8.2f}   cached {t['cached_copy_ms']:7.3f}")
    if "masks" not in skip:
        result["masks"] = mask_walk(tokenizer, vocab, args.rows, args.mask_steps, xgr)
        print(f"masks of {args.rows} rows per step (ms):", json.dumps(result["masks"]))
    if "coverage" not in skip:
        result["coverage"] = {"llguidance": coverage_llguidance()}
        if xgr:
            result["coverage"]["xgrammar"] = coverage_xgrammar(xgr, tokenizer, vocab)
        print("JSON-schema coverage:")
        for name in COVERAGE:
            print(f"  {name:<30}" + "  ".join(f"{lib}: {table[name]:<40}" for lib, table in
                                              result["coverage"].items()))
    if "sampler" not in skip:
        result["sampler"] = sampler_table(model, tokenizer, args.rows, args.repeats, args.workload)
        print(f"{'rows':>5} {'kind':<18} {'baseline ms':>12} {'new ms':>8} {'new/base':>9} {'constrained ms':>15} "
              f"{'constr/new':>11}")
        for r in result["sampler"]:
            print(f"{r['rows']:>5} {r['kind']:<18} {r['baseline_ms']:>12.2f} {r['new_ms']:>8.2f} "
                  f"{r['new_vs_baseline']:>8.2f}x {r['new_constrained_ms']:>15.2f} {r['constrained_vs_new']:>10.2f}x")
    if args.engine_new_tokens and "engine" not in skip:
        result["engine"] = {}
        for label, sampling in (("greedy", KINDS["greedy"]), ("sampled", KINDS["all_processors"])):
            table = engine_table(args.model, tokenizer, args.rows, args.engine_new_tokens, args.workload, sampling)
            result["engine"][label] = table
            none, constrained = table["none"], table["constrained"]
            print(f"engine, {args.rows} rows, {label}: none {none['step_ms']:.2f} ms/step, constrained "
                  f"{constrained['step_ms']:.2f} ms/step (masks {constrained.get('mask_fill_ms', 0):.2f}), "
                  f"{table['constrained_vs_none']:.3f}x over {none['steps']} steps")
        print("  a constrained answer:", result["engine"]["greedy"]["sample_answer"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
