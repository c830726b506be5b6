"""Decode attention over a paged pool on CUDA: the Triton kernels against FlexAttention's decoding kernel.

    python -m bench.decode_attention [--rows 16,64,256] [--contexts 700,2048] [--json PATH]

Qwen3-0.6B's attention shape (16 query heads over 8 KV heads of 128) in bfloat16, one layer's pool with its
blocks shuffled, every row at the same context. For each row count and context it times (median of CUDA-event
timings, after warm-up, on a fresh pool for each case):

- flex: FlexAttention's decoding kernel with the engine's block mask (full blocks listed apart, as
  attention/flex.py builds it); flex-partial: every block listed as partial (kv_num_blocks = full + 1);
- triton: paged_triton.decode at each context-split count and key tile given, and the engine's own choice
  of splits (`auto`), at KV block sizes 16 and 64.

Each figure is reported in microseconds and in GB/s of K/V read (the floor of what the call must move), and
each output is checked against the first variant's. It also prints, first, what the installed torch's flex
decoding template and heuristics say about split sizes and stages (the lines the engine's choices rest on).
"""

from __future__ import annotations

import argparse
import json
import time
import re
import sys
from pathlib import Path

import torch

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
DEVICE = "cuda"


def template_lines() -> list[str]:
    """The installed torch's lines on flex decoding's split size, SPLIT_KV and num_stages."""
    import torch._inductor as inductor

    root = Path(inductor.__file__).parent
    found = []
    patterns = {"kernel/flex/templates/flex_decode.py.jinja": r"SPLIT_KV|KV_LEN|cdiv",
                "kernel/flex/flex_decoding.py": r"split_k|SPLIT_KV|num_SM|BLOCK_N",
                "template_heuristics/triton.py": r"flex_decode|FlexDecodeConfig|sm_1|sm_9|capability"}
    for name, pattern in patterns.items():
        path = root / name
        if not path.exists():
            found.append(f"{name}: not in this torch")
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line) and len(found) < 400:
                found.append(f"{name}:{number}: {line.strip()[:150]}")
    return found


