"""Offline throughput benchmark (`kvserve bench`), with transformers `generate` as the baseline.

Prompts are random token ids (a fixed seed), outputs are forced to full length (ignore_eos), so
every system does the same work. Figures are wall-clock medians over `repeats` runs.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from kvserve.eval.prompts import random_prompts
from kvserve.eval.timing import Stopwatch, median
from kvserve.model.quantized_linear import kept_linears
from kvserve.sampling_params import SamplingParams


@dataclass
class BenchPoint:
    system: str
    batch_size: int
    input_len: int
    output_len: int
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def step_until_prompts_computed(engine) -> None:
    """Engine steps until no request is waiting and every running one has its whole prompt computed
    (its first token sampled): what follows is decode steps only."""
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()


def _cpu_fma_gflops() -> Optional[list[float]]:
    from kvserve.kernels import cpu as cpu_kernels
    return cpu_kernels.fma_gflops_by_thread(0.25)


def bench_kvserve(engine, batch_size: int, input_len: int, output_len: int, repeats: int, seed: int) -> BenchPoint:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, output_kind="final_only")
    times, peak_usage, steps, calibration = [], 0.0, 0, []
    engine.reset_expert_load()     # MoE models: tokens per expert over this point's runs
    for repeat in range(repeats):
        # Fresh prompts for every point and repeat: a prefix-cache hit on an earlier run's prompt would
        # skip prefill work the baseline does.
        prompts = random_prompts(batch_size, input_len, engine.model.config.vocab_size,
                                 seed + 1_000_003 * (repeat + 1) + batch_size)
        if engine.device.type == "cpu":
            calibration.append(_cpu_fma_gflops())
        ids = [engine.add_request(None, {"prompt_token_ids": p}, params) for p in prompts]
        last = repeat == repeats - 1
        with Stopwatch(engine.device) as watch:
            pending = set(ids)
            steps = 0
            decode_mark = None
            while pending:
                for out in engine.step():
                    if out.finished:
                        pending.discard(out.request_id)
                steps += 1
                peak_usage = max(peak_usage, engine.kv_manager.usage)
                if last and decode_mark is None and _prompts_computed(engine):
                    decode_mark = _DecodeMark.take(engine, steps)
        times.append(watch.seconds)
    seconds = median(times)
    extra = {"peak_kv_usage": round(peak_usage, 4), "steps": steps,
             "kv_capacity_tokens": engine.kv_manager.capacity_tokens,
             "kv_bytes_per_token": engine.kv_bytes_per_token,
             "preemptions": engine.scheduler.num_preemptions_total,
             "runs_s": [round(t, 4) for t in times]}
    if any(c is not None for c in calibration):
        # Each run's compute next to its time: this VM's cores drift by a third within minutes, and
        # not always alike, so each thread's rate too.
        extra["cpu_fma_gflops_before_runs"] = [round(sum(c), 1) if c else None for c in calibration]
        extra["cpu_fma_gflops_by_thread_before_runs"] = calibration
    if decode_mark is not None:
        extra["bandwidth"] = decode_mark.report(engine, steps, batch_size, input_len, output_len, watch)
        print(f"  bandwidth (batch {batch_size}, decode steps): engine {extra['bandwidth']['engine_utilization']:.3f}"
              f" of {extra['bandwidth']['peak_bytes_per_s'] / 1e9:.0f} GB/s, the workload's roofline "
              f"{extra['bandwidth']['roofline_utilization']:.3f}", flush=True)
    kv_stats = engine.make_stats().kv_cache
    if kv_stats.host is not None:      # the host KV tier (--kv-host-memory): its totals since the engine started
        extra["kv_host"] = asdict(kv_stats.host)
        extra["kv_transfers"] = asdict(kv_stats.transfers)
    if kv_stats.cold:                  # the disk / remote KV tiers: hits by tier, and each store's totals
        extra["kv_tier_hit_tokens"] = dict(kv_stats.cold_hit_tokens)
        extra["kv_tiers"] = [asdict(store) for store in kv_stats.cold]
        print(f"  KV tiers (batch {batch_size}): hit tokens " + ", ".join(
            f"{store.name} {kv_stats.cold_hit_tokens.get(store.name, 0)}" for store in kv_stats.cold), flush=True)
    expert_load = engine.expert_load()
    if expert_load is not None:
        extra["expert_load"] = expert_load.as_dict()
        imbalance = expert_load.imbalance()
        print(f"  expert load (batch {batch_size}): imbalance max/mean per layer: min {min(imbalance):.2f}, "
              f"median {statistics.median(imbalance):.2f}, max {max(imbalance):.2f} over {len(imbalance)} MoE layers",
              flush=True)
    return BenchPoint("kvserve", batch_size, input_len, output_len, seconds,
                      batch_size * output_len / seconds, batch_size * (input_len + output_len) / seconds, extra)


def _prompts_computed(engine) -> bool:
    scheduler = engine.scheduler
    return not scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)


def analytic_weight_bytes(hf_config, dtype: torch.dtype) -> Optional[int]:
    """The bytes a Llama / Qwen2-shaped forward reads of its weights, from the config alone (the
    roofline's count, independent of the engine's own): attention and MLP projections, norms,
    Qwen2's q/k/v biases and the LM head; the input embedding reads only its tokens' rows. None
    for other shapes (MoE, MLA)."""
    if getattr(hf_config, "model_type", "") not in ("llama", "qwen2"):
        return None
    hidden, inter, layers = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    q = hf_config.num_attention_heads * head_dim
    kv = hf_config.num_key_value_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    if hf_config.model_type == "qwen2":
        per_layer += q + 2 * kv
    elements = layers * per_layer + hidden + hf_config.vocab_size * hidden
    return elements * torch.tensor([], dtype=dtype).element_size()


@dataclass
class _DecodeMark:
    """Where a bench run's decode phase begins (every prompt computed): the clock and the
    engine's bandwidth totals, so its decode steps can be set against the workload's roofline."""
    started: float
    steps: int
    bytes_read: int
    seconds: float

    @classmethod
    def take(cls, engine, steps: int) -> "_DecodeMark":
        from kvserve.eval.timing import now, synchronize
        synchronize(engine.device)
        meter = engine.bandwidth
        return cls(now(), steps, meter.bytes_read_total, meter.seconds_total)

    def report(self, engine, steps: int, batch_size: int, input_len: int, output_len: int, watch) -> dict:
        """The decode steps' bytes over their time against the measured peak, as the engine counted
        them (its per-step accounting) and as the workload's arithmetic gives them: batch_size
        requests in lockstep, decode step j reading the weights and input_len + j tokens' KV each."""
        meter = engine.bandwidth
        seconds = watch.started + watch.seconds - self.started
        engine_bytes, engine_seconds = meter.bytes_read_total - self.bytes_read, meter.seconds_total - self.seconds
        decode_steps = output_len - 1
        # Weights kept in GGUF blocks: their real bytes (the engine's count), not the dtype's.
        weights = (meter.weights.bytes_for_tokens(1) if kept_linears(engine.model)
                   else analytic_weight_bytes(engine.source.hf_config, engine.dtype))
        report = {"peak_bytes_per_s": meter.peak_bytes_per_s, "peak_source": meter.peak_source,
                  "decode_steps": steps - self.steps, "decode_seconds": round(seconds, 6),
                  "engine_bytes": engine_bytes, "engine_step_seconds": round(engine_seconds, 6),
                  "engine_utilization": round(engine_bytes / max(engine_seconds, 1e-9) / meter.peak_bytes_per_s, 4),
                  "weight_bytes_per_step_engine": meter.weights.bytes_for_tokens(batch_size),
                  "weight_bytes_per_step_roofline": weights}
        if weights is not None and decode_steps > 0:
            kv_tokens = batch_size * sum(input_len + j for j in range(1, output_len))
            roofline_bytes = decode_steps * weights + engine.kv_bytes_per_token * kv_tokens
            report.update(roofline_bytes=roofline_bytes, roofline_utilization=round(
                roofline_bytes / max(seconds, 1e-9) / meter.peak_bytes_per_s, 4))
        else:
            report.update(roofline_bytes=None, roofline_utilization=float("nan"))
        return report


