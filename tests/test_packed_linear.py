"""oneDNN-packed CPU linears: same results as the dense ones, and a clean swap back."""

from __future__ import annotations

import torch

from worker.engine.weights.packed import ROW_BUCKET, PackedLinear, pack_linears, supported, unpack_linears


def test_packed_linear_matches_dense_within_float_rounding():
    torch.manual_seed(0)
    dense = torch.nn.Linear(96, 200, bias=True)
    packed = PackedLinear(dense)
    for shape in ((1, 1, 96), (1, 7, 96), (1, 16, 96), (1, 48, 96), (3, 17, 96), (33, 96)):
        x = torch.randn(*shape)
        out = packed(x)
        assert out.shape == (*shape[:-1], 200)
        torch.testing.assert_close(out, dense(x), rtol=1e-5, atol=1e-5)


def test_row_counts_share_a_few_padded_shapes_so_memory_stays_bounded():
    """oneDNN keeps state per input shape: every step's row count must not add a new one."""
    import psutil

    torch.manual_seed(0)
    packed = PackedLinear(torch.nn.Linear(576, 1536))
    with torch.no_grad():
        for rows in range(1, 2 * ROW_BUCKET + 1):   # warm the two shapes these counts pad to
            packed(torch.randn(1, rows, 576))
        before = psutil.Process().memory_info().rss
        for rows in range(2 * ROW_BUCKET + 1, 200):   # 168 new row counts, 11 new padded shapes
            packed(torch.randn(1, rows, 576))
        grown_mb = (psutil.Process().memory_info().rss - before) / 2**20
    # Unpadded, these 168 counts grew RSS by about 100 MB on a 2-core CPU VM; padded, by about 12.
    assert grown_mb < 40, f"RSS grew {grown_mb:.0f} MB over 168 row counts"


def test_pack_swaps_every_linear_and_unpack_restores_them(tiny):
    model, _ = tiny
    assert supported(model)
    originals = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    ids = torch.tensor([[1, 5, 9, 200, 3000]])
    with torch.inference_mode():
        want = model(ids).logits
        assert pack_linears(model) == len(originals) > 0
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-4)
        unpack_linears(model)
        assert {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear} == originals
        assert torch.equal(model(ids).logits, want)


def test_packing_is_skipped_off_cpu_float(tiny):
    model, _ = tiny
    model.to(torch.float16)
    assert pack_linears(model) == 0
