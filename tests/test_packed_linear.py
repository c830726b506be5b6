"""oneDNN-packed CPU linears: same results as the dense ones, and a clean swap back."""

from __future__ import annotations

import torch

from worker.engine.packed_linear import PackedLinear, pack_linears, supported, unpack_linears


def test_packed_linear_matches_dense_within_float_rounding():
    torch.manual_seed(0)
    dense = torch.nn.Linear(96, 200, bias=True)
    packed = PackedLinear(dense)
    for rows in (1, 7, 16, 48):
        x = torch.randn(1, rows, 96)
        torch.testing.assert_close(packed(x), dense(x), rtol=1e-5, atol=1e-5)


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
