"""The paged-attention C kernel's vector path (AVX-512 or AVX2, whichever this CPU builds) against its portable path,
in one run, on decode rows and a chunk, over a float32 pool and a float16 one.

    python -m bench.attention_kernel [--contexts 64,256,1024] [--pools float32,float16] [--threads 2] [--json PATH]
                                     [--against OTHER.c]

Both are built from worker/engine/paged_attention.c (the portable one with -DPAGED_PORTABLE) and called as the
engine calls them, over a pool whose blocks are shuffled. Each figure is the median of `--repeats` calls, the
pools and paths of one shape called in turn; each output is checked against float64 attention over the same pool
(relative error), so a float16 pool's error is the kernel's arithmetic, not the pool's rounding. `f32_over_f16` is
the vector path's time over a float32 pool divided by its time over a float16 one, for the same case.
`--against` builds another version of the kernel's source as well (e.g. `git show main:worker/engine/attention/
paged_attention.c > /tmp/main.c`) and times it in the same turns: column `against_us`, `speedup` (its time over
this source's) and `same_bits` (whether its outputs equal this source's vector path's to the bit).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from worker.engine import native

# (name, query heads, KV heads, head size): the default model's shape and Qwen3-0.6B's
SHAPES = [("smollm2-135m", 9, 3, 64), ("qwen3-0.6b", 16, 8, 128)]
BLOCK_SIZE = 16


POOLS = {"float32": (torch.float32, "paged_attention_f32"), "float16": (torch.float16, "paged_attention_f16kv")}


def kernel(flags: tuple[str, ...], pool: str = "float32", source: Path | None = None):
    """One of the kernel's exported functions: this checkout's source built with `flags`, or `source`'s."""
    if source is None:
        lib = native.load(flags)
    else:
        lib = native._declared(native._build(source, "paged-attention kernel", "none", flags),
                               {name: native.ARGTYPES for _, name in POOLS.values()},
                               {name: ctypes.c_int for _, name in POOLS.values()})
    if lib is None and source is not None:
        raise SystemExit(f"{source} did not build as the paged-attention kernel (the compiler's message is above)")
    if lib is None:
        raise SystemExit("the paged-attention kernel did not build (no C compiler?)")
    return getattr(lib, POOLS[pool][1])


