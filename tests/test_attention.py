"""The attention backends against each other and plain causal attention, on random pools and tables."""

from __future__ import annotations

import platform
import random
import subprocess

import pytest
import torch
import torch.nn.functional as F

from worker.engine import attention, native
from worker.engine.attention import flex
from worker.engine.attention import Span
from worker.engine.device import buckets

needs_kernel = pytest.mark.skipif(native.load() is None, reason="no C compiler for the paged-attention kernel")


class Layer(torch.nn.Module):
    layer_idx = 1


def random_step(heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int, long: bool = False):
    """A step of decodes and prefill chunks (some with a cached prefix) over shuffled blocks. long: contexts of
    hundreds of tokens, past the C kernel's blocks of keys."""
    gen = random.Random(seed)
    # (tokens already cached, new rows): decodes first, then chunks with and without a prefix.
    shapes = [(gen.randint(1, 700 if long else 60), 1) for _ in range(5)] + [(0, 23), (17, 9), (32, 1), (5, 40)]
    if long:
        shapes[-3:] = [(300, 9), (520, 1), (130, 40)]
    num_blocks = max(512, sum(-(-(c + n) // block_size) for c, n in shapes) + 1)
    free = list(range(num_blocks))
    gen.shuffle(free)
    spans, slots, row = [], [], 0
    history = []   # every sequence's full K/V, to check against dense attention
    for cached, n in shapes:
        context = cached + n
        table = [free.pop() for _ in range(-(-context // block_size))]
        spans.append(Span(row, n, context, table))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, context)]
        row += n
        history.append((torch.randn(kv_heads, context, head_dim), torch.randn(kv_heads, context, head_dim)))
    kv = torch.zeros(2, 2, kv_heads, num_blocks, block_size, head_dim)
    for span, (k, v) in zip(spans, history):   # the cached prefix is already in the pool
        for p in range(span.context - span.length):
            b, o = span.table[p // block_size], p % block_size
            kv[0, 1, :, b, o], kv[1, 1, :, b, o] = k[:, p], v[:, p]
    new_k = torch.cat([k[:, s.context - s.length:] for s, (k, _) in zip(spans, history)], dim=1)
    new_v = torch.cat([v[:, s.context - s.length:] for s, (_, v) in zip(spans, history)], dim=1)
    q = torch.randn(row, heads, head_dim).transpose(0, 1)     # [heads, T, d] as a strided view, like the models'
    return kv, spans, slots, q, new_k, new_v, history


def dense_reference(q, spans, history, heads, kv_heads):
    out = torch.empty(q.shape[1], heads, q.shape[2])
    for s, (k, v) in zip(spans, history):
        qs = q[:, s.start:s.start + s.length]
        first = s.context - s.length
        mask = torch.arange(s.context)[None, :] <= torch.arange(first, s.context)[:, None]
        o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask,
                                           enable_gqa=heads != kv_heads)[0]
        out[s.start:s.start + s.length] = o.transpose(0, 1)
    return out


SHAPES = [(4, 2, 16, 4), (9, 3, 64, 16), (6, 6, 8, 1)]   # heads, kv_heads, head_dim, block_size
# The C kernel's register layouts: on AVX-512 head sizes of 4 and 8 registers fixed at compile time, others (16, 32)
# by a loop, and sizes that are not a multiple of 16 (8, 24) take the portable path; on AVX2 every multiple of 8
# (24: a last slab of three registers); 12 is the portable path's everywhere.
KERNEL_SHAPES = [*SHAPES, (8, 2, 128, 16), (6, 3, 32, 8), (4, 2, 24, 4), (4, 2, 12, 4)]
COMPILED = ("gather-in-place", "flex")   # FlexAttention: each shape is a compile of its own (seconds on CPU)


@pytest.mark.parametrize("backend,heads,kv_heads,head_dim,block_size",
                         [pytest.param("kernel", *shape, marks=needs_kernel) for shape in KERNEL_SHAPES]
                         + [("gather", *shape) for shape in SHAPES]
                         + [(b, *shape) for b in COMPILED for shape in SHAPES[:2]])
def test_backend_writes_the_pool_and_matches_dense_attention(backend, heads, kv_heads, head_dim, block_size,
                                                             two_threads):
    """gather-in-place: the gather backend with block tables, as on CUDA: decode rows and the chunks with a
    cached prefix read the pool in place, only the chunks with nothing cached go to SDPA."""
    kv, spans, slots, q, k, v, history = random_step(heads, kv_heads, head_dim, block_size, seed=heads)
    paged = None
    if backend in ("flex", "gather-in-place"):
        flex.start_engine()   # as each engine does: this test's shapes are new constants
        width = max(len(s.table) for s in spans)
        paged = flex.PagedTables(8, width, kv.shape[3], block_size, heads // kv_heads, scratch_block=0,
                                 device=kv.device)
    ctx = attention.build_context(backend.removesuffix("-in-place"), kv, slots, spans, num_decodes=5,
                                  block_size=block_size, paged=paged)
    if backend == "gather-in-place":   # 5 decode rows padded to a compiled row count; 3 chunks have a prefix
        assert ctx.decode_blocks is None and ctx.decode_block_mask.kv_num_blocks.shape[0] == 8
        assert [c.length for c in ctx.prefills] == [23]
        assert ctx.prefill_rows.tolist() == list(range(28, 28 + 9 + 1 + 40))
    attention.set_context(ctx)
    try:
        out, _ = attention.paged_attention(Layer(), q[None], k[None], v[None], None)
    finally:
        attention.set_context(None)
    torch.testing.assert_close(out[0], dense_reference(q, spans, history, heads, kv_heads), atol=1e-5, rtol=1e-4)
    # Every new row landed in its slot of layer 1, and nothing was written to layer 0.
    flat_k = kv[0, 1].reshape(kv_heads, -1, head_dim)
    torch.testing.assert_close(flat_k[:, slots], k)
    assert not kv[:, 0].any()


def kernel_step(pool, slots, spans, block_size, q, k, v):
    """The kernel backend's attention for random_step's rows over `pool` (its new rows k, v written into layer 1)."""
    attention.set_context(attention.build_context("kernel", pool, slots, spans, num_decodes=5, block_size=block_size))
    try:
        return attention.paged_attention(Layer(), q[None], k[None], v[None], None)[0]
    finally:
        attention.set_context(None)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", KERNEL_SHAPES)
def test_the_kernel_attends_contexts_longer_than_its_blocks_of_keys(heads, kv_heads, head_dim, block_size,
                                                                   two_threads):
    """Decodes and chunks over hundreds of cached tokens: the vector paths read keys and values in blocks (the
    AVX-512 path's hold 32-512 keys, by head size), carrying each query's output from block to block. Over a
    float32 pool the kernel is dense attention's; over a float16 one, the float32 kernel's over the rounded rows to
    the bit (whether a tile converts each block once or each row as it reads it)."""
    kv, spans, slots, q, k, v, history = random_step(heads, kv_heads, head_dim, block_size, seed=heads, long=True)
    assert max(s.context for s in spans) > 512
    outs = [kernel_step(pool, slots, spans, block_size, q, new_k, new_v)
            for pool, new_k, new_v in ((kv, k, v), (kv.half(), k, v),
                                       (kv.half().float(), k.half().float(), v.half().float()))]
    torch.testing.assert_close(outs[0][0], dense_reference(q, spans, history, heads, kv_heads), atol=1e-5, rtol=1e-4)
    assert torch.equal(outs[1], outs[2])


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", KERNEL_SHAPES)
def test_the_kernel_over_a_float16_pool_computes_the_float32_kernel_over_the_rows_rounded(heads, kv_heads, head_dim,
                                                                                         block_size, two_threads):
    """A float16 pool holds each new row rounded to nearest (torch's .half()), and attending over it is the float32
    kernel's arithmetic over those rounded rows, to the bit (on the portable path and the vector paths alike)."""
    kv, spans, slots, q, k, v, history = random_step(heads, kv_heads, head_dim, block_size, seed=heads)
    kv16 = kv.half()
    outs = [kernel_step(pool, slots, spans, block_size, q, new_k, new_v)
            for pool, new_k, new_v in ((kv16, k, v), (kv16.float(), k.half().float(), v.half().float()))]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(kv16[0, 1].reshape(kv_heads, -1, head_dim)[:, slots], k.half())
    assert torch.equal(kv16[1, 1].reshape(kv_heads, -1, head_dim)[:, slots], v.half())
    assert not kv16[:, 0].any()
    full = dense_reference(q, spans, history, heads, kv_heads)
    torch.testing.assert_close(outs[0][0], full, atol=5e-3, rtol=5e-3)   # within float16's rounding of the rows


@needs_kernel
def test_the_kernel_builds_the_widest_vector_path_this_cpu_has():
    flags = set(native._cpu_identity().split())
    expected = ("avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma", "f16c"} <= flags else "portable")
    assert native.attention_path() == expected
    assert native.attention_path(("-DPAGED_PORTABLE",)) == "portable"


@pytest.mark.skipif(platform.machine() != "x86_64" or native._compiler() is None, reason="x86-64 and a C compiler")
@pytest.mark.parametrize("march,path", [("skylake-avx512", "avx512"), ("haswell", "avx2"), ("x86-64", "portable")])
def test_each_vector_path_of_the_kernel_builds_for_its_cpu_whatever_this_one_has(march, path, tmp_path):
    """This CPU runs one of the kernel's paths; the others must still compile for the CPUs that take them."""
    source = native.SOURCE.read_text() + "\nint main(void) { return paged_attention_path(); }\n"
    (tmp_path / "kernel.c").write_text(source)
    build = subprocess.run([native._compiler(), "-O1", f"-march={march}", "-fopenmp", str(tmp_path / "kernel.c"),
                            "-o", str(tmp_path / "kernel"), "-lm"], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-2000:]
    assert "warning" not in build.stderr, build.stderr[-2000:]
    flags = set(native._cpu_identity().split())
    runs_here = {"avx512": "avx512f" in flags, "avx2": {"avx2", "fma", "f16c"} <= flags, "portable": True}[path]
    if runs_here:   # the binary says which path it was built with
        code = subprocess.run([str(tmp_path / "kernel")]).returncode
        assert native.ATTENTION_PATHS[code] == path


def test_backend_choice_follows_the_config_then_the_device(monkeypatch):
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    cpu = torch.device("cpu")
    assert attention.choose_backend("gather", cpu, torch.float32) == "gather"
    assert attention.choose_backend(None, cpu, torch.bfloat16) == "gather"
    expected = "kernel" if native.load() is not None else "gather"
    assert attention.choose_backend(None, cpu, torch.float32) == expected
    with pytest.raises(ValueError, match="float32 on CPU only"):
        attention.choose_backend("kernel", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="Unknown attention backend"):
        attention.choose_backend("flash", cpu, torch.float32)
    # CUDA (no device needed to choose): the Triton kernels where Triton imports (any block size), else flex where
    # its kernel takes the block size, else gather, as asked
    cuda = torch.device("cuda")
    assert attention.choose_backend(None, cuda, torch.bfloat16) == "triton"
    assert attention.choose_backend(None, cuda, torch.float32, block_size=8) == "triton"
    assert attention.choose_backend("gather", cuda, torch.bfloat16) == "gather"
    assert attention.choose_backend("flex", cuda, torch.bfloat16) == "flex"
    monkeypatch.setattr(attention.paged, "triton_available", lambda: False)
    assert attention.choose_backend(None, cuda, torch.bfloat16) == "flex"
    assert attention.choose_backend(None, cuda, torch.float32, block_size=8) == "gather"


def test_without_a_compiler_the_gather_backend_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("MODEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_compiler", lambda: None)
    native.load.cache_clear()
    try:
        assert native.load() is None
        assert attention.choose_backend(None, torch.device("cpu"), torch.float32) == "gather"
    finally:
        native.load.cache_clear()


def test_decode_buckets_grow_by_eight_past_sixteen_and_end_at_the_slot_count():
    assert buckets(1) == [1]
    assert buckets(4) == [1, 2, 4]
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert buckets(50) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]
    assert buckets(6) == [1, 2, 4, 6]


def test_flex_decode_reads_the_pool_in_place_through_tables_rewritten_between_calls():
    """The static-buffer decode path: one BlockMask over int32 buffers, refilled for each step as a graph
    replay would see them, with stale ids left in the columns a row does not use."""
    heads, kv_heads, head_dim, block_size, rows = 9, 3, 64, 16, 5
    kv, *_ = random_step(heads, kv_heads, head_dim, block_size, seed=0)
    flex.start_engine()
    pool_blocks = kv.shape[3]
    width = 8   # a row holds far fewer blocks than the pool (512)
    tables = torch.randint(0, pool_blocks, (rows, width), dtype=torch.int32)   # stale ids everywhere
    last = torch.randint(0, pool_blocks, (rows, 1), dtype=torch.int32)
    full_num = torch.zeros(rows, dtype=torch.int32)
    limit = torch.ones(rows, dtype=torch.int32)
    mask = flex.paged_block_mask(tables, full_num, last, limit, block_size, pool_blocks, heads // kv_heads)
    for seed in (1, 2):
        step_kv, spans, slots, q, k, v, history = random_step(heads, kv_heads, head_dim, block_size, seed=seed)
        kv.copy_(step_kv)
        decodes = spans[:rows]
        for i, s in enumerate(decodes):   # the decode rows' new K/V are in the pool already
            for p in range(s.context - 1, s.context):
                b, o = s.table[p // block_size], p % block_size
                kv[0, 1, :, b, o], kv[1, 1, :, b, o] = history[i][0][:, p], history[i][1][:, p]
            full = (s.context - 1) // block_size
            tables[i, :full] = torch.tensor(s.table[:full], dtype=torch.int32)
            full_num[i], last[i, 0] = full, s.table[full]
            limit[i] = s.table[full] * block_size + s.context - full * block_size
        out = flex.decode(q[:, :rows], kv[0, 1], kv[1, 1], mask, None)
        want = dense_reference(q, decodes, history[:rows], heads, kv_heads)[:rows].transpose(0, 1)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


def test_flex_decode_buffers_grow_with_the_longest_context_not_with_the_pool():
    """A GPU pool holds hundreds of thousands of blocks; 256 decode rows' tables must not be that wide."""
    rows, width, pool_blocks = 256, 512, 200_000
    paged = flex.PagedTables(rows, width, pool_blocks, 16, 3, scratch_block=pool_blocks - 1,
                             device=torch.device("cpu"))
    assert paged.logical is None   # the prefill map is made only when the flex backend prefills
    assert paged.nbytes < 2 * rows * width * 4 + 64 * rows
    mask = paged.mask(rows)
    assert mask.kv_indices.shape[-1] == pool_blocks   # the CPU kernel's view spans the pool ...
    assert mask.kv_indices.stride(-1) == 0            # ... without allocating it


def test_on_a_gpu_both_decode_block_lists_share_one_layout():
    """The GPU kernels read the full-block list through the partial list's strides and width."""
    paged = flex.PagedTables(256, 512, 200_000, 16, 3, scratch_block=0, device=torch.device("meta"))
    assert paged.nbytes < 3 * 256 * 512 * 4 + 64 * 256
    for rows in (1, 24, 256):
        mask = paged.mask(rows)
        assert mask.kv_indices.shape == mask.full_kv_indices.shape == (rows, 1, 1, 512)
        assert mask.kv_indices.stride() == mask.full_kv_indices.stride()
        # The main kernel offsets every list as a contiguous [batch, heads, rows, columns] tensor.
        for t in (mask.kv_indices, mask.full_kv_indices, mask.kv_num_blocks, mask.full_kv_num_blocks):
            assert t.is_contiguous()


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128, 272])
def test_the_gpu_kernel_tile_divides_every_block_size_flex_takes(block_size):
    """The main Triton kernel raises when its KV tile does not divide the KV block size."""
    assert flex.fits(torch.device("cuda"), block_size)
    tile = flex.gpu_kernel_options(block_size)["BLOCK_N"]
    assert block_size % tile == 0 and 16 <= tile <= 64


def test_decode_row_counts_are_few_powers_of_four_ending_at_the_slot_count():
    assert flex.kernel_rows(1) == [1]
    assert flex.kernel_rows(4) == [1, 4]
    assert flex.kernel_rows(6) == [1, 4, 6]
    assert flex.kernel_rows(256) == [1, 4, 16, 64, 256]
    assert len(flex.kernel_rows(1_000_000)) <= flex.DECODE_COMPILE_LIMIT
    paged = flex.PagedTables(256, 64, 1000, 16, 2, scratch_block=999, device=torch.device("cpu"))
    assert [paged.rows_for(n) for n in (1, 2, 5, 16, 17, 200, 256)] == [1, 4, 16, 16, 64, 256, 256]


def test_every_bucket_copies_its_step_rows_from_one_contiguous_block():
    """A strided slice of a pinned buffer is copied through pageable memory: each bucket's rows must be the start
    of the buffer, contiguous, on the host and on the device."""
    from worker.engine.device import DecodeGraphs

    kv = torch.zeros(2, 1, 2, 65, 16, 8)
    for mode in ("flex", "gather"):
        graphs = DecodeGraphs(torch.nn.Identity(), kv, 64, 16, 40, 512, use_graphs=False, attention_mode=mode)
        staged = [graphs.rows] + ([graphs.paged.counts] if mode == "flex" else [])
        for buffer in staged:
            for b in graphs.sizes:
                for view, flat in ((buffer.host(b), buffer.host_flat), (buffer.device(b), buffer.device_flat)):
                    assert view.is_contiguous() and view.data_ptr() == flat.data_ptr()
                    assert view.shape == (buffer.fields, b)
            if torch.cuda.is_available():
                assert buffer.host_flat.is_pinned()
        if mode == "flex":
            for b in graphs.sizes:   # the rows the decode kernel reads for a bucket: leading rows, contiguous
                mask = graphs.paged.mask(graphs.paged.rows_for(b))
                assert mask.kv_num_blocks.is_contiguous() and mask.full_kv_indices.is_contiguous()


def test_slot_tables_write_a_row_whole_for_a_new_owner_and_only_new_ids_after():
    from worker.engine.block_tables import RowOrder, SlotTables

    tables = SlotTables(3, 8, fill=99, dtype=torch.int32, device=torch.device("cpu"))
    a, b, c = object(), object(), object()
    assert tables.write([a, b], [[5, 6, 7], [1, 2]], [2, 1]) == 3
    assert tables.write([a, b], [[5, 6, 7], [1, 2]], [2, 1]) == 0          # nothing new
    assert tables.write([a, b], [[5, 6, 7], [1, 2]], [3, 1]) == 1          # a crossed into a new block
    assert tables.tables[0, :3].tolist() == [5, 6, 7] and tables.tables[1, 0] == 1
    assert tables.write([c, b], [[8, 9], [1, 2]], [2, 2]) == 3             # c replaced a: whole row; b: one id
    assert tables.tables[0, :2].tolist() == [8, 9] and tables.tables[1, :2].tolist() == [1, 2]
    assert tables.write([None], [[4]], [1]) == 1 and tables.write([None], [[4]], [1]) == 1   # unknown: always
    order = RowOrder()
    assert order.arrange([a, b, c]) == [a, b, c]
    assert order.arrange([c, a]) == [a, c]             # b left: c moves into its row, a keeps row 0
    assert order.arrange([b, a, c]) == [a, c, b]       # a newcomer takes the next free row
    assert order.row(b) == 2 and order.row(object()) is None


def allocated_bytes(fn) -> int:
    """Bytes the profiler saw allocated while fn ran (every allocation, freed or not: a bound on the peak)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.key_averages() if e.self_cpu_memory_usage > 0)


@pytest.mark.parametrize("in_place", [False, True], ids=["gather", "gather-in-place"])
def test_a_mixed_step_beside_a_long_row_allocates_with_its_tokens_not_decodes_times_the_longest(in_place):
    """32 short decodes, one decode of a long context and a chunk with a long cached prefix. Copying contexts
    out costs decodes x the longest context (and a [rows, context] mask for the chunk); reading in place costs
    what the step's tokens cost, whatever the longest context."""
    heads, kv_heads, d, bs, num_blocks = 4, 2, 16, 16, 600

    def step(longest: int):
        gen = random.Random(longest)
        free = list(range(num_blocks))
        gen.shuffle(free)
        spans, slots, row = [], [], 0
        for cached, n in [(31, 1)] * 32 + [(longest, 1), (longest - 100, 64)]:
            context = cached + n
            table = [free.pop() for _ in range(-(-context // bs))]
            spans.append(Span(row, n, context, table))
            slots += [table[p // bs] * bs + p % bs for p in range(cached, context)]
            row += n
        q = torch.randn(row, heads, d).transpose(0, 1)
        return spans, slots, q, torch.randn(kv_heads, row, d), torch.randn(kv_heads, row, d)

    kv = torch.randn(2, 2, kv_heads, num_blocks + 1, bs, d)
    paged = None
    if in_place:
        flex.start_engine()
        paged = flex.PagedTables(64, 300, num_blocks + 1, bs, heads // kv_heads, num_blocks, kv.device)
    measured = {}
    for longest in (1000, 4000):
        spans, slots, q, k, v = step(longest)

        def attend():
            ctx = attention.build_context("gather", kv, slots, spans, 33, bs, paged)
            attention.set_context(ctx)
            try:
                return attention.paged_attention(Layer(), q[None], k[None], v[None], None)[0]
            finally:
                attention.set_context(None)

        attend()   # compiles (in place) and makes the chunk map: once per engine, not per step
        measured[longest] = allocated_bytes(attend)
    tokens = 33 + 64
    copied = 33 * 4000 * kv_heads * d * 4
    if in_place:
        assert measured[4000] <= 32 * tokens * heads * d * 4
        assert measured[4000] <= 1.1 * measured[1000]
    else:   # what the in-place path avoids: this test tells the two apart
        assert measured[4000] >= copied and measured[4000] > 3 * measured[1000]


def test_warming_the_prefill_form_leaves_nothing_to_compile_for_chunks_over_a_cached_prefix():
    """On CUDA the runner compiles FlexAttention's prefill form at start (the gather backend reads cached
    prefixes through it): chunks of any length later find a compiled variant."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    heads, kv_heads, head_dim, block_size = 4, 2, 16, 16
    kv, *_ = random_step(heads, kv_heads, head_dim, block_size, seed=3)
    flex.start_engine()
    paged = flex.PagedTables(8, 64, kv.shape[3], block_size, heads // kv_heads, scratch_block=511, device=kv.device)
    with torch.inference_mode():
        flex.warm_prefill(paged, kv[0, 1], kv[1, 1], heads)
        compiled = len(_debug_get_cache_entry_list(flex_attention.__code__))
        assert compiled >= 1
        gen = random.Random(5)
        for length, cached in ((1, 40), (23, 17), (130, 5), (2, 300)):
            table = gen.sample(range(500), -(-(cached + length) // block_size))
            mask = paged.prefill_mask([Span(0, length, cached + length, table)])
            flex.prefill(torch.randn(heads, length, head_dim), kv[0, 1], kv[1, 1], mask, None)
    assert len(_debug_get_cache_entry_list(flex_attention.__code__)) == compiled


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", KERNEL_SHAPES)
def test_the_kernel_reference_gives_each_row_the_bits_it_gets_in_any_packed_paged_step(heads, kv_heads, head_dim,
                                                                                     block_size, two_threads):
    """`generate` on KERNEL_REFERENCE attends a whole prompt at once, then one row per step, over a contiguous
    cache; the engine packs chunks and decodes of many sequences over shuffled blocks. Each row's bits agree."""
    kv, spans, slots, q, k, v, history = random_step(heads, kv_heads, head_dim, block_size, seed=heads + 1)
    ctx = attention.build_context("kernel", kv, slots, spans, num_decodes=5, block_size=block_size)
    attention.set_context(ctx)
    try:
        packed = attention.paged_attention(Layer(), q[None], k[None], v[None], None)[0][0]
    finally:
        attention.set_context(None)
    for s, (keys, values) in zip(spans, history):
        rows = q[:, s.start:s.start + s.length]
        whole = attention.kernel_reference(Layer(), rows[None], keys[None], values[None], None)[0][0]
        assert torch.equal(whole, packed[s.start:s.start + s.length])
        for i in range(s.length):   # one row at a time, as decode steps see them
            end = s.context - s.length + i + 1
            one = attention.kernel_reference(Layer(), rows[None, :, i:i + 1], keys[None, :, :end],
                                             values[None, :, :end], None)[0][0]
            assert torch.equal(one[0], packed[s.start + i])


@needs_kernel
def test_the_kernel_reference_refuses_a_padded_batch_with_what_to_pass_instead():
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8)
    with pytest.raises(ValueError, match="batch of one"):
        attention.kernel_reference(Layer(), q, k, k, None)
