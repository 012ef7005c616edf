"""Request classes under overload: one Poisson trace at a multiple of the server's capacity, with a
class mix (default Gold 10%, Silver 30%, Bronze 60% of arrivals), against `kvserve serve` twice in
one run: FCFS, then `--scheduling-policy priority --qos-config` with the classes' targets. Reports,
per policy and class, the share of the class's requests answered within its p99 targets (TTFT and
TPOT), the p99s of those answered, and how many were shed (503).

    python benchmarks/serving/qos_classes_bench.py --duration 60 --json out.json -- --kv-cache-memory 1GiB

Capacity is measured first on the FCFS server (a burst of --capacity-burst requests: completed
requests per second); `--capacity R` skips that. Goals (issue 29): Gold >= 99% within targets,
Silver >= 90%, Bronze absorbs the overload.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from typing import Any, Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.serving.serve_bench import (RequestResult, add_overload_args, finish_result,  # noqa: E402
                                            machine_info, make_requests, record_sse_line, serve_on_free_port,
                                            split_serve_args, stop_server)
from kvserve.eval.timing import now  # noqa: E402

DEFAULT_CLASSES = {"gold": {"priority": 0, "ttft_p99": 1.5, "tpot_p99": 0.25, "on_miss": "shed"},
                   "silver": {"priority": 1, "ttft_p99": 4.0, "tpot_p99": 0.4, "on_miss": "shed"},
                   "bronze": {"priority": 2, "ttft_p99": 120.0}}


def _p99(values: list[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-99 * len(ordered) // 100) - 1))]


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
               qos_class: Optional[str]) -> RequestResult:
    result = RequestResult(send_time=0.0, max_tokens=max_tokens)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "messages": [{"role": "user", "content": prompt}]}
    if qos_class is not None:
        body["qos_class"] = qos_class
    sent = now()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}"
                return result
            async for line in response.aiter_lines():
                if not record_sse_line(result, line, False, sent):
                    return result
        finish_result(result, sent)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _send(url: str, model: str, plan: list[tuple[float, str, int, str]], send_class: bool,
                timeout: float) -> list[RequestResult]:
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        start = now()

        async def scheduled(offset: float, prompt: str, max_tokens: int, name: str) -> RequestResult:
            await asyncio.sleep(max(0.0, offset - (now() - start)))
            return await _one(client, url, model, prompt, max_tokens, name if send_class else None)

        return await asyncio.gather(*(scheduled(*item) for item in plan))


def _shed(result: RequestResult) -> bool:
    """Shed: a 503 at arrival, or an "overloaded" error in the stream (shed in the queue)."""
    return result.error == "HTTP 503" or (result.error or "").startswith("server overloaded")


def _summary(plan: list[tuple[float, str, int, str]], results: list[RequestResult], classes: dict) -> dict:
    out: dict[str, Any] = {}
    for name, cls in classes.items():
        mine = [r for (_, _, _, c), r in zip(plan, results) if c == name]
        served = [r for r in mine if r.error is None]
        within = [r for r in served if r.ttft <= cls["ttft_p99"]
                  and (cls.get("tpot_p99") is None or r.tpot is None or r.tpot <= cls["tpot_p99"])]
        shed = [r for r in mine if _shed(r)]
        others = [r for r in mine if r.error is not None and not _shed(r)]
        out[name] = {"requests": len(mine), "served": len(served), "shed_503": len(shed),
                     "other_errors": len(others), "other_error_kinds": sorted({r.error for r in others}),
                     "within_targets": round(len(within) / len(mine), 4) if mine else None,
                     "ttft_p99_s": _p99([r.ttft for r in served]),
                     "tpot_p99_s": _p99([r.tpot for r in served if r.tpot is not None]),
                     "output_tokens": sum(r.output_tokens for r in served)}
    return out


def main(argv: Optional[list[str]] = None) -> int:
    argv, serve_extra = split_serve_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_overload_args(parser, 2.0, "arrival rate over the measured capacity")
    parser.add_argument("--mix", default="gold:0.1,silver:0.3,bronze:0.6")
    parser.add_argument("--classes", default=None, help="a JSON file of classes (default: the ones in this script)")
    args = parser.parse_args(argv)
    classes = DEFAULT_CLASSES
    if args.classes:
        with open(args.classes) as f:
            classes = json.load(f)
    mix = [(name, float(share)) for name, share in (item.split(":") for item in args.mix.split(","))]
    workdir = tempfile.mkdtemp(prefix="kvserve-qos-bench-")
    qos_path = os.path.join(workdir, "qos.json")
    with open(qos_path, "w") as f:
        json.dump({"classes": classes, "default_class": mix[-1][0]}, f)
    policies = {"fcfs": ["--scheduling-policy", "fcfs"],
                "classes": ["--scheduling-policy", "priority", "--qos-config", qos_path]}
    results: dict[str, Any] = {"command": "python benchmarks/serving/qos_classes_bench.py " + " ".join(
        sys.argv[1:]), "serve_args": serve_extra, "classes": classes, "mix": dict(mix),
        "machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "policies": {}}
    capacity = args.capacity
    for policy, flags in policies.items():
        proc, url, model = serve_on_free_port(flags + serve_extra, os.path.join(workdir, f"{policy}.log"),
                                              args.startup_timeout)
        try:
            warm = make_requests(1.0, 2, args.min_tokens, args.max_tokens, args.seed + 1)
            asyncio.run(_send(url, model, [(0.0, p, m, mix[-1][0]) for _, p, m in warm], False, args.request_timeout))
            if capacity is None:
                burst = make_requests(1000.0, args.capacity_burst / 1000.0, args.min_tokens, args.max_tokens,
                                      args.seed + 2)
                started = now()
                asyncio.run(_send(url, model, [(0.0, p, m, "") for _, p, m in burst], False, args.request_timeout))
                capacity = len(burst) / (now() - started)
                results["capacity_req_per_s"] = round(capacity, 3)
                print(f"capacity: {capacity:.2f} req/s (a burst of {len(burst)} on the fcfs server)")
            rate = capacity * args.overload
            base = make_requests(rate, args.duration, args.min_tokens, args.max_tokens, args.seed)
            draws = random.Random(args.seed)
            names = [name for name, _ in mix]
            plan = [(offset, prompt, max_tokens, draws.choices(names, weights=[s for _, s in mix])[0])
                    for offset, prompt, max_tokens in base]
            started = now()
            out = asyncio.run(_send(url, model, plan, policy == "classes", args.request_timeout))
            summary = _summary(plan, out, classes)
            results["policies"][policy] = {"rate_req_per_s": round(rate, 3), "requests": len(plan),
                                           "seconds": round(now() - started, 1), "classes": summary}
            print(policy, json.dumps(summary))
        finally:
            stop_server(proc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
