"""Fair share under one tenant's overload: tenant A sends at --ratio (default 10) times tenant B's
rate, A alone over the server's capacity (--overload, default 1.75x). One seeded Poisson trace per
tenant, the same in three phases of one run, each against a fresh `kvserve serve` with two API keys:
(a) B's arrivals alone, (b) A and B under FCFS, (c) A and B under `--scheduling-policy fair
--no-fair-prefill-first` (B's prompts computed in the batch's steps), (d) A and B under
`--scheduling-policy fair` (weights --weights, equal by default). Reports B's TTFT p50/p99 in each, B's TTFT p99 under fair
and under FCFS over B's alone (the goal of issue 29: fair within 1.5x of B alone), and the service
each tenant got (the server's /v1/usage, read with the admin key) against its weight.

    python benchmarks/serving/fairness_bench.py --duration 60 \\
        --json benchmarks/results/serving/cpu_fairness_10x.json -- --kv-cache-memory 1GiB

Capacity is measured in the first phase (a burst of --capacity-burst requests: completed requests
per second); `--capacity R` skips that. Every phase first sends the same burst, half from each
tenant, so that each phase's trace starts with the same prefix cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.serving.serve_bench import (ClientShare, add_overload_args, machine_info,  # noqa: E402
                                            make_requests, now, percentile, sample_queue, send_plan,
                                            serve_on_free_port, split_serve_args, stop_server)

TENANTS = ("a", "b")
KEYS = {"sk-fairness-a": "a", "sk-fairness-b": "b"}
ADMIN_KEY = "sk-fairness-admin"
GOAL_P99_OVER_ALONE = 1.5

Plan = list[tuple[float, str, int]]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _key_of(tenant: str) -> str:
    return next(key for key, name in KEYS.items() if name == tenant)


async def _send(url: str, model: str, plans: dict[str, Plan], timeout: float) -> tuple[dict[str, ClientShare], dict]:
    """Each tenant's plan with its key, from one common start; the server's running batch and
    queue sampled meanwhile."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=httpx.Limits(max_connections=None)) as client:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_queue(client, url, stop))
        start = now() + 0.05
        try:
            shares = await asyncio.gather(*(send_plan(client, url, model, plan, _auth(_key_of(tenant)), start)
                                            for tenant, plan in plans.items()))
        finally:
            stop.set()
            running, waiting = await sampler
    queue = {"running_mean": round(statistics.fmean(running), 1) if running else None,
             "running_max": max(running, default=None), "waiting_max": max(waiting, default=None)}
    return dict(zip(plans, shares)), queue


def _usage(url: str) -> dict[Optional[str], dict]:
    response = httpx.get(url + "/v1/usage", headers=_auth(ADMIN_KEY), timeout=30)
    response.raise_for_status()
    return {row["tenant"]: row for row in response.json()["data"]}


def _service(before: dict, after: dict, weights: dict[str, float], plans: dict[str, Plan]) -> dict[str, Any]:
    """What the server did for each tenant during the trace (the /v1/usage difference), in VTC's
    cost (uncached prompt tokens + 2 x generated tokens), and each tenant's share of it beside its
    weight's share and its share of the requests sent (a tenant asking for less than its weight's
    share gets all it asks)."""
    out: dict[str, Any] = {}
    for tenant in plans:
        new, old = after.get(tenant, {}), before.get(tenant, {})

        def delta(field: str) -> int:
            return new.get(field, 0) - old.get(field, 0)
        row = {"prompt_tokens": delta("prompt_tokens"), "cached_prompt_tokens": delta("cached_prompt_tokens"),
               "generation_tokens": delta("generation_tokens")}
        row["weighted_tokens"] = row["prompt_tokens"] - row["cached_prompt_tokens"] + 2 * row["generation_tokens"]
        if new.get("fair_share"):
            row["vtc_served"] = round(new["fair_share"]["served_weighted_tokens"]
                                      - (old.get("fair_share") or {}).get("served_weighted_tokens", 0.0), 1)
        out[tenant] = row
    total = sum(row["weighted_tokens"] for row in out.values())
    sent = sum(len(plan) for plan in plans.values())
    for tenant, row in out.items():
        row["share"] = round(row["weighted_tokens"] / total, 4) if total else None
        row["weight_share"] = round(weights[tenant] / sum(weights[t] for t in plans), 4)
        row["requests_share"] = round(len(plans[tenant]) / sent, 4)
    return out


