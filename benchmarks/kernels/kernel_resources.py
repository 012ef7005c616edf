"""Compile a Triton kernel for an NVIDIA GPU that this machine does not have, and report what the
compiler made of it: registers and spill bytes per thread (ptxas, via cuobjdump), shared memory,
whether loads became cp.async copies (Triton's software pipeline), and the SASS instruction mix.
The code is kvserve.eval.kernel_resources; this is its command line.

Needs triton (its wheel bundles ptxas and cuobjdump); no GPU, no CUDA driver. What it showed for
the quantized decode kernels: docs/kv_quantization.md.

    python benchmarks/kernels/kernel_resources.py quant-decode --format int8 --tile 128 --ids-ahead --max-registers 128
    python benchmarks/kernels/kernel_resources.py quant-decode --format int4 --tile 64 --sass-mix
    python benchmarks/kernels/kernel_resources.py pipelined-decode --format int8 --tile 128 --stages 2 --sass-mix
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvserve.eval.kernel_resources import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