def case(heads: int, kv_heads: int, head_dim: int, rows: int, chunk: int, context: int, seed: int = 0,
         pool: str = "float32") -> dict:
    """`rows` sequences, each attending its last `chunk` positions (1: decode rows) at `context` tokens, over a
    pool of `pool`'s dtype."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-context // BLOCK_SIZE)
    num_blocks = rows * width + 1
    dtype = POOLS[pool][0]
    kc = torch.randn(kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    vc = torch.randn(kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:rows * width].reshape(rows, width).to(torch.int32)
    tokens = rows * chunk
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    v = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    positions = [p for _ in range(rows) for p in range(context - chunk, context)]
    row_seq = torch.tensor([r for r in range(rows) for _ in range(chunk)], dtype=torch.int32)
    row_pos = torch.tensor(positions, dtype=torch.int32)
    slots = torch.tensor([int(tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                          for s, p in zip(row_seq.tolist(), positions)], dtype=torch.int64)
    return dict(kc=kc, vc=vc, tables=tables, q=q, k=k, v=v, row_seq=row_seq, row_pos=row_pos, slots=slots,
                heads=heads, kv_heads=kv_heads, head_dim=head_dim, width=width, context=context, tokens=tokens)


def call(fn, c: dict, out: torch.Tensor, threads: int) -> None:
    q, k, v = c["q"], c["k"], c["v"]
    rc = fn(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
            v.data_ptr(), v.stride(0), v.stride(1), c["kc"].data_ptr(), c["vc"].data_ptr(), c["kc"].shape[1],
            BLOCK_SIZE, c["heads"], c["kv_heads"], c["head_dim"], c["slots"].data_ptr(), c["tokens"],
            c["row_seq"].data_ptr(), c["row_pos"].data_ptr(), c["tables"].data_ptr(), c["width"], c["context"],
            c["head_dim"] ** -0.5, out.data_ptr(), threads)
    if rc != 0:
        raise RuntimeError("the kernel refused the shape")


def reference(c: dict) -> torch.Tensor:
    """float64 attention of every row over its sequence's keys up to its position (after the step's writes)."""
    kv_heads, head_dim, heads = c["kv_heads"], c["head_dim"], c["heads"]
    out = torch.empty(c["tokens"], heads, head_dim, dtype=torch.float64)
    for t, (s, p) in enumerate(zip(c["row_seq"].tolist(), c["row_pos"].tolist())):
        blocks = c["tables"][s].long()
        keys = c["kc"][:, blocks].reshape(kv_heads, -1, head_dim)[:, :p + 1].double()
        values = c["vc"][:, blocks].reshape(kv_heads, -1, head_dim)[:, :p + 1].double()
        qr = c["q"][t].double().reshape(kv_heads, heads // kv_heads, head_dim)
        weights = torch.softmax(qr @ keys.transpose(1, 2) * head_dim ** -0.5, -1)
        out[t] = (weights @ values).reshape(heads, head_dim)
    return out


def timed_together(runs: list[tuple], threads: int, repeats: int) -> list[tuple[float, torch.Tensor]]:
    """runs: (kernel, case) pairs, called in turn within each repeat, so a shared machine's slow spells fall on all
    of them alike, in an order shuffled every repeat, so each comes after each other as often (a run after one over
    another pool finds less of its own in cache); each one's median microseconds and last output."""
    outs = [torch.full((c["tokens"], c["heads"], c["head_dim"]), float("nan")) for _, c in runs]
    for (fn, c), out in zip(runs, outs):
        for _ in range(3):
            call(fn, c, out, threads)
    times = [[] for _ in runs]
    shuffle = random.Random(0).shuffle
    order = list(range(len(runs)))
    for _ in range(repeats):
        shuffle(order)
        for i in order:
            fn, c = runs[i]
            start = time.perf_counter()
            call(fn, c, outs[i], threads)
            times[i].append(time.perf_counter() - start)
    return [(statistics.median(t) * 1e6, out) for t, out in zip(times, outs)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="64,256,1024", help="decode rows' context lengths")
    parser.add_argument("--rows", type=int, default=16, help="decode rows (sequences) per call")
    parser.add_argument("--chunk", type=int, default=128, help="also one prefill chunk of this many rows (0: none)")
    parser.add_argument("--pools", default="float32,float16", help="KV pool dtypes: float32, float16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--against", type=Path, default=None, metavar="OTHER.c",
                        help="another version of paged_attention.c, timed in the same turns")
    args = parser.parse_args(argv)
    if args.against is not None and not args.against.is_file():
        raise SystemExit(f"--against {args.against}: no such file; give another version of paged_attention.c, e.g. "
                         f"git show main:worker/engine/attention/paged_attention.c > /tmp/main.c")
    pools = args.pools.split(",")
    unknown = [p for p in pools if p not in POOLS]
    if unknown:
        raise SystemExit(f"unknown pool dtype {unknown[0]!r}: choose from {', '.join(POOLS)}")

    path = native.attention_path()
    if path is None:
        raise SystemExit("the paged-attention kernel did not build (no C compiler?)")
    print(f"vector path built here: {path}" + (" (none: both columns time the portable loops)"
                                               if path == "portable" else ""))
    rows = []
    variants = ("portable", "vector") + (("against",) if args.against else ())
    print(f"{'shape':14} {'rows':16} {'context':>7} {'pool':>7} {'portable_us':>12} {'vector_us':>10} {'ratio':>6} "
          f"{'err_portable':>12} {'err_vector':>10}"
          + (f" {'against_us':>10} {'speedup':>7} {'same_bits':>9}" if args.against else ""))
    for name, heads, kv_heads, head_dim in SHAPES:
        shapes = [(f"{args.rows} decode rows", args.rows, 1, int(x)) for x in args.contexts.split(",")]
        if args.chunk:
            shapes.append((f"chunk of {args.chunk}", 1, args.chunk, 4 * args.chunk))
        for what, seqs, chunk, context in shapes:
            # every pool and path of one shape timed in turn, each over its own pool of the same random values
            runs, refs = [], []
            for pool in pools:
                c = case(heads, kv_heads, head_dim, seqs, chunk, context, pool=pool)
                portable = kernel(("-DPAGED_PORTABLE",), pool)
                call(portable, c, torch.empty(c["tokens"], c["heads"], c["head_dim"]), args.threads)
                refs.append(reference(c))   # over the pool as a call leaves it: the step's own keys and values written
                runs += [(portable, c), (kernel((), pool), c)]
                if args.against:
                    runs.append((kernel((), pool, args.against), c))
            timings = iter(timed_together(runs, args.threads, args.repeats))
            for pool, ref in zip(pools, refs):
                row = {"shape": name, "rows": what, "context": context, "pool": pool}
                outs = {}
                for variant in variants:
                    us, outs[variant] = next(timings)
                    row[f"{variant}_us"] = us
                    row[f"err_{variant}"] = ((outs[variant].double() - ref).norm() / ref.norm()).item()
                row["ratio"] = row["portable_us"] / row["vector_us"]
                if args.against:
                    row["speedup"] = row["against_us"] / row["vector_us"]
                    row["same_bits"] = torch.equal(outs["against"], outs["vector"])
                if pool == "float16" and "float32" in pools:
                    f32 = next(r for r in rows[::-1] if r["pool"] == "float32")
                    row["f32_over_f16"] = f32["vector_us"] / row["vector_us"]
                rows.append(row)
                print(f"{name:14} {what:16} {context:7d} {pool:>7} {row['portable_us']:12.1f} "
                      f"{row['vector_us']:10.1f} {row['ratio']:6.2f} {row['err_portable']:12.1e} "
                      f"{row['err_vector']:10.1e}"
                      + (f" {row['against_us']:10.1f} {row['speedup']:7.2f} {str(row['same_bits']):>9}"
                         if args.against else "")
                      + (f"   float32/float16 {row['f32_over_f16']:.2f}x" if "f32_over_f16" in row else ""))
    result = {"threads": args.threads, "path": path, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
