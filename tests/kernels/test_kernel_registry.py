"""The kernel registry (kvserve/kernels/registry.py): every Triton kernel case against its torch reference
at the registered tolerance (CUDA), every case's inputs and reference on the CPU, and the registry's
coverage of the kernels kvserve.kernels.triton exports and of its kernel modules."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from kvserve.kernels import registry
from kvserve.kernels.registry import CASES, KernelCase, as_tuple

TRITON_DIR = pathlib.Path(registry.__file__).resolve().parent / "triton"


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def case_params(cases=CASES):
    return [pytest.param(c, dtype, id=f"{c.name}-{dtype_id(dtype)}") for c in cases for dtype in c.dtypes]


def assert_outputs_close(got, want, atol: float, rtol: float, what: str) -> None:
    got, want = as_tuple(got), as_tuple(want)
    assert len(got) == len(want), f"{what}: {len(got)} outputs, the reference gives {len(want)}"
    for index, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"{what}, output {index}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        # NaN where the reference has a number fails: kernel outputs are NaN-poisoned before launch.
        torch.testing.assert_close(g.float(), w.float(), atol=atol, rtol=rtol,
                                   msg=lambda m, i=index: f"{what}, output {i}: {m}")


# ---------------------------------------------------------------------------------------------------
# CUDA: kernel vs reference

@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
@pytest.mark.parametrize("case,dtype", case_params())
def test_kernel_matches_reference(case: KernelCase, dtype: torch.dtype):
    pytest.importorskip("triton")
    device = torch.device("cuda")
    inputs = case.make_inputs(device, dtype, 0)
    got = case.run_kernel(inputs)
    want = case.run_reference(inputs)
    atol, rtol = case.tolerance[dtype]
    assert_outputs_close(got, want, atol, rtol, case.name)


# ---------------------------------------------------------------------------------------------------
# CPU: the registry's wiring

@pytest.mark.parametrize("case,dtype", case_params())
def test_reference_runs_on_cpu_inputs(case: KernelCase, dtype: torch.dtype):
    """Every case's inputs are built and its reference runs on the CPU: outputs finite, the same for
    the same seed (make_inputs is deterministic), and the inputs left as they were."""
    device = torch.device("cpu")
    inputs = case.make_inputs(device, dtype, 0)
    snapshot = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    outputs = as_tuple(case.run_reference(inputs))
    assert outputs and all(isinstance(o, torch.Tensor) for o in outputs)
    for output in outputs:
        assert output.device.type == "cpu"
        assert torch.isfinite(output.float()).all(), f"{case.name}: the reference gives non-finite values"
    for name, before in snapshot.items():
        assert torch.equal(inputs[name], before), f"{case.name}: the reference changed input {name!r}"
    again = as_tuple(case.run_reference(case.make_inputs(device, dtype, 0)))
    assert_outputs_close(again, outputs, 0.0, 0.0, f"{case.name} (same seed)")


def test_case_names_are_unique_and_tolerances_sane():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
    for c in CASES:
        assert c.name.startswith(f"{c.entry}["), c.name
        assert c.dtypes, c.name
        for dtype, (atol, rtol) in c.tolerance.items():
            assert dtype in (torch.bfloat16, torch.float16, torch.float32)
            assert 0 <= atol < 0.1 and 0 <= rtol < 0.1, c.name
    with pytest.raises(KeyError):
        registry.case("no-such-kernel")
    assert registry.case(CASES[0].name) is CASES[0]


def test_every_exported_kernel_has_a_case():
    """Each name kvserve.kernels.triton exports is a registered entry point, or a launch helper /
    configuration type listed as such, and the entry points resolve to the module the package says."""
    from kvserve.kernels import triton as package
    exports = dict(package._EXPORTS)
    assert set(registry.HELPER_EXPORTS) <= set(exports), "HELPER_EXPORTS lists names no longer exported"
    entries = {(c.module, c.entry) for c in CASES}
    for name, module in exports.items():
        if name in registry.HELPER_EXPORTS:
            assert registry.HELPER_EXPORTS[name] in {c.entry for c in CASES}
            continue
        assert (module, name) in entries, f"kvserve.kernels.triton.{name} ({module}.py) has no registry case"


def test_every_kernel_module_is_covered():
    """Every module of kvserve/kernels/triton/ with kernels in it is run by some case."""
    modules = {p.stem for p in TRITON_DIR.glob("*.py")} - {"__init__", *registry.NON_KERNEL_MODULES}
    covered = {m for c in CASES for m in c.modules}
    assert covered <= modules | set(registry.NON_KERNEL_MODULES), covered - modules
    assert modules <= covered, f"kernel modules without a registry case: {sorted(modules - covered)}"


def test_entry_points_exist_in_their_modules():
    """Read with ast (no triton here): each case's entry is a top-level function of its module."""
    import ast
    for c in CASES:
        tree = ast.parse((TRITON_DIR / f"{c.module}.py").read_text(encoding="utf-8"))
        functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert c.entry in functions, f"{c.name}: {c.module}.py has no function {c.entry}"


def test_rotary_reference_is_the_model_layers_rotary():
    from kvserve.model.layers import apply_rotary
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=generator)
    cos, sin = torch.randn(5, 16, generator=generator), torch.randn(5, 16, generator=generator)
    assert torch.equal(registry.rotary_reference(x, cos, sin), apply_rotary(x, cos, sin))


def test_registry_imports_and_runs_references_without_triton():
    """A fresh interpreter where `import triton` fails: the registry imports, and its references run."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kvserve.kernels import registry\n"
        "c = registry.case('paged_decode_attention[gqa3-d64-one-split]')\n"
        "out = c.run_reference(c.make_inputs(torch.device('cpu'), torch.float32, 0))\n"
        "assert 'triton' not in {m.split('.')[0] for m in sys.modules if sys.modules[m] is not None}\n"
        "try:\n"
        "    c.kernel()\n"
        "except ImportError:\n"
        "    print('lazy')\n")
    # The checkout goes first; what PYTHONPATH already holds (a machine's own site folder) stays.
    checkout = str(pathlib.Path(registry.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "lazy"
