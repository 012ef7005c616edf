"""Compile a Triton kernel for an NVIDIA GPU that this machine does not have, and report what the
compiler made of it: registers and spill bytes per thread (ptxas, via cuobjdump), shared memory,
whether loads became cp.async copies (Triton's software pipeline), and the SASS instruction mix.
benchmarks/kernels/kernel_resources.py is its command line; docs/kv_quantization.md's analysis of the
fused-dequant decode kernel was made with it, without spending device time (what it found: see
docs/kv_quantization.md#measurements). Needs triton (its wheel bundles ptxas and
cuobjdump); no GPU, no CUDA driver.

The JIT specializes integer arguments divisible by 16 (and equal to 1) on the values it sees; a
compile here does the same from the example values in the preset. Without that (no alignment facts)
the same kernel compiles to scalar loads, 255 registers and spills; with it, the counts imply the
occupancy the H200 runs measured.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def _tool(name: str) -> str:
    """A CUDA binary from triton's bundle (or PATH)."""
    import triton.backends.nvidia as nvidia
    bundled = Path(nvidia.__file__).parent / "bin" / name
    return str(bundled) if bundled.exists() else name


def compile_for_target(kernel, pointer_types: dict[str, str], constexprs: dict, int_values: dict[str, int],
                       float_args: tuple[str, ...] = (), dynamic_args: tuple[str, ...] = (), num_warps: int = 4,
                       num_stages: int = 2, max_registers: int | None = None, capability: int = 90):
    """triton.compile of `kernel` for sm_<capability>. Arguments not in pointer_types, constexprs or
    float_args are int32; `int_values` gives example values for the JIT's divisibility-by-16 and
    ==1 specialization (16 where missing); `dynamic_args` are the kernel's do_not_specialize ones."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    params = list(inspect.signature(kernel.fn).parameters)
    constexprs = dict(constexprs)
    for name in params:
        plain_int = name not in pointer_types and name not in constexprs and name not in float_args
        if plain_int and name not in dynamic_args and int_values.get(name, 16) == 1:
            constexprs[name] = 1
    signature, attrs = {}, {}
    for index, name in enumerate(params):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in float_args:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name not in dynamic_args and int_values.get(name, 16) % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source_type = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource
        source_type = GluonASTSource
    source = source_type(kernel, signature, attrs=attrs,
                         constexprs={(params.index(k),): v for k, v in constexprs.items() if k in params})
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if max_registers:
        options["maxnreg"] = max_registers
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def resources(compiled, sass_mix: bool = False) -> dict:
    """Registers, spill stack, shared memory and cp.async copies of a compiled kernel (+ SASS mix)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout if sass_mix else ""
    report = {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
              "spill_stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
              "shared_bytes": compiled.metadata.shared,
              "async_copies": compiled.asm["ttgir"].count("async_copy_global_to_local")}
    if sass_mix:
        opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
        report["sass_instructions"] = len(opcodes)
        report["sass_mix"] = dict(collections.Counter(opcodes).most_common(20))
        report["mma_instructions"] = sum(1 for op in opcodes if op in ("HMMA", "HGMMA", "IMMA"))
        report["async_copy_instructions"] = opcodes.count("LDGSTS")
        report["longest_loop_instructions"] = longest_loop(sass)
    return report


