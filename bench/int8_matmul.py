"""Every w8a8 matmul of a model in turn (q/k/v, o, gate/up and down in each layer, then the head), by kernel and rows.

    python -m bench.int8_matmul [--config smollm2-135m] [--rows 1,4,16,48,64,128] [--repeats 15]
                                [--kernels vnni,amx,avx2,torch._int_mm] [--json PATH]

Random weights of the config's shapes, quantised and laid out as the engine does (`Int8Matmul`): a matmul's time
does not depend on its values. The default model's int8 weights (134 MB) are more than the caches hold, so each
pass reads them from memory as a decode step does. Each kernel makes the engine's own call: the tile kernels
("vnni", "amx", "avx2") quantise and multiply in one C call at any row count (the engine hands VNNI's steps past
`VNNI_ROWS` rows to torch._int_mm: this measures that threshold); "torch._int_mm" quantises and scales in C around
torch's matmul. Each kernel's products are first checked against torch._int_mm's, bit for bit; then the kernels
alternate within each repeat. Prints the median ms of a whole pass and the weights' bytes over it in GB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import PretrainedConfig

from bench.random_model import read_config
from worker.engine import native
from worker.engine.weights.quantised import UNTILED, VNNI_ROWS, Int8Matmul, int8_matmul, tile_matmul

KERNELS = ("vnni", "amx", "avx2", UNTILED)


def model_matmuls(config: PretrainedConfig) -> list[Int8Matmul]:
    """One Int8Matmul per stacked linear of the model, in a forward pass's order, random weights."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)] * config.num_hidden_layers
    shapes.append((config.vocab_size, hidden))
    generator = torch.Generator().manual_seed(0)
    return [Int8Matmul([torch.randn(n, k, generator=generator)], [None]) for n, k in shapes]


def product(kernel: str, m: Int8Matmul, x: torch.Tensor, lib) -> torch.Tensor:
    if kernel == UNTILED:
        return int8_matmul(x, "", None, None, m.codes_t, m.scales, None)
    out = torch.empty(len(x), m.scales.shape[0])
    tile_matmul(lib, x, kernel, m.tiles, m.shift, m.scales, out)
    return out


def one_pass(kernel: str, matmuls: list[Int8Matmul], inputs: dict[int, torch.Tensor], lib) -> float:
    start = time.perf_counter()
    for m in matmuls:
        product(kernel, m, inputs[m.in_features], lib)
    return time.perf_counter() - start


def check(kernels: list[str], matmuls: list[Int8Matmul], inputs: dict[int, torch.Tensor], lib) -> None:
    """Each kernel's products of one layer and the head equal torch._int_mm's to the bit, or the run stops."""
    for m in [*matmuls[:4], matmuls[-1]]:
        x = inputs[m.in_features]
        expected = product(UNTILED, m, x, lib)
        for kernel in kernels:
            if not torch.equal(product(kernel, m, x, lib), expected):
                raise SystemExit(f"{kernel}: a [{len(x)}, {m.in_features}] x [{m.in_features}, "
                                 f"{m.scales.shape[0]}] product differs from torch._int_mm's")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2-135m", help="a config.json, its folder, or a built-in shape")
    parser.add_argument("--rows", default="1,4,16,48,64,128")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    lib = native.load_int8_rows()
    here = native.int8_tile_kernels()
    kernels = [k for k in args.kernels.split(",") if k == UNTILED or k in here]
    for missing in sorted(set(args.kernels.split(",")) - set(kernels)):
        print(f"{missing}: not on this CPU (tile kernels here: {', '.join(sorted(here)) or 'none'})")
    if lib is None or not kernels:
        raise SystemExit("no w8a8 kernel to measure here: the int8 row kernels need a C compiler")
    config = read_config(args.config)
    matmuls = model_matmuls(config)
    if any(m.tiles is None for m in matmuls) and any(k != UNTILED for k in kernels):
        raise SystemExit(f"{args.config}: some matmuls have shapes outside the tiles (inputs a multiple of 64 for AMX "
                         "or 4 for VNNI, outputs of 16); measure them with --kernels torch._int_mm")
    for m in matmuls:   # the engine keeps [K, N] codes only for torch._int_mm's own steps; the bench keeps them all
        if m.codes_t is None:
            m.codes_t = m.plain_codes_t().contiguous()
    weight_bytes = sum(m.tiles.numel() for m in matmuls)
    print(f"{len(matmuls)} matmuls, {weight_bytes / 1e6:.0f} MB of int8 weights, {torch.get_num_threads()} threads, "
          f"VNNI_ROWS={VNNI_ROWS}")

    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        generator = torch.Generator().manual_seed(rows)
        inputs = {k: torch.randn(rows, k, generator=generator) for k in {m.in_features for m in matmuls}}
        check(kernels, matmuls, inputs, lib)
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for repeat in range(args.repeats + 1):   # the first pass warms each kernel's code and scratch
            for kernel in kernels:
                spent = one_pass(kernel, matmuls, inputs, lib)
                if repeat:
                    times[kernel].append(spent)
        line = {"rows": rows}
        for kernel in kernels:
            median = statistics.median(times[kernel])
            # three significant figures: oneDNN's int8 matmul without VNNI reads a tiny model under 0.05 GB/s
            line[kernel] = {"ms": float(f"{median * 1e3:.3g}"), "gb_per_s": float(f"{weight_bytes / median / 1e9:.3g}")}
        results.append(line)
        print(f"{rows:5d} rows  " + "  ".join(f"{k} {line[k]['ms']:7.2f} ms ({line[k]['gb_per_s']:5.3g} GB/s)"
                                              for k in kernels))
    summary = {"config": args.config, "threads": torch.get_num_threads(), "weight_bytes": weight_bytes,
               "kernels": kernels, "results": results}
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