def load_transformers_model(source, dtype: torch.dtype, device: torch.device, load_format: str):
    import transformers
    if load_format == "dummy":
        # Built on the device: initialising billions of random weights on the host takes minutes.
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(source.hf_config, dtype=dtype)
    elif source.path.endswith(".gguf"):
        folder, name = os.path.split(source.path)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    return model.to(device).eval()


def bench_transformers(model, device: torch.device, batch_size: int, input_len: int, output_len: int,
                       repeats: int, seed: int) -> BenchPoint:
    prompts = torch.tensor(random_prompts(batch_size, input_len, model.config.vocab_size, seed), device=device)
    mask = torch.ones_like(prompts)
    times = []
    for _ in range(repeats):
        with Stopwatch(device) as watch, torch.inference_mode():
            out = model.generate(prompts, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=0)
        times.append(watch.seconds)
        assert out.shape[1] == input_len + output_len
    seconds = median(times)
    return BenchPoint("transformers", batch_size, input_len, output_len, seconds,
                      batch_size * output_len / seconds, batch_size * (input_len + output_len) / seconds,
                      {"runs_s": [round(t, 4) for t in times]})


def environment_info(device: torch.device) -> dict[str, Any]:
    import transformers
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        from kvserve.kernels import cpu as cpu_kernels
        # The instructions the GGUF-block dot products run on here (kernels/cpu/quant_gemm.c).
        info["cpu_quant_isa"] = cpu_kernels.quant_isa()
    return info


