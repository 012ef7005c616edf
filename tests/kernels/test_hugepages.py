"""kvserve.kernels.cpu.hugepages: the buffers behave like torch.empty, start on huge-page boundaries
when they can, and the native path's packed weights share one of them."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels.cpu import hugepages


def test_empty_is_a_plain_tensor_of_the_requested_shape():
    big = hugepages.empty((3, 1024, 1024), torch.bfloat16).zero_()   # 6 MiB: gets an aligned start
    assert big.shape == (3, 1024, 1024) and big.dtype == torch.bfloat16 and big.is_contiguous()
    big[1, 2, 3] = 5.0
    assert big.sum().item() == 5.0
    if hugepages.available():
        assert big.data_ptr() % hugepages.HUGE_PAGE_BYTES == 0
    small = hugepages.empty((7, 3), torch.float32)                # below MIN_BYTES: torch.empty
    assert small.shape == (7, 3) and small.dtype == torch.float32


def test_views_lay_tensors_out_aligned_and_disjoint():
    specs = [((3, 5), torch.bfloat16), ((1000, 1000), torch.float32), ((17,), torch.int64)]
    views = hugepages.views(specs, alignment=64)
    assert [(tuple(v.shape), v.dtype) for v in views] == [(shape, dtype) for shape, dtype in specs]
    for view in views:
        assert view.data_ptr() % 64 == 0 and view.is_contiguous()
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    for index, view in enumerate(views):
        view.fill_(index + 1)
    assert [view.flatten()[0].item() for view in views] == [1, 2, 3]


def test_packed_weights_share_one_buffer_and_compute_as_before():
    from torch import nn
    from kvserve.kernels import cpu as cpu_kernels
    if not cpu_kernels.available():
        pytest.skip("native CPU kernels not built here")
    from kvserve.model.cpu_native import NativeLinear, pack_model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 40), nn.Linear(40, 24, bias=False))
    dense = [(layer.weight.detach().to(torch.bfloat16).float(), layer.bias) for layer in model]
    plain = [cpu_kernels.pack_weight(layer.weight, bf16=True) for layer in model]
    pack_model(model, torch.bfloat16)
    assert all(isinstance(layer, NativeLinear) for layer in model)
    packed = [layer.packed_weight for layer in model]
    assert all(torch.equal(a, b) for a, b in zip(packed, plain))
    assert packed[0].untyped_storage().data_ptr() == packed[1].untyped_storage().data_ptr()
    x = torch.randn(3, 64)
    hidden = x @ dense[0][0].T + dense[0][1].detach()
    torch.testing.assert_close(model[0](x), hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[1](hidden), hidden @ dense[1][0].T, rtol=1e-5, atol=1e-5)
