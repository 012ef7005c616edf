"""oneDNN-packed CPU linears compute what nn.Linear computes, and the model packs every one of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvserve.model.cpu_linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.float32, torch.device("cpu")),
                                reason="this torch build has no oneDNN weight packing")


@pytest.mark.parametrize("rows", [0, 1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=bias)
    packed = PackedLinear(linear.weight, linear.bias)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_packed_linear_takes_non_contiguous_input() -> None:
    linear = nn.Linear(32, 16, bias=False)
    packed = PackedLinear(linear.weight, None)
    x = torch.randn(32, 8).t()
    torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_only_fp32_cpu_packs() -> None:
    assert not can_pack(torch.bfloat16, torch.device("cpu"))
    assert not can_pack(torch.float32, torch.device("meta"))


def test_pack_linears_replaces_every_linear_and_keeps_tied_embedding() -> None:
    embed = nn.Embedding(50, 16)
    model = nn.ModuleDict({"embed": embed, "a": nn.Linear(16, 16), "b": nn.Sequential(nn.Linear(16, 8), nn.ReLU())})
    model["head"] = nn.Linear(16, 50, bias=False)
    model["head"].weight = embed.weight
    x = torch.randn(3, 16)
    expected = model["head"](x)
    assert pack_linears(model) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model["head"](x), expected, atol=1e-5, rtol=1e-5)
    assert model["embed"].weight.shape == (50, 16)