def format_table(points: list[BenchPoint]) -> str:
    header = f"{'system':<14}{'batch':>6}{'in':>6}{'out':>6}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>13}"
    lines = [header, "-" * len(header)]
    for p in points:
        lines.append(f"{p.system:<14}{p.batch_size:>6}{p.input_len:>6}{p.output_len:>6}{p.seconds:>10.2f}"
                     f"{p.output_tokens_per_s:>12.1f}{p.total_tokens_per_s:>13.1f}")
    return "\n".join(lines)


def run_bench(engine, batch_sizes: list[int], input_len: int, output_len: int, repeats: int,
              baseline: Optional[str], seed: int, json_path: Optional[str], command: str) -> list[BenchPoint]:
    points: list[BenchPoint] = []
    # Warm-up: first-call costs (allocator, kernels' lazy init) stay out of the figures.
    bench_kvserve(engine, 1, min(input_len, 16), 4, 1, seed)
    for batch_size in batch_sizes:
        points.append(bench_kvserve(engine, batch_size, input_len, output_len, repeats, seed))
        print(format_table(points[-1:]).splitlines()[-1], flush=True)
    if baseline == "transformers":
        model_cfg = engine.config.model_config
        hf_model = load_transformers_model(engine.source, engine.dtype, engine.device, model_cfg.load_format)
        bench_transformers(hf_model, engine.device, 1, min(input_len, 16), 4, 1, seed)
        for batch_size in batch_sizes:
            points.append(bench_transformers(hf_model, engine.device, batch_size, input_len, output_len, repeats, seed))
            print(format_table(points[-1:]).splitlines()[-1], flush=True)
        del hf_model
    if json_path:
        record = {"command": command, "model": engine.source.path, "architecture": engine.source.architecture,
                  "load_format": engine.config.model_config.load_format, "dtype": str(engine.dtype),
                  "device": str(engine.device), "engine_options": engine.config.to_options(),
                  "environment": environment_info(engine.device), "points": [asdict(p) for p in points]}
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as fh:
            json.dump(record, fh, indent=2)
    return points
