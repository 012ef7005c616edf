"""The decode graphs' query recorder: each layer's queries land in that layer's slice of the static
buffer, and a new forward starts again at the first layer (the counter wraps)."""

from __future__ import annotations

import torch

from kvserve.worker.cuda_graphs import GraphQueries


def test_each_layer_lands_in_its_slice_and_a_new_forward_starts_at_layer_zero():
    buffer = torch.zeros(3, 2, 4, 8)
    recorder = GraphQueries(buffer)
    first = [torch.randn(2, 4, 8) for _ in range(3)]
    for query in first:
        recorder.record(query)
    assert all(torch.equal(buffer[layer], first[layer]) for layer in range(3))
    second = [torch.randn(2, 4, 8) for _ in range(3)]
    for query in second:
        recorder.record(query)
    assert all(torch.equal(buffer[layer], second[layer]) for layer in range(3))