def longest_loop(sass: str) -> int:
    """Instructions (per thread, one pass) of the longest loop body: a branch back to an earlier
    address closes a loop that starts there (SASS instructions are 16 bytes apart)."""
    longest = 0
    for address, target in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?0x([0-9a-f]+)", sass):
        if int(target, 16) < int(address, 16):
            longest = max(longest, (int(address, 16) - int(target, 16)) // 16 + 1)
    return longest


def quant_decode(fmt: str, tile: int, num_warps: int, ids_ahead: bool, max_registers: int | None,
                 window: bool, group: int, sass_mix: bool, num_stages: int = 2) -> dict:
    """The fused-dequant decode kernel for Qwen-7B attention (28/4/128), bf16 queries, both parts in
    `fmt` (int8, fp8_e4m3, int4), blocks of 16, as paged_decode_attention_quant launches it."""
    import triton.language as tl

    from kvserve.kernels.triton._common import SPLIT_DECODE_DYNAMIC_ARGS
    from kvserve.kernels.triton.code_conversion import BF16_QUERY_PRESCALE
    from kvserve.kernels.triton.decode_attention_quant import _decode_split_quant_kernel
    from kvserve.kernels.triton.kv_store_quant import FORMAT_CODES
    code = FORMAT_CODES[fmt]
    head_dim, kv_heads, block_size = 128, 4, 16
    width = head_dim // 2 if fmt == "int4" else head_dim
    group = group or (32 if fmt == "int4" else head_dim)
    seg = min(group, width)
    groups = head_dim // group
    constexprs = dict(GROUP=7, GROUP_PAD=16, HEAD_DIM=head_dim, TILE=tile, MIN_SPLIT_TOKENS=128,
                      K_FORMAT=code, V_FORMAT=code, K_NSEG=head_dim // seg, V_NSEG=head_dim // seg, K_SEG=seg,
                      V_SEG=seg, K_GROUP=group, V_GROUP=group, K_SCALED=True, V_SCALED=True, K_STATIC=False,
                      V_STATIC=False, K_RING=window, V_RING=window, SINKS=4 if window else 0,
                      WINDOW=128 if window else 0, K_DOT=tl.float16, V_DOT=tl.float16, EXACT_DOT=tl.bfloat16,
                      K_PRESCALE=BF16_QUERY_PRESCALE, K_ASM=True, V_ASM=True, V_PURE=False, PRECISION="tf32",
                      BLOCK_SIZE=block_size, IDS_AHEAD=ids_ahead)
    payload = "*i8" if fmt == "int8" else "*u8"
    pointers = {"query_ptr": "*bf16", "k_ptr": payload, "v_ptr": payload, "k_scales_ptr": "*fp16",
                "v_scales_ptr": "*fp16", "k_static_ptr": "*fp32", "v_static_ptr": "*fp32", "k_ring_ptr": "*bf16",
                "v_ring_ptr": "*bf16", "seq_rows_ptr": "*i32", "block_tables_ptr": "*i32",
                "context_lens_ptr": "*i32", "out_ptr": "*bf16", "partial_out_ptr": "*fp32",
                "partial_lse_ptr": "*fp32"}
    row = kv_heads * width
    scale_row = kv_heads * groups
    values = dict(query_stride_seq=28 * head_dim, query_stride_head=head_dim, out_stride_seq=28 * head_dim,
                  out_stride_head=head_dim, k_stride_block=block_size * row, k_stride_token=row, k_stride_head=width,
                  v_stride_block=block_size * row, v_stride_token=row, v_stride_head=width,
                  ks_stride_block=block_size * scale_row, ks_stride_token=scale_row, ks_stride_head=groups,
                  vs_stride_block=block_size * scale_row, vs_stride_token=scale_row, vs_stride_head=groups,
                  ring_stride_token=kv_heads * head_dim, ring_stride_head=head_dim)
    compiled = compile_for_target(_decode_split_quant_kernel, pointers, constexprs, values,
                                  float_args=("scale_log2", "key_scale_log2"),
                                  dynamic_args=tuple(SPLIT_DECODE_DYNAMIC_ARGS), num_warps=num_warps,
                                  num_stages=num_stages,
                                  max_registers=max_registers)
    return resources(compiled, sass_mix)


def pipelined_decode(fmt: str, tile: int | None, stages: int, max_registers: int | None, sass_mix: bool,
                     group: int = 0, head_warps: bool | None = None) -> dict:
    """The pipelined decode kernel (Gluon) for Qwen-7B attention (28/4/128), bf16 queries, both parts
    in `fmt` (int8, fp8_e4m3, or int4 with scale groups of `group`, default 32), blocks of 16, as
    paged_decode_attention_quant launches it: `tile` positions per iteration, each warp on its own KV
    head (`head_warps`) or on a quarter of the tile; None: the engine's launch."""
    from kvserve.kernels.triton._common import SPLIT_DECODE_DYNAMIC_ARGS
    from kvserve.kernels.triton.code_conversion import BF16_QUERY_PRESCALE
    from kvserve.kernels.triton.decode_attention_quant_pipelined import (NUM_WARPS, _decode_split_pipelined_kernel,
                                                                         head_warps as engine_head_warps,
                                                                         pipelined_config)
    from kvserve.kernels.triton.kv_store_quant import CHANNEL_FORMAT, FORMAT_CODES
    head_dim, kv_heads, block_size = 128, 4, 16
    channel = fmt == "int4-channel"           # int4 keys per channel and block, int4 values per token
    fmt = "int4" if channel else fmt
    code = FORMAT_CODES[fmt]
    if head_warps is None:
        head_warps = engine_head_warps(kv_heads, fmt == "int4")
    tile = tile or pipelined_config(kv_heads, fmt == "int4").tile
    group = (group or 32) if fmt == "int4" else head_dim
    width, groups = (head_dim // 2 if fmt == "int4" else head_dim), head_dim // group
    constexprs = dict(GROUP=7, HEAD_DIM=head_dim, TILE=tile, STAGES=stages, MIN_SPLIT_TOKENS=128,
                      K_FORMAT=CHANNEL_FORMAT if channel else code, V_FORMAT=code,
                      K_GROUP=head_dim if channel else group, V_GROUP=group, BLOCK_SIZE=block_size,
                      PRESCALE=BF16_QUERY_PRESCALE, SINKS=0, WINDOW=0, WIDE=False, HEAD_WARPS=head_warps, PDL=True)
    payload = "*i8" if fmt == "int8" else "*u8"
    pointers = {"query_ptr": "*bf16", "k_ptr": payload, "v_ptr": payload, "k_scales_ptr": "*fp16",
                "v_scales_ptr": "*fp16", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "out_ptr": "*bf16",
                "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32"}
    row, scale_row = kv_heads * width, kv_heads * groups
    values = dict(query_stride_seq=28 * head_dim, query_stride_head=head_dim, out_stride_seq=28 * head_dim,
                  out_stride_head=head_dim, stride_block=block_size * row, stride_token=row, stride_head=width,
                  scale_stride_block=block_size * scale_row, scale_stride_token=scale_row, scale_stride_head=groups,
                  pair_stride_block=kv_heads * 2 * head_dim, pair_stride_head=2 * head_dim)
    compiled = compile_for_target(_decode_split_pipelined_kernel, pointers, constexprs, values,
                                  float_args=("key_scale_log2",), dynamic_args=tuple(SPLIT_DECODE_DYNAMIC_ARGS),
                                  num_warps=NUM_WARPS, max_registers=max_registers)
    return resources(compiled, sass_mix)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernel_resources", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="kernel", required=True)
    quant = sub.add_parser("quant-decode", help="kernels/triton/decode_attention_quant.py's fast kernel")
    quant.add_argument("--format", default="int8", choices=["int8", "fp8_e4m3", "int4"])
    quant.add_argument("--group", type=int, default=0, help="scale group (default: 32 for int4, per token else)")
    quant.add_argument("--tile", type=int, default=128)
    quant.add_argument("--num-warps", type=int, default=4)
    quant.add_argument("--num-stages", type=int, default=2)
    quant.add_argument("--ids-ahead", action="store_true")
    quant.add_argument("--max-registers", type=int, default=None)
    quant.add_argument("--window", action="store_true", help="a 128-token full-precision window and 4 sinks")
    quant.add_argument("--sass-mix", action="store_true", help="also count SASS instructions by opcode")
    pipelined = sub.add_parser("pipelined-decode",
                               help="kernels/triton/decode_attention_quant_pipelined.py's kernel (Gluon)")
    pipelined.add_argument("--format", default="int8", choices=["int8", "fp8_e4m3", "int4", "int4-channel"],
                           help="int4-channel: int4 keys per channel and block, values per token")
    pipelined.add_argument("--group", type=int, default=0, help="int4 scale group (default 32)")
    pipelined.add_argument("--tile", type=int, default=None, help="positions per iteration (default: the engine's)")
    pipelined.add_argument("--stages", type=int, default=2)
    pipelined.add_argument("--warps", choices=["heads", "positions"], default=None,
                           help="each warp on its own KV head, or on a quarter of each tile (default: the engine's)")
    pipelined.add_argument("--max-registers", type=int, default=None)
    pipelined.add_argument("--sass-mix", action="store_true", help="also count SASS instructions by opcode")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("needs triton", file=sys.stderr)
        return 1
    if args.kernel == "pipelined-decode":
        report = pipelined_decode(args.format, args.tile, args.stages, args.max_registers, args.sass_mix,
                                  args.group, head_warps=None if args.warps is None else args.warps == "heads")
    else:
        report = quant_decode(args.format, args.tile, args.num_warps, args.ids_ahead, args.max_registers,
                              args.window, args.group, args.sass_mix, args.num_stages)
    for key, value in report.items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