def _latency(share: ClientShare) -> dict[str, Any]:
    done = [r for r in share.results if r.error is None and r.ttft is not None]
    ttfts = [r.ttft for r in done]
    tpots = [r.tpot for r in done if r.tpot is not None]

    def p(values: list[float], q: float) -> Optional[float]:
        value = percentile(values, q)
        return None if value is None else round(value, 4)
    return {"requests": len(share.results), "completed": len(done),
            "errors": sorted({r.error for r in share.results if r.error})[:3],
            "ttft_p50_s": p(ttfts, 50), "ttft_p99_s": p(ttfts, 99), "ttft_max_s": round(max(ttfts), 4) if ttfts else None,
            "tpot_p50_s": p(tpots, 50), "tpot_p99_s": p(tpots, 99),
            "output_tokens": sum(r.output_tokens for r in done)}


def _run_phase(name: str, flags: list[str], tenants: tuple[str, ...], args: argparse.Namespace, workdir: str,
               burst: Plan, trace: Callable[[float], dict[str, Plan]], capacity: Optional[float],
               weights: dict[str, float]) -> tuple[dict[str, Any], float]:
    """One fresh server: the burst, then the trace (at rates from `capacity`, else from the
    burst's rate) of `tenants`. Returns the phase's figures and the capacity used."""
    proc, url, model = serve_on_free_port(flags, os.path.join(workdir, f"{name}.log"), args.startup_timeout,
                                          _auth(_key_of("a")))
    try:
        started = now()
        asyncio.run(_send(url, model, {"a": burst[0::2], "b": burst[1::2]}, args.request_timeout))
        burst_rate = len(burst) / (now() - started)
        if capacity is None:
            capacity = burst_rate
            print(f"capacity: {capacity:.2f} req/s (a burst of {len(burst)} on the {name} server)", flush=True)
        plans = {tenant: plan for tenant, plan in trace(capacity).items() if tenant in tenants}
        before = _usage(url)
        started = now()
        shares, queue = asyncio.run(_send(url, model, plans, args.request_timeout))
        seconds = now() - started
        after = _usage(url)
    finally:
        stop_server(proc)
    result = {"burst_req_per_s": round(burst_rate, 3), "seconds": round(seconds, 1), "server_queue": queue,
              "tenants": {tenant: _latency(share) for tenant, share in shares.items()},
              "service": _service(before, after, weights, plans)}
    b = result["tenants"]["b"]
    print(f"{name}: B TTFT p50 {b['ttft_p50_s']} s, p99 {b['ttft_p99_s']} s over {b['completed']}/{b['requests']} "
          f"requests; {seconds:.0f} s; queue max {queue['waiting_max']}", flush=True)
    return result, capacity


