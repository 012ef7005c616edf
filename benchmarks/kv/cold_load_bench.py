"""TTFT of a long token-id prefix from the disk and the remote (Redis) KV tier against computing it,
next to each tier's read bandwidth; for random-weight shapes without a tokenizer (the H200 run of
the Qwen-7B shape), where benchmarks/kv/cold_tier_bench.py (chat prompts) cannot run.

    python benchmarks/kv/cold_load_bench.py --model benchmarks/configs/r1-distill-qwen-7b --load-format dummy \\
        --dtype bfloat16 --prefix-tokens 32768 --kv-cache-memory 8GiB --kv-host-memory 16GiB \\
        [--redis-server /path/to/redis-server] --json OUT.json

Engines, one after another in this process (each closed before the next starts):
  fill     host + disk (+ Redis): computes each prefix once (`cold`: its TTFT), writing it down;
  disk     host + disk, a restart: each prefix again (`disk`: TTFT, the prefix from the files);
  remote   host + Redis, another replica: each prefix again (`remote`: TTFT, from Redis).
Every prefix is new to the engine that measures it (its own random tokens per repetition), and each
hit case records the tokens each tier supplied (none where the engine judged the read slower than
recomputing, from its measured read and prefill rates). The fill engine waits for its writes after each
prefix (a server writes them down between requests). The bandwidth is the tiers' own read of one
prefix's blocks (chunks on several threads, verified), the disk's files evicted from the page cache first,
next to the storage's own rate for the same bytes (benchmarks/kv/raw_reads.py: the block files and one
large file read plainly, out of the page cache; the same volume of values read from Redis with MGETs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from benchmarks.kv import raw_reads  # noqa: E402
from benchmarks.kv.page_cache import block_files, evict_page_cache  # noqa: E402
from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.config import _parse_bytes  # noqa: E402


def _ttft(llm: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - started


def _hit_tokens(llm: LLM) -> dict:
    stats = llm.engine.make_stats().kv_cache
    return {"host": stats.host.hit_tokens if stats.host else 0, **stats.cold_hit_tokens}


def _read_bandwidth(llm: LLM, identities: list) -> dict:
    started = time.perf_counter()
    payloads, _ = llm.engine.cold.tiers.read(identities)
    seconds = time.perf_counter() - started
    nbytes = sum(len(p) for p in payloads)
    return {"blocks": len(payloads), "bytes": nbytes, "seconds": round(seconds, 4),
            "GB_per_s": round(nbytes / seconds / 1e9, 3) if seconds > 0 else None}


def _prefix_identities(llm: LLM, prompt: list[int]) -> list:
    return llm.engine.cold.identities(llm.engine.prefix.namespace(None, None), prompt)


def _ttft_written_down(llm: LLM, prompt: list[int]) -> float:
    seconds = _ttft(llm, prompt)
    llm.engine.flush_tiers()
    llm.engine.cold.tiers.flush(timeout_s=300.0)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prefix-tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kv-cache-memory", default="8GiB")
    parser.add_argument("--kv-host-memory", default="16GiB")
    parser.add_argument("--kv-disk-size", default="64GiB")
    parser.add_argument("--dir", default=None, help="the disk tier's directory (default: a temporary one)")
    parser.add_argument("--redis-server", default=shutil.which("redis-server"),
                        help="a redis-server binary for the remote tier (default: the one on PATH; none: skipped)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    work = tempfile.mkdtemp(prefix="kvserve-cold-load-")
    disk = args.dir or os.path.join(work, "disk")
    redis = None
    if args.redis_server:
        import redis_fixture
        redis_fixture.REDIS_SERVER = os.path.abspath(args.redis_server)
        os.makedirs(os.path.join(work, "redis"))
        redis = redis_fixture.RedisServer(os.path.join(work, "redis"))        # started, on a free port
    common = dict(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                  kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory=_parse_bytes(args.kv_cache_memory), kv_host_memory=_parse_bytes(args.kv_host_memory),
                  kv_cold_max_wait=30.0)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(args.prefix_tokens)] for _ in range(args.repeats)]
    results: dict = {"command": "python " + " ".join(sys.argv), "prefix_tokens": args.prefix_tokens,
                     "kv_cache_dtype": args.kv_cache_dtype, "repeats": args.repeats, "cases": {}}
    try:
        fill_options = dict(common, kv_disk_path=disk, kv_disk_size=_parse_bytes(args.kv_disk_size))
        if redis is not None:
            fill_options["kv_remote_url"] = redis.url
        with LLM(**fill_options) as llm:
            _ttft(llm, [rng.randrange(10, 1000) for _ in range(512)])        # warm-up (compilation)
            results["cases"]["cold"] = [_ttft_written_down(llm, p) for p in prompts]
            identities = _prefix_identities(llm, prompts[0])
            results["kv_bytes_per_token"] = llm.engine.kv_bytes_per_token
            results["fill_writes_dropped"] = llm.engine.cold.tiers.writes_dropped
        cases = [("disk", dict(common, kv_disk_path=disk, kv_disk_size=_parse_bytes(args.kv_disk_size)))]
        if redis is not None:
            cases.append(("remote", dict(common, kv_remote_url=redis.url)))
        for name, options in cases:
            with LLM(**options) as llm:
                # Warm-up: compilation, then one full prefill chunk, so the engine has measured
                # the prefill rate a serving engine knows (it decides whether a tier read is worth
                # starting: a read slower than recomputing is not).
                _ttft(llm, [rng.randrange(10, 1000) for _ in range(512)])
                _ttft(llm, [rng.randrange(10, 1000) for _ in range(8192)])
                if name == "disk":
                    evict_page_cache(block_files(disk))
                results[f"{name}_read"] = _read_bandwidth(llm, identities)
                # The storage's own rate for the same bytes, with no format or checks (raw_reads.py).
                prefix_bytes = results[f"{name}_read"]["bytes"]
                if name == "disk":
                    results["disk_raw"] = {"files": raw_reads.read_files(block_files(disk)),
                                           "sequential": raw_reads.read_sequential(disk, prefix_bytes)}
                else:
                    results["remote_raw"] = raw_reads.read_redis(redis.url, prefix_bytes // max(1, len(identities)),
                                                                 prefix_bytes)
                times, hits = [], []
                for prompt in prompts:
                    if name == "disk":
                        evict_page_cache(block_files(disk))
                    before = _hit_tokens(llm)
                    times.append(_ttft(llm, prompt))
                    after = _hit_tokens(llm)
                    hits.append({tier: after[tier] - before.get(tier, 0) for tier in after})
                results["cases"][name] = times
                results[f"{name}_hit_tokens"] = hits
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    cold = statistics.median(results["cases"]["cold"])
    print(f"{'case':<8} {'TTFT median':>12} {'min':>9} {'cold / this':>12}")
    for name, times in results["cases"].items():
        median = statistics.median(times)
        print(f"{name:<8} {median * 1e3:10.1f} ms {min(times) * 1e3:7.1f} ms {cold / median:11.2f}x")
    for name in ("disk", "remote"):
        if f"{name}_read" in results:
            print(f"{name} read: {results[f'{name}_read']}")
            print(f"{name} raw: {results.get(f'{name}_raw')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
