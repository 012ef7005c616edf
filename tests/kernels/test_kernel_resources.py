"""kvserve.eval.kernel_resources (benchmarks/kernels/kernel_resources.py): the fused-dequant decode kernel
compiled for sm_90 without a GPU.

Checks what docs/kv_quantization.md's analysis rests on: the register cap is honoured, and the
compiler's cp.async pipeline takes the K/V loads when their block ids are loaded in the loop but not
when they come from the run-ahead load (`ids_ahead`). Needs triton (its wheel bundles ptxas and
cuobjdump), not a GPU; skipped without triton.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from kvserve.eval import kernel_resources  # noqa: E402


def test_register_cap_and_pipelining_of_the_quantized_decode_kernel():
    capped = kernel_resources.quant_decode("int8", tile=128, num_warps=4, ids_ahead=True, max_registers=128,
                                           window=False, group=0, sass_mix=True)
    assert capped["registers"] <= 128
    assert capped["async_copies"] == 0
    assert capped["sass_mix"]["HMMA"] > 0            # the dots run on tensor cores
    in_loop = kernel_resources.quant_decode("int8", tile=64, num_warps=4, ids_ahead=False, max_registers=None,
                                            window=False, group=0, sass_mix=False)
    assert in_loop["async_copies"] > 0
    assert in_loop["registers"] > 128


def test_cli_reports_resources(capsys):
    assert kernel_resources.main(["quant-decode", "--format", "int4", "--tile", "64"]) == 0
    out = capsys.readouterr().out
    assert "registers:" in out and "shared_bytes:" in out


def test_pipelined_kernel_copies_ahead_with_a_shorter_loop():
    """The pipelined 8-bit kernel (Gluon) issues its K/V loads as asynchronous copies, runs its dots on
    tensor cores, and its loop body is shorter per tile than the Triton kernel's (docs/kv_quantization.md)."""
    pipelined = kernel_resources.pipelined_decode("int8", tile=128, stages=2, max_registers=None, sass_mix=True)
    assert pipelined["async_copies"] > 0 and pipelined["spill_stack_bytes"] == 0
    assert pipelined["mma_instructions"] > 0 and pipelined["async_copy_instructions"] > 0
    triton_kernel = kernel_resources.quant_decode("int8", tile=128, num_warps=4, ids_ahead=True, max_registers=128,
                                                  window=False, group=0, sass_mix=True)
    assert 0 < pipelined["longest_loop_instructions"] < triton_kernel["longest_loop_instructions"]