def main(argv: Optional[list[str]] = None) -> int:
    argv, serve_extra = split_serve_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_overload_args(parser, 1.75, "tenant A's rate over the measured capacity")
    parser.add_argument("--ratio", type=float, default=10.0, help="tenant A's rate over tenant B's")
    parser.add_argument("--weights", default="a:1,b:1", help="the fair policy's tenant weights")
    args = parser.parse_args(argv)
    weights = {name: float(weight) for name, weight in (item.split(":") for item in args.weights.split(","))}
    if sorted(weights) != sorted(TENANTS):
        parser.error(f"--weights must name the tenants {', '.join(TENANTS)}, got {args.weights!r}")

    workdir = tempfile.mkdtemp(prefix="kvserve-fairness-bench-")
    keys_path, qos_path = os.path.join(workdir, "keys.json"), os.path.join(workdir, "qos.json")
    with open(keys_path, "w") as f:
        json.dump(KEYS, f)
    with open(qos_path, "w") as f:
        json.dump({"tenants": {name: {"weight": weight} for name, weight in weights.items()}}, f)
    common = ["--api-keys-file", keys_path, "--admin-api-key", ADMIN_KEY]
    phases = {"b_alone": (["--scheduling-policy", "fcfs"], ("b",)),
              "fcfs": (["--scheduling-policy", "fcfs"], TENANTS),
              # Fair share with B's prompts in the batch's steps (before fair_prefill_first), then with
              # B's new prompts in steps of their own (the default).
              "fair_batch_steps": (["--scheduling-policy", "fair", "--qos-config", qos_path,
                                    "--no-fair-prefill-first"], TENANTS),
              "fair": (["--scheduling-policy", "fair", "--qos-config", qos_path], TENANTS)}
    # Prompts of their own seed: the burst warms the same cache in every phase, not the trace's prompts.
    burst = make_requests(1000.0, args.capacity_burst / 1000.0, args.min_tokens, args.max_tokens, args.seed + 2)

    def rates(capacity: float) -> dict[str, float]:
        return {"a": capacity * args.overload, "b": capacity * args.overload / args.ratio}

    def trace(capacity: float) -> dict[str, Plan]:
        """Each tenant's seeded arrivals: the same in every phase, given the same capacity."""
        return {tenant: make_requests(rate, args.duration, args.min_tokens, args.max_tokens, args.seed + index)
                for index, (tenant, rate) in enumerate(rates(capacity).items())}

    load_before = os.getloadavg()
    results: dict[str, Any] = {
        "benchmark": "fairness_bench", "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "serve_args": serve_extra, "weights": weights, "overload": args.overload, "ratio": args.ratio,
        "duration_s": args.duration, "max_tokens_uniform": [args.min_tokens, args.max_tokens], "seed": args.seed,
        "machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "phases": {}}
    capacity = args.capacity
    for name, (flags, tenants) in phases.items():
        results["phases"][name], capacity = _run_phase(name, flags + common + serve_extra, tenants, args, workdir,
                                                       burst, trace, capacity, weights)
    results["capacity_req_per_s"] = round(capacity, 3)
    results["rates_req_per_s"] = {tenant: round(rate, 3) for tenant, rate in rates(capacity).items()}
    results["loadavg_1m_before_after"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    results["goal"] = _goal(results["phases"])
    print(format_table(results))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _goal(phases: dict[str, Any]) -> dict[str, Any]:
    alone = phases["b_alone"]["tenants"]["b"]["ttft_p99_s"]

    def over_alone(phase: str) -> Optional[float]:
        p99 = phases[phase]["tenants"]["b"]["ttft_p99_s"]
        return round(p99 / alone, 3) if p99 is not None and alone else None
    fair = over_alone("fair")
    return {"b_ttft_p99_fair_over_alone": fair, "b_ttft_p99_fcfs_over_alone": over_alone("fcfs"),
            "b_ttft_p99_fair_batch_steps_over_alone": over_alone("fair_batch_steps"),
            "target": GOAL_P99_OVER_ALONE, "met": fair is not None and fair <= GOAL_P99_OVER_ALONE}


def format_table(results: dict[str, Any]) -> str:
    rows = ["| phase | B TTFT p50 | B TTFT p99 | B p99 / alone | A TTFT p99 | A completed | service share A / B |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    alone = results["phases"]["b_alone"]["tenants"]["b"]["ttft_p99_s"]
    for name, phase in results["phases"].items():
        b, a = phase["tenants"]["b"], phase["tenants"].get("a")
        service = phase["service"]
        ratio = f"{b['ttft_p99_s'] / alone:.2f}x" if b["ttft_p99_s"] is not None and alone else "-"
        shares = (f"{service['a']['share']:.1%} / {service['b']['share']:.1%}" if a is not None
                  and service["a"]["share"] is not None else "-")
        rows.append(f"| {name} | {b['ttft_p50_s']} s | {b['ttft_p99_s']} s | {ratio} | "
                    f"{a['ttft_p99_s'] if a else '-'} s | {a['completed'] if a else '-'}/{a['requests'] if a else '-'} "
                    f"| {shares} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
