"""TTFT of a chat prompt behind a 2k-token shared system prompt, by where its prefix KV comes from:
computed cold, a GPU (KV cache) hit, a host-tier hit, a disk-tier hit in a restarted engine, and a
remote (Redis) hit in another engine ("replica"). CPU, the default model (SmolLM2-135M-Instruct).

The prompt is the chat template over a deterministic ~`--system-tokens` system prompt and a short
user turn. Each case runs `--repeats` times; repetition k uses user turn k and cache_salt "rep-k",
so every repetition is a prefix no engine has seen in that namespace (a salt changes only the
prefix-cache namespace, not what is computed). TTFT is the wall time of `LLM.generate` with
max_tokens=1 (greedy): the first token only. Engines, in order (one process, each closed before the
next starts, all with the same small KV cache: one prompt plus a few blocks, `--kv-cache-memory`; each
engine but C0 first runs a short warm-up request of its own):

    A  no tiers                    cold (k: first sight of rep-k), gpu_hit (rep-k again, same engine)
    B  host + disk + Redis         fills disk and Redis (these prefills are reported as
                                   cold_with_tiers: a cold prefill with write-through going on) and
                                   measures host_hit: rep-k after the GPU cache evicted it (the next
                                   repetition's prompt takes the small KV cache, and the few root
                                   blocks it left go with a short random prompt; rotation: fill 0,
                                   fill 1, host 0, fill 2, host 1, ..., host N-1)
    C0 host + disk (a restart)     disk_after_restart: the restarted engine's very first request
                                   (rep-0, no warm-up: what the first user after a restart sees)
    C1 host + disk (a restart)     disk_hit: rep-k after a warm-up request, the disk files evicted
                                   from the page cache before each request (posix_fadvise
                                   DONTNEED; --page-cache keep skips it and C2)
    C2 host + disk (a restart)     disk_hit_page_cache: the same with every block file read into
                                   the page cache before each request (a process restart on a
                                   machine that kept running)
    D  host + Redis only           remote_hit: rep-k, its blocks written by engine B (another replica)

Each hit case records the prompt tokens served by each tier (the engine's stats, deltas per
request: gpu = prefix-cache hits, host = loaded from the host tier that no cold tier brought up,
disk / remote = `cold_hit_tokens`, computed = the rest) and checks that the first token equals the
cold run's; it also records the process's CPU seconds (all threads) next to the wall time: on a
shared machine the CPU kernels' OpenMP team slows down a lot when other processes take cores
(`--threads 1` is steadier there). Direct read throughput of each store (DiskStore.get_many / RedisStore.get_many on the
blocks engine B wrote, one prompt's blocks per call as a prefetch reads them; disk with the files
evicted from the page cache and again with them cached) is measured between B and C0.

    python benchmarks/kv/cold_tier_bench.py --json benchmarks/results/kv/cpu_cold_tier_ttft_2026-12-01.json

redis-server (the Debian package) must be installed; the script starts it on a free loopback port
in a temporary directory and stops it at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from benchmarks.kv.page_cache import block_files, evict_page_cache, load_page_cache, resident_fraction  # noqa: E402
from kvserve.config import _parse_bytes  # noqa: E402
from kvserve.eval.timing import now  # noqa: E402

WORDS = ("cache memory block token prefix request model engine policy tenant latency batch kernel tensor "
         "layer attention query key value eviction disk replica restart storage index segment server "
         "client answer question careful precise helpful customer order invoice refund shipping").split()
TURNS = ["What is the refund policy for an order that arrived damaged?",
         "How do I change the shipping address of an order I placed yesterday?",
         "Can you explain why my invoice shows two separate charges?",
         "Which storage plan fits a team of twelve people?",
         "How long does a replacement usually take to arrive?"]


# --------------------------------------------------------------------------------------------------
# the prompt
# --------------------------------------------------------------------------------------------------

def system_prompt(tokenizer, target_tokens: int, seed: int = 0) -> tuple[str, int]:
    """A deterministic system prompt of about `target_tokens` tokens (its own encoding, no template)."""
    rng = random.Random(seed)
    sentences = []
    while True:
        words = [rng.choice(WORDS) for _ in range(rng.randrange(8, 16))]
        sentences.append(" ".join(words).capitalize() + ".")
        if len(sentences) % 20 == 0 and len(tokenizer.encode(" ".join(sentences), add_special_tokens=False)) > target_tokens:
            break
    body = tokenizer.encode(" ".join(sentences), add_special_tokens=False)
    head = "You are a careful assistant of a storage company. "
    cut = target_tokens - len(tokenizer.encode(head, add_special_tokens=False))
    for _ in range(8):                     # re-encoding at the cut may merge or split a token or two
        text = head + tokenizer.decode(body[:cut])
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target_tokens:
            break
        cut += target_tokens - len(ids)
    return text, len(ids)


# --------------------------------------------------------------------------------------------------
# one measured request
# --------------------------------------------------------------------------------------------------

def _snapshot(llm) -> dict:
    stats = llm.engine.make_stats()
    kv = stats.kv_cache
    cold = dict(kv.cold_hit_tokens)
    return {"gpu": stats.prefix_cache.hit_tokens if stats.prefix_cache is not None else 0,
            "host_loaded": kv.host.hit_tokens if kv.host is not None else 0,
            "disk": cold.get("disk", 0), "remote": cold.get("remote", 0),
            "cold_bytes_read": {s.name: s.bytes_read for s in kv.cold}}


def measure(llm, prompt_ids: list[int], salt: str, params) -> dict:
    before = _snapshot(llm)
    cpu = time.process_time()
    start = now()
    out = llm.generate([{"prompt_token_ids": prompt_ids, "cache_salt": salt}], params, use_tqdm=False)[0]
    ttft = now() - start
    cpu = time.process_time() - cpu
    after = _snapshot(llm)
    delta = {k: after[k] - before[k] for k in ("gpu", "host_loaded", "disk", "remote")}
    hits = {"gpu": delta["gpu"], "host": delta["host_loaded"] - delta["disk"] - delta["remote"],
            "disk": delta["disk"], "remote": delta["remote"]}
    hits["computed"] = len(prompt_ids) - sum(hits.values())
    read = {name: after["cold_bytes_read"][name] - before["cold_bytes_read"].get(name, 0)
            for name in after["cold_bytes_read"]}
    return {"salt": salt, "ttft_s": round(ttft, 4), "process_cpu_s": round(cpu, 4), "first_token": out.outputs[0].token_ids[0],
            "hit_tokens": hits, "cold_bytes_read": read}


def settle(llm) -> None:
    """Hands the host tier's new blocks down and waits for the cold tiers' writes (so the next
    measurement does not share the CPU with them). Engine internals: the bench drives the engine
    from its own thread, as LLM.generate does."""
    cold = llm.engine.cold
    if cold is not None:
        cold.step()
        cold.tiers.flush(timeout_s=60.0)


def gpu_cached_tokens(llm, prompt_ids: list[int], salt: str) -> int:
    return llm.engine.estimate_cached_prompt_tokens(prompt_ids, cache_salt=salt)


# --------------------------------------------------------------------------------------------------
# direct store reads
# --------------------------------------------------------------------------------------------------

def store_throughput(disk_dir: str, redis_url: str, keys_per_read: int, page_cache: str) -> dict:
    from kvserve.kvstore.disk_store import DiskStore
    from kvserve.kvstore.redis_store import QUOTA_PREFIX, RedisStore
    out: dict = {}
    files = block_files(disk_dir)
    disk = DiskStore(disk_dir, 1 << 40)
    disk.scan_done.wait(30)                              # the scan reads every file's header
    keys = [DiskStore._key_of(os.path.basename(p)) for p in files]
    chunks = [keys[i:i + keys_per_read] for i in range(0, len(keys), keys_per_read)]
    runs = [("page_cache_evicted", True), ("page_cache", False)] if page_cache == "evict" else [("page_cache", False)]
    for label, evict in runs:
        if evict:
            evict_page_cache(files)
        resident = resident_fraction(files)
        nbytes = 0
        start = now()
        for chunk in chunks:
            nbytes += sum(len(v) for v in disk.get_many(chunk) if v is not None)
        seconds = now() - start
        out[f"disk_{label}"] = {"blocks": len(keys), "bytes": nbytes, "seconds": round(seconds, 4),
                                "MB_per_s": round(nbytes / seconds / 1e6, 1),
                                "resident_before": None if resident is None else round(resident, 3)}
    disk.close()
    remote = RedisStore(redis_url)
    client = remote._client
    rkeys = sorted(k.decode() for k in client.scan_iter(count=1000) if not k.decode().startswith(QUOTA_PREFIX))
    nbytes = 0
    start = now()
    for i in range(0, len(rkeys), keys_per_read):
        nbytes += sum(len(v) for v in remote.get_many(rkeys[i:i + keys_per_read]) if v is not None)
    seconds = now() - start
    out["remote"] = {"blocks": len(rkeys), "bytes": nbytes, "seconds": round(seconds, 4),
                     "MB_per_s": round(nbytes / seconds / 1e6, 1)}
    remote.close()
    return out


# --------------------------------------------------------------------------------------------------

def _machine() -> dict:
    import redis
    import torch
    try:
        version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        version = None
    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    return {"python": platform.python_version(), "torch": torch.__version__, "redis_py": redis.__version__,
            "redis_server": version, "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "kvserve_commit": commit, "loadavg_at_start": load}


def _summary(records: list[dict], cold_median: Optional[float], cold_tokens: list[int]) -> dict:
    ttfts = [r["ttft_s"] for r in records]
    med = statistics.median(ttfts)
    tiers = {t: [r["hit_tokens"][t] for r in records] for t in ("gpu", "host", "disk", "remote", "computed")}
    same = [r["first_token"] == cold_tokens[i] for i, r in enumerate(records)] if cold_tokens else None
    return {"ttft_median_s": round(med, 4), "ttft_min_s": round(min(ttfts), 4),
            "process_cpu_median_s": round(statistics.median(r["process_cpu_s"] for r in records), 4),
            "cold_over_this": round(cold_median / med, 2) if cold_median else None,
            "hit_tokens_by_tier": tiers, "first_token_equals_cold": same, "runs": records}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV cache of every engine (bytes, e.g. 100MiB); default: one prompt plus 4 blocks, "
                             "so the next repetition's prompt evicts the previous one (the host_hit case)")
    parser.add_argument("--kv-host-memory", default=None, help="default: room for every repetition's prompt, twice")
    parser.add_argument("--kv-disk-size", default="4GiB")
    parser.add_argument("--kv-cold-max-wait", type=float, default=1.0,
                        help="seconds a request waits for its prefix from disk / Redis (the product's default 1.0)")
    parser.add_argument("--page-cache", choices=("evict", "keep"), default="evict",
                        help="disk_hit: evict the block files from the page cache before each request (fadvise)")
    parser.add_argument("--dir", default=None, help="where the disk tier lives (default: a temporary directory)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (the CPU kernels' OpenMP pool); default: torch's (the cores)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    from kvserve import LLM, SamplingParams
    from redis_fixture import RedisServer
    if args.threads:
        torch.set_num_threads(args.threads)

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    base_options = {"device": args.device}
    results: dict = {"command": "python benchmarks/kv/cold_tier_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "machine": _machine(),
                     "model": args.model or "SmolLM2-135M-Instruct (default, GGUF Q4_1 dequantized to fp32)",
                     "device": args.device, "repeats": args.repeats, "kv_cold_max_wait_s": args.kv_cold_max_wait,
                     "page_cache": args.page_cache, "torch_threads": torch.get_num_threads()}
    work = tempfile.mkdtemp(prefix="kvserve-cold-bench-", dir=args.dir)
    disk_dir = os.path.join(work, "kv-disk")
    redis_dir = os.path.join(work, "redis")
    os.makedirs(redis_dir)
    server = RedisServer(redis_dir, maxmemory="4gb", policy="allkeys-lru")
    started = now()
    cases: dict = {}
    try:
        # --- A: no tiers: cold and GPU hit --------------------------------------------------------
        t0 = now()
        llm = LLM(args.model, **base_options)
        load_s = now() - t0
        tokenizer = llm.get_tokenizer()
        system, system_tokens = system_prompt(tokenizer, args.system_tokens)
        prompts = []
        for k in range(args.repeats):
            conv = [{"role": "system", "content": system}, {"role": "user", "content": TURNS[k % len(TURNS)]}]
            prompts.append(llm.apply_chat_template(conv))
        block_size = llm.engine.kv_manager.block_size
        kv_bytes_per_token = llm.engine.kv_bytes_per_token
        block_bytes = block_size * kv_bytes_per_token
        longest = max(len(p) for p in prompts)
        prompt_blocks = -(-(longest + 1) // block_size)
        kv_cache_memory = _parse_bytes(args.kv_cache_memory) if args.kv_cache_memory else (prompt_blocks + 4) * block_bytes
        host_memory = (_parse_bytes(args.kv_host_memory) if args.kv_host_memory
                       else 2 * args.repeats * prompt_blocks * block_bytes)
        llm.close()
        results.update({"system_prompt_tokens": system_tokens, "prompt_tokens": [len(p) for p in prompts],
                        "block_size_tokens": block_size, "kv_bytes_per_token": kv_bytes_per_token,
                        "block_payload_bytes": block_bytes, "kv_cache_memory": kv_cache_memory,
                        "kv_cache_blocks": kv_cache_memory // block_bytes, "kv_host_memory": host_memory,
                        "model_load_s": round(load_s, 2)})
        print(f"system prompt {system_tokens} tokens, prompts {[len(p) for p in prompts]} tokens; block {block_size} "
              f"tokens = {block_bytes} bytes; KV cache {kv_cache_memory // block_bytes} blocks; host tier "
              f"{host_memory / 2**20:.0f} MiB", flush=True)

        common = dict(base_options, kv_cache_memory=kv_cache_memory)
        tiered = dict(common, kv_host_memory=host_memory, kv_cold_max_wait=args.kv_cold_max_wait)
        warm_prompt = tokenizer.encode("Warm-up: " + " ".join(WORDS), add_special_tokens=False)

        def warm_up(llm) -> None:
            llm.generate([{"prompt_token_ids": warm_prompt, "cache_salt": "warm-up"}], one, use_tqdm=False)
            settle(llm)

        def salt(k: int) -> str:
            return f"rep-{k}"

        def log(case: str, record: dict) -> None:
            print(f"  {case:20s} {record['salt']}: ttft {record['ttft_s'] * 1e3:9.1f} ms  first token "
                  f"{record['first_token']}  hit tokens {record['hit_tokens']}", flush=True)

        with LLM(args.model, **common) as llm:
            warm_up(llm)
            cold, gpu = [], []
            for k in range(args.repeats):
                cold.append(measure(llm, prompts[k], salt(k), one))
                log("cold", cold[-1])
                gpu.append(measure(llm, prompts[k], salt(k), one))
                log("gpu_hit", gpu[-1])
        cold_tokens = [r["first_token"] for r in cold]
        cold_median = statistics.median(r["ttft_s"] for r in cold)
        cases["cold"] = _summary(cold, cold_median, cold_tokens)
        cases["gpu_hit"] = _summary(gpu, cold_median, cold_tokens)

        # --- B: host + disk + Redis: fills the cold tiers, host hits ------------------------------
        fill, host = [], [None] * args.repeats
        extra_evictions = 0
        with LLM(args.model, **tiered, kv_disk_path=disk_dir, kv_disk_size=_parse_bytes(args.kv_disk_size),
                 kv_remote_url=server.url) as llm:
            warm_up(llm)

            def host_hit(k: int) -> None:
                # The next repetition's prompt took the small KV cache; what it left of this one
                # (a few blocks from the root, which a lookup would hit) goes with a short prompt.
                nonlocal extra_evictions
                rng = random.Random(k)
                for _ in range(4):
                    cached = gpu_cached_tokens(llm, prompts[k], salt(k))
                    if not cached:
                        break
                    extra_evictions += 1
                    length = cached + len(warm_prompt) + 4 * block_size
                    evictor = [rng.randrange(100, 30000) for _ in range(length)]
                    llm.generate([{"prompt_token_ids": evictor, "cache_salt": f"evictor-{k}"}], one, use_tqdm=False)
                    settle(llm)
                host[k] = measure(llm, prompts[k], salt(k), one)
                log("host_hit", host[k])
                settle(llm)

            for k in range(args.repeats):
                fill.append(measure(llm, prompts[k], salt(k), one))
                log("cold_with_tiers", fill[-1])
                settle(llm)
                if k >= 1:
                    host_hit(k - 1)
            host_hit(args.repeats - 1)
            b_stats = llm.engine.make_stats().kv_cache
        cases["cold_with_tiers"] = _summary(fill, cold_median, cold_tokens)
        cases["host_hit"] = _summary(host, cold_median, cold_tokens)
        results["fill_engine"] = {"extra_evictor_prompts": extra_evictions,
                                  "cold_writes_dropped": b_stats.cold_writes_dropped,
                                  "stores": [dataclasses.asdict(s) for s in b_stats.cold]}
        files = block_files(disk_dir)
        results["disk_files"] = {"count": len(files), "bytes": sum(os.path.getsize(p) for p in files),
                                 "file_bytes": sorted({os.path.getsize(p) for p in files})}

        # --- direct reads of the stores -------------------------------------------------------------
        results["store_read_throughput"] = store_throughput(disk_dir, server.url, prompt_blocks, args.page_cache)
        print("direct reads:", json.dumps(results["store_read_throughput"]), flush=True)

        # --- C1 / C2: restarts on the disk directory -----------------------------------------------
        def disk_engine(case: str, evict: bool, warm: bool, repeats: int) -> tuple[list[dict], dict]:
            records = []
            with LLM(args.model, **tiered, kv_disk_path=disk_dir, kv_disk_size=_parse_bytes(args.kv_disk_size)) as llm:
                llm.engine.cold.tiers.stores[0].scan_done.wait(30)
                if warm:
                    warm_up(llm)
                for k in range(repeats):
                    if evict:
                        evict_page_cache(block_files(disk_dir))
                    else:
                        load_page_cache(block_files(disk_dir))
                    resident = resident_fraction(block_files(disk_dir))
                    record = measure(llm, prompts[k], salt(k), one)
                    record["files_resident_before"] = None if resident is None else round(resident, 3)
                    records.append(record)
                    log(case, record)
                    settle(llm)
                bridge = llm.engine.cold
                info = {"engine_read_bytes_per_s": bridge.read_bytes_per_s, "prefetch_timeouts": bridge.prefetch_timeouts,
                        "prefetch_skipped": bridge.prefetch_skipped, "blocks_installed": bridge.blocks_installed,
                        "stores": [dataclasses.asdict(s) for s in llm.engine.make_stats().kv_cache.cold]}
            return records, info

        evict = args.page_cache == "evict"
        # C0: a restart whose very first request (no warm-up) is repetition 0.
        first, results["restart_engine"] = disk_engine("disk_after_restart", evict, False, 1)
        cases["disk_after_restart"] = _summary(first, cold_median, cold_tokens[:1])
        # C1: a restart, warmed up like every other engine, then each repetition from disk.
        disk_records, results["disk_engine"] = disk_engine("disk_hit", evict, True, args.repeats)
        cases["disk_hit"] = _summary(disk_records, cold_median, cold_tokens)
        if evict:
            warm_records, results["disk_engine_page_cache"] = disk_engine("disk_hit_page_cache", False, True,
                                                                          args.repeats)
            cases["disk_hit_page_cache"] = _summary(warm_records, cold_median, cold_tokens)

        # --- D: another replica on the same Redis ---------------------------------------------------
        remote = []
        with LLM(args.model, **tiered, kv_remote_url=server.url) as llm:
            warm_up(llm)
            for k in range(args.repeats):
                remote.append(measure(llm, prompts[k], salt(k), one))
                log("remote_hit", remote[-1])
                settle(llm)
            bridge = llm.engine.cold
            results["remote_engine"] = {"engine_read_bytes_per_s": bridge.read_bytes_per_s,
                                        "prefetch_timeouts": bridge.prefetch_timeouts,
                                        "prefetch_skipped": bridge.prefetch_skipped,
                                        "blocks_installed": bridge.blocks_installed,
                                        "stores": [dataclasses.asdict(s) for s in llm.engine.make_stats().kv_cache.cold]}
        cases["remote_hit"] = _summary(remote, cold_median, cold_tokens)
        info = server.client().info("memory")
        results["redis_used_memory_bytes"] = info.get("used_memory")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    # --- checks and the table ----------------------------------------------------------------------
    expected_tier = {"gpu_hit": "gpu", "host_hit": "host", "disk_hit": "disk", "disk_after_restart": "disk",
                     "disk_hit_page_cache": "disk", "remote_hit": "remote"}
    checks = {}
    for case, tier in expected_tier.items():
        if case not in cases:
            continue
        runs = cases[case]["runs"]
        checks[case] = {"hit_from_its_tier": all(r["hit_tokens"][tier] > 0 and r["hit_tokens"]["computed"] <= block_size
                                                 for r in runs),
                        "first_token_equals_cold": all(cases[case]["first_token_equals_cold"])}
    checks["cold_computed_everything"] = all(r["hit_tokens"]["computed"] == len(prompts[i])
                                             for i, r in enumerate(cases["cold"]["runs"]))
    results["checks"] = checks
    results["cases"] = cases
    results["total_s"] = round(now() - started, 1)
    with open("/proc/loadavg") as f:
        results["machine"]["loadavg_at_end"] = f.read().split()[:3]

    print()
    print(f"{'case':22s} {'TTFT median':>12s} {'min':>10s} {'cold/this':>10s} {'CPU s':>7s}   "
          "hit tokens per run (gpu/host/disk/remote/computed)")
    for case, summary in cases.items():
        tiers = summary["hit_tokens_by_tier"]
        per_run = ", ".join("/".join(str(tiers[t][i]) for t in ("gpu", "host", "disk", "remote", "computed"))
                            for i in range(len(summary["runs"])))
        ratio = summary["cold_over_this"]
        print(f"{case:22s} {summary['ttft_median_s'] * 1e3:9.1f} ms {summary['ttft_min_s'] * 1e3:7.1f} ms "
              f"{ratio:9.2f}x {summary['process_cpu_median_s']:7.2f}   {per_run}")
    print("store reads:", {k: v["MB_per_s"] for k, v in results["store_read_throughput"].items()}, "MB/s;",
          "block payload", results["block_payload_bytes"], "bytes, file", results["disk_files"]["file_bytes"])
    print("checks:", json.dumps(checks))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        print("->", args.json)
    ok = all(all(v.values()) if isinstance(v, dict) else v for v in checks.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