def pool(rows: int, context: int, block_size: int, dtype: torch.dtype):
    width = -(-context // block_size)
    blocks = rows * width + 1
    kv = torch.randn(2, KV_HEADS, blocks, block_size, HEAD_DIM, dtype=dtype, device=DEVICE)
    tables = torch.randperm(blocks - 1, device=DEVICE)[:rows * width].view(rows, width).to(torch.int32)
    q = torch.randn(rows, HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    lens = torch.full((rows,), context, dtype=torch.int64, device=DEVICE)
    return kv, tables, q, lens, width


def time_us(fn, repeats: int = 50) -> float:
    if DEVICE != "cuda":   # a dry run of the script (Triton interpreted): one call, timed by the clock
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)
    import triton.testing

    return 1000 * triton.testing.do_bench(fn, warmup=25, rep=repeats, return_mode="median")


def flex_case(kv, tables, q, context: int, block_size: int, partial: bool):
    """FlexAttention's decoding kernel as the engine calls it (flex.attend_decode), with its block mask or with
    every block listed as partial."""
    from worker.engine.attention import flex

    rows, width = tables.shape
    full = (context - 1) // block_size
    pool_blocks = kv.shape[2]
    last = tables[:, full:full + 1].contiguous()
    limit = (last[:, 0].long() * block_size + context - full * block_size).to(torch.int32)
    if partial:
        counts = torch.full((rows,), full + 1, dtype=torch.int32, device=DEVICE)
        indices = torch.zeros(rows, pool_blocks, dtype=torch.int32, device=DEVICE)
        indices[:, :width] = tables

        def mask_mod(b, h, q_idx, kv_idx):
            end = limit[b]
            return (kv_idx // block_size != (end - 1) // block_size) | (kv_idx < end)

        mask = flex._block_mask(counts[:, None, None], indices[:, None, None], None, None, block_size, mask_mod,
                                (HEADS // KV_HEADS, pool_blocks * block_size))
    else:
        full_num = torch.full((rows,), full, dtype=torch.int32, device=DEVICE)
        last_wide = torch.zeros(rows, width, dtype=torch.int32, device=DEVICE)
        last_wide[:, 0] = last[:, 0]
        mask = flex.paged_block_mask(tables, full_num, last_wide, limit, block_size, pool_blocks, HEADS // KV_HEADS)
    k_cache, v_cache = kv[0], kv[1]
    return lambda: flex.decode(q.transpose(0, 1), k_cache, v_cache, mask, None).transpose(0, 1)


def run(rows_list: list[int], contexts: list[int], splits_list: list[int], tiles: list[int]) -> list[dict]:
    from worker.engine.attention import paged_triton as pt

    results = []
    for context in contexts:
        for rows in rows_list:
            for block_size in (16, 64):
                torch.manual_seed(0)
                kv, tables, q, lens, width = pool(rows, context, block_size, torch.bfloat16)
                bytes_read = 2 * rows * context * KV_HEADS * HEAD_DIM * 2
                cases = {}
                for splits in ["auto"] + splits_list:
                    for tile in tiles:
                        n = pt.splits_for(rows, KV_HEADS, q.device) if splits == "auto" else splits
                        tuning = pt.Tuning(decode_block_n=tile)
                        cases[f"triton splits={splits}({n}) tile={tile}"] = (
                            lambda n=n, tuning=tuning: pt.decode(q, kv[0], kv[1], tables, lens, HEAD_DIM ** -0.5, n,
                                                                 tuning=tuning))
                if block_size == 16:
                    for partial in (False, True):
                        try:
                            cases["flex-partial" if partial else "flex"] = flex_case(kv, tables, q, context,
                                                                                    block_size, partial)
                        except Exception as exc:   # recorded, the sweep goes on
                            print(f"flex (partial={partial}) failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                first = None
                for name, fn in cases.items():
                    try:
                        out = fn()
                        if DEVICE == "cuda":
                            torch.cuda.synchronize()
                        if first is None:
                            first = out.float()
                        err = ((out.float() - first).norm() / first.norm()).item()
                        us = time_us(fn)
                    except Exception as exc:
                        print(f"{name} rows={rows} context={context} bs={block_size} failed: "
                              f"{type(exc).__name__}: {exc}", file=sys.stderr)
                        continue
                    row = dict(context=context, rows=rows, block_size=block_size, variant=name, us=us,
                               gb_s=bytes_read / us / 1e3, rel_err=err)
                    results.append(row)
                    print(f"{context:>6} {rows:>5} {block_size:>4}  {name:<34} {us:>9.1f} us {row['gb_s']:>8.0f} GB/s"
                          f"  err {err:.1e}", flush=True)
                del kv
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_attention", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="16,64,256")
    parser.add_argument("--contexts", default="700,2048")
    parser.add_argument("--splits", default="1,2,4,8,16", help="fixed split counts tried beside the engine's own")
    parser.add_argument("--tiles", default="32,64,128", help="keys per loop step (decode_block_n)")
    parser.add_argument("--no-template", action="store_true", help="skip printing torch's flex decoding lines")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true",
                        help="on CPU, through Triton's interpreter (TRITON_INTERPRET=1): checks the script, times nothing")
    args = parser.parse_args(argv)
    global DEVICE
    if args.dry_run:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (the kernels' correctness is tested on CPU: tests/test_triton_attention.py)")
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
            "sms": torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else None}
    print(info)
    lines = [] if args.no_template else template_lines()
    for line in lines:
        print(line)
    print(f"{'ctx':>6} {'rows':>5} {'bs':>4}  {'variant':<34} {'time':>12} {'read':>13}")
    results = run(ints(args.rows), ints(args.contexts), ints(args.splits), ints(args.tiles))
    if args.json:
        args.json.write_text(json.dumps({**info, "template": lines, "results": results}, indent=1))
    best = {}
    for r in results:
        key = (r["context"], r["rows"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("\nbest per (context, rows):")
    for (context, rows), r in sorted(best.items()):
        flex_us = next((x["us"] for x in results if x["context"] == context and x["rows"] == rows
                        and x["variant"] == "flex"), None)
        auto = next((x for x in results if x["context"] == context and x["rows"] == rows and x["block_size"] == 16
                     and x["variant"].startswith("triton splits=auto") and "tile=64" in x["variant"]), None)
        print(f"  ctx {context} rows {rows}: {r['variant']} bs={r['block_size']} {r['us']:.1f} us "
              f"{r['gb_s']:.0f} GB/s; engine default {auto['gb_s'] if auto else float('nan'):.0f} GB/s; "
              f"flex {flex_us if flex_us else float('nan'):.1f} us")


if __name__ == "__main__":
    main()
