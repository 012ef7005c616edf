"""Weight formats the native CPU kernels read, and the codes llama_forward.c / quant_gemm.c know them by.

0 and 1 are the 16-column panels of llama_forward.c (fp32, bf16); the rest are llama.cpp's GGUF blocks
kept as stored (quant_gemm.c). A GGUF type missing here is dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32_PANELS = 0
BF16_PANELS = 1


@dataclass(frozen=True)
class BlockFormat:
    name: str   # the GGML type name, as gguf.GGMLQuantizationType spells it
    code: int   # the C kernels' format code (block sizes and layouts live in quant_gemm.c)


GGUF_BLOCK_FORMATS: dict[str, BlockFormat] = {
    "Q8_0": BlockFormat("Q8_0", 2),
    "Q4_0": BlockFormat("Q4_0", 3),
    "Q4_1": BlockFormat("Q4_1", 4),
}
