"""`python -m bench.attention_bits`: does an attention give a row the same bits whatever else is computed beside it?

For causal prompts of several lengths, compares each row's output computed in the whole prompt's call with the
same row computed in a call over a shorter prefix of the prompt, and with that row alone as a decode step
(one query over its keys) would compute it. SDPA (what `generate` runs on CPU) and the engine's paged kernel
(through attention.kernel_reference) are measured on the same random inputs. An attention that gives a row other
bits at another prompt length cannot be matched bit for bit by an engine that chunks prompts, caches prefixes
or packs rows of many sequences.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from worker.engine import attention, native


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """transformers' SDPA call for one unpadded sequence whose queries are its last rows: [heads, T, d]."""
    causal = q.shape[2] > 1
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError("SDPA's causal form takes a whole prompt")
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)[0]


def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attention.kernel_reference(None, q, k, v, None)[0][0].transpose(0, 1)


def rows_that_differ(attend, length: int, heads: int, kv_heads: int, head_dim: int, seed: int) -> tuple[int, int]:
    """(rows whose bits differ between the whole prompt and a shorter prefix's call, rows whose bits differ
    between the whole prompt and a one-row decode call), over every row of one random prompt."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, length, head_dim, generator=gen)
    k = torch.randn(1, kv_heads, length, head_dim, generator=gen)
    v = torch.randn(1, kv_heads, length, head_dim, generator=gen)
    whole = attend(q, k, v)
    prefix = sum(int(not torch.equal(attend(q[:, :, :p], k[:, :, :p], v[:, :, :p])[:, p - 1], whole[:, p - 1]))
                 for p in range(1, length))
    decode = sum(int(not torch.equal(attend(q[:, :, p - 1:p], k[:, :, :p], v[:, :, :p])[:, 0], whole[:, p - 1]))
                 for p in range(1, length + 1))
    return prefix, decode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="40,100,300,700", help="comma-separated prompt lengths")
    parser.add_argument("--shape", default="9,3,64", help="query heads, KV heads, head dim (the default model's)")
    args = parser.parse_args(argv)
    heads, kv_heads, head_dim = (int(x) for x in args.shape.split(","))
    attends = {"sdpa": sdpa}
    if native.load() is not None:
        attends["kernel"] = kernel
    print(f"{'attention':<9} {'prompt':>6} {'rows unlike in a shorter prefix':>32} "
          f"{'rows unlike as a decode step':>29}")
    for name, attend in attends.items():
        for length in (int(x) for x in args.lengths.split(",")):
            prefix, decode = rows_that_differ(attend, length, heads, kv_heads, head_dim, seed=length)
            print(f"{name:<9} {length:>6} {f'{prefix}/{length - 1}':>32} {f'{decode}/{length}':>29}")
    print(f"torch={torch.__version__} threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
