"""Open-loop serving benchmark: Poisson arrivals at several request rates against `kvserve serve`.

For each rate, requests are sent at exponentially distributed gaps (seeded) whether or not earlier
ones have finished (open loop, as real traffic), each a streamed chat completion with max_tokens
drawn uniformly from [--min-tokens, --max-tokens]. Per request it records time to first token
(TTFT), time per output token after the first (TPOT) and end-to-end latency; per rate it reports
output-token throughput, TTFT/TPOT p50/p99, and goodput: requests meeting the SLO (TTFT <= --slo-ttft
and TPOT <= --slo-tpot) per second of the whole run (first send to last completion).

The client must not be the bottleneck: per rate it reports its own CPU time (user+system seconds of each
client process over the run, and that over the run's wall time: 1.0 is one core busy) and how late the
requests left against their planned send times. A client process near one core delays sends and reads
and inflates TTFT; `--client-processes N` deals each rate's arrivals (the same seeded ones) round-robin
to N processes that send at the same absolute times.

Usage (starts its own server with the given engine flags, then stops it):
    python benchmarks/serving/serve_bench.py --rates 1,2,4 --duration 30 \\
        --json benchmarks/results/serving/cpu_poisson.json -- --kv-cache-memory 1GiB
or against a running server:
    python benchmarks/serving/serve_bench.py --url http://127.0.0.1:8000 --rates 2,4
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import queue
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import httpx

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)


def _load_timing() -> Any:
    """kvserve/eval/timing.py loaded by its path: importing the kvserve package pulls in torch, which
    every spawned client process (--client-processes) would then import for nothing (seconds each)."""
    spec = importlib.util.spec_from_file_location("_kvserve_eval_timing",
                                                  os.path.join(ROOT, "kvserve", "eval", "timing.py"))
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


_timing = _load_timing()
now, percentile = _timing.now, _timing.percentile

# A client process busier than this fraction of one core is likely what limits the run.
CLIENT_CPU_WARN = 0.8

# Short instructions in the style of chat benchmarks; the model answers at its own length, capped by
# max_tokens (so outputs end at EOS or at the cap, as with real traffic).
TOPICS = [
    "the water cycle", "how a bicycle works", "the history of the printing press", "why the sky is blue",
    "photosynthesis", "the rules of chess", "how vaccines work", "the causes of the seasons",
    "how a computer stores numbers", "the life of honey bees", "volcanoes", "how airplanes fly",
    "the French revolution", "black holes", "how to make bread", "the immune system", "ocean tides",
    "the invention of the telephone", "plate tectonics", "how rainbows form", "the Roman empire",
    "electric cars", "the human heart", "the moon landing", "recycling", "the internet",
]
TASKS = [
    "Explain {} to a ten-year-old.", "Write a short paragraph about {}.", "Give three facts about {}.",
    "Summarize what you know about {} in a few sentences.", "Describe {} step by step.",
    "What are the most important things to know about {}?",
]


@dataclass
class RequestResult:
    send_time: float
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0
    error: Optional[str] = None
    error_time: Optional[float] = None   # seconds from send to the error (a 503 or an in-stream error event)

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class RatePoint:
    request_rate: float
    num_requests: int
    num_completed: int
    num_errors: int
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    ttft_p50_s: Optional[float]
    ttft_p99_s: Optional[float]
    tpot_p50_s: Optional[float]
    tpot_p99_s: Optional[float]
    e2e_p50_s: Optional[float]
    e2e_p99_s: Optional[float]
    goodput_req_per_s: float
    goodput_fraction: float
    server_preemptions: Optional[float] = None
    num_rejected_overloaded: int = 0     # HTTP 503 / in-stream "overloaded" (server --slo-shed)
    errors: list[str] = field(default_factory=list)
    # The client's own cost, to show it is not the bottleneck: user+system CPU seconds of the client
    # process(es) from the first planned send to their last completion, summed; the largest share of one
    # core any of them used (cpu s / its wall s); and how late requests left against their plan.
    client_processes: int = 1
    client_cpu_s: Optional[float] = None
    client_cpu_util: Optional[float] = None
    client_cpu_s_per_process: list[float] = field(default_factory=list)
    client_cpu_util_per_process: list[float] = field(default_factory=list)
    send_lag_p99_s: Optional[float] = None
    send_lag_max_s: Optional[float] = None
    # Unix time of the first planned send, to line this rate up with samples taken beside the run
    # (GPU utilisation, a profile of the server's processes).
    started_unix: Optional[float] = None
    seed: Optional[int] = None
    # The server's running batch and queue while the rate ran (its /metrics, read every 0.5 s): the
    # batch size to compare with the offline engine's, and whether a queue built up.
    running_mean: Optional[float] = None
    running_max: Optional[float] = None
    waiting_max: Optional[float] = None


@dataclass
class ClientShare:
    """What one client process sent and what it cost: its results in the order of its share of the plan,
    its CPU seconds and its wall seconds, both from the common start to its last completion."""
    results: list[RequestResult]
    cpu_s: float
    wall_s: float

    def to_plain(self) -> dict[str, Any]:
        # Crosses the process boundary as dicts and floats: a dataclass pickles by its module's name,
        # which differs with how the module was loaded (__main__, __mp_main__ in a spawned child, or
        # serve_bench when a test imports it); plain data unpickles whatever the parent calls it.
        return {"results": [asdict(r) for r in self.results], "cpu_s": self.cpu_s, "wall_s": self.wall_s}

    @classmethod
    def from_plain(cls, plain: dict[str, Any]) -> "ClientShare":
        return cls([RequestResult(**r) for r in plain["results"]], plain["cpu_s"], plain["wall_s"])


def make_requests(rate: float, duration: float, min_tokens: int, max_tokens: int,
                  seed: int, prompt_tokens: int = 0) -> list[tuple[float, str | list[int], int]]:
    """(send offset in s, prompt, max_tokens) for a Poisson process of `rate` over `duration`.
    With prompt_tokens > 0 the prompts are random token ids of that length (models without a tokenizer,
    e.g. random-weight speed shapes on the GPU)."""
    rng = random.Random(seed)
    count = max(1, round(rate * duration))
    offset, requests = 0.0, []
    for _ in range(count):
        if prompt_tokens:
            # ids below 1000 exist in every vocabulary, tiny test models' included
            prompt: str | list[int] = [rng.randrange(10, 1000) for _ in range(prompt_tokens)]
        else:
            prompt = rng.choice(TASKS).format(rng.choice(TOPICS))
        requests.append((offset, prompt, rng.randint(min_tokens, max_tokens)))
        offset += rng.expovariate(rate)
    return requests


def record_sse_line(result: RequestResult, line: str, token_ids: bool, sent: float) -> bool:
    """Takes one line of a streamed answer into `result`; False once the stream carried an error."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return True
    chunk = json.loads(line[6:])
    if "error" in chunk:
        result.error = chunk["error"].get("message", "error")
        result.error_time = now() - sent
        return False
    first = (chunk.get("choices") if token_ids else
             any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])))
    if result.ttft is None and first:
        result.ttft = now() - sent
    if chunk.get("usage"):
        result.output_tokens = chunk["usage"]["completion_tokens"]
        result.prompt_tokens = chunk["usage"]["prompt_tokens"]
    return True


def finish_result(result: RequestResult, sent: float) -> None:
    result.e2e = now() - sent
    if result.ttft is None:       # no visible text at all (e.g. EOS first): first token == last
        result.ttft = result.e2e


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str | list[int], max_tokens: int,
                      start: float, headers: dict[str, str]) -> RequestResult:
    result = RequestResult(send_time=now() - start, max_tokens=max_tokens)
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}
    if isinstance(prompt, list):   # token ids: a completion of exactly max_tokens (no tokenizer, no EOS)
        # logprobs=0 makes the server send a chunk per token even when there is no text to show
        endpoint, body = "/v1/completions", {**common, "prompt": prompt, "ignore_eos": True, "logprobs": 0}
    else:
        endpoint, body = "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    sent = now()
    try:
        async with client.stream("POST", url + endpoint, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                result.error_time = now() - sent
                return result
            async for line in response.aiter_lines():
                if not record_sse_line(result, line, isinstance(prompt, list), sent):
                    return result
        finish_result(result, sent)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.error_time = now() - sent
    return result


async def scrape_metric(client: httpx.AsyncClient, url: str, name: str) -> Optional[float]:
    try:
        text = (await client.get(url + "/metrics")).text
    except httpx.HTTPError:
        return None
    total = None
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


async def sample_queue(client: httpx.AsyncClient, url: str, stop: asyncio.Event,
                       period_s: float = 0.5) -> tuple[list[float], list[float]]:
    """(running, waiting) request counts from the server's /metrics every `period_s` until `stop`."""
    running: list[float] = []
    waiting: list[float] = []
    while not stop.is_set():
        batch = await scrape_metric(client, url, "kvserve:num_requests_running")
        queue = await scrape_metric(client, url, "kvserve:num_requests_waiting")
        if batch is not None and queue is not None:
            running.append(batch)
            waiting.append(queue)
        try:
            await asyncio.wait_for(stop.wait(), period_s)
        except asyncio.TimeoutError:
            pass
    return running, waiting


async def send_plan(client: httpx.AsyncClient, url: str, model: str,
                    plan: list[tuple[float, str | list[int], int]], headers: dict[str, str],
                    start: float) -> ClientShare:
    """Sends each request of `plan` at `start` (a now() time, maybe still ahead) plus its offset, open loop,
    and waits for all of them; CPU time is counted from the start, not over the wait for it."""
    if start > now():
        await asyncio.sleep(start - now())
    cpu_before = time.process_time()
    tasks = []
    for offset, prompt, max_tokens in plan:
        delay = offset - (now() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_request(client, url, model, prompt, max_tokens, start, headers)))
    results = await asyncio.gather(*tasks)
    return ClientShare(list(results), time.process_time() - cpu_before, now() - start)


def _client_limits() -> httpx.Limits:
    return httpx.Limits(max_connections=None, max_keepalive_connections=None)


async def _worker_send(index: int, plan: list[tuple[float, str | list[int], int]], url: str, model: str,
                       headers: dict[str, str], request_timeout: float, ready, starts) -> ClientShare:
    async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout), limits=_client_limits()) as client:
        ready.put(index)
        start_wall = await asyncio.to_thread(starts.get)
        # The parent's start is a time.time() value: wall clocks agree across processes on any OS,
        # and reading both clocks back to back turns it into this process's now() to within microseconds.
        start = now() + (start_wall - time.time())
        return await send_plan(client, url, model, plan, headers, start)


def client_worker(index: int, plan: list[tuple[float, str | list[int], int]], url: str, model: str,
                  headers: dict[str, str], request_timeout: float, ready, starts, done) -> None:
    """A spawned client process: its own event loop and HTTP client, its share of the plan."""
    share = asyncio.run(_worker_send(index, plan, url, model, headers, request_timeout, ready, starts))
    done.put((index, share.to_plain()))


def _get_from_workers(q, workers: list, deadline: float, what: str):
    """q.get() that gives up when a worker died (it would never answer) or the deadline passed."""
    while True:
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a client process exited with code {dead[0]} before it was {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"client processes not {what} in time")


def send_in_processes(plan: list[tuple[float, str | list[int], int]], url: str, model: str,
                      headers: dict[str, str], request_timeout: float, processes: int) -> list[ClientShare]:
    """Deals `plan` round-robin to `processes` spawned clients (spawn: a fork would copy the parent's
    event loop and connections) that start sending at one common time once all of them are ready;
    returns their shares in worker order (worker k sent plan[k::processes])."""
    ctx = multiprocessing.get_context("spawn")
    ready, starts, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    workers = [ctx.Process(target=client_worker, daemon=True, name=f"serve-bench-client-{k}",
                           args=(k, plan[k::processes], url, model, headers, request_timeout, ready, starts, done))
               for k in range(processes)]
    for worker in workers:
        worker.start()
    try:
        deadline = time.monotonic() + 120
        for _ in workers:
            _get_from_workers(ready, workers, deadline, "ready")
        # A little ahead, so that every worker has the start before the first send is due.
        start_wall = time.time() + 0.1
        for _ in workers:
            starts.put(start_wall)
        deadline = time.monotonic() + 0.1 + (plan[-1][0] if plan else 0.0) + request_timeout + 60
        shares: list[Optional[ClientShare]] = [None] * processes
        for _ in workers:
            index, plain = _get_from_workers(done, workers, deadline, "done")
            shares[index] = ClientShare.from_plain(plain)
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
    return shares  # type: ignore[return-value]


def merge_shares(shares: list[ClientShare], num_requests: int) -> list[RequestResult]:
    """The shares' results back in plan order (worker k sent plan[k::len(shares)]), as one process has them."""
    merged: list[Optional[RequestResult]] = [None] * num_requests
    for k, share in enumerate(shares):
        merged[k::len(shares)] = share.results    # a share of the wrong length raises here
    return merged  # type: ignore[return-value]


async def run_rate(url: str, model: str, rate: float, args: argparse.Namespace,
                   headers: dict[str, str], point_index: int = 0) -> RatePoint:
    # Each point of a sweep draws its own prompts: with one seed for all, every rate would resend the
    # previous rate's prompts in the same order and hit the prefix cache the earlier rate filled.
    seed = args.seed + point_index
    plan = make_requests(rate, args.duration, args.min_tokens, args.max_tokens, seed, args.prompt_tokens)
    started_unix = time.time()
    # Callers may build their own Namespace; more processes than requests would send nothing.
    processes = min(getattr(args, "client_processes", 1), len(plan))
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=_client_limits()) as client:
        preempt_before = await scrape_metric(client, url, "kvserve:num_preemptions_total")
        stop_sampling = asyncio.Event()
        sampler = asyncio.create_task(sample_queue(client, url, stop_sampling))
        try:
            if processes > 1:
                shares = await asyncio.to_thread(send_in_processes, plan, url, model, headers,
                                                 args.request_timeout, processes)
            else:
                shares = [await send_plan(client, url, model, plan, headers, now())]
        finally:
            stop_sampling.set()
            running, waiting = await sampler
        preempt_after = await scrape_metric(client, url, "kvserve:num_preemptions_total")
    # The shares started together, so the run lasts until the last of them finished.
    duration = max(share.wall_s for share in shares)
    results = merge_shares(shares, len(plan))
    point = summarize_rate(rate, results, duration, args)
    point.server_preemptions = ((preempt_after - preempt_before)
                                if None not in (preempt_after, preempt_before) else None)
    add_client_cost(point, plan, results, shares)
    point.started_unix, point.seed = round(started_unix, 3), seed
    if running:
        point.running_mean = round(statistics.fmean(running), 1)
        point.running_max, point.waiting_max = max(running), max(waiting)
    return point


def summarize_rate(rate: float, results: list[RequestResult], duration: float,
                   args: argparse.Namespace) -> RatePoint:
    done = [r for r in results if r.error is None and r.e2e is not None]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    good = [r for r in done if r.ttft is not None and r.ttft <= args.slo_ttft
            and (r.tpot is None or r.tpot <= args.slo_tpot)]
    output_tokens = sum(r.output_tokens for r in done)
    return RatePoint(
        request_rate=rate, num_requests=len(results), num_completed=len(done),
        num_errors=len(results) - len(done), duration_s=round(duration, 3),
        output_tokens_per_s=round(output_tokens / duration, 2), requests_per_s=round(len(done) / duration, 3),
        mean_prompt_tokens=round(statistics.fmean([r.prompt_tokens for r in done]), 1) if done else 0.0,
        mean_output_tokens=round(statistics.fmean([r.output_tokens for r in done]), 1) if done else 0.0,
        ttft_p50_s=_round(percentile(ttfts, 50)), ttft_p99_s=_round(percentile(ttfts, 99)),
        tpot_p50_s=_round(percentile(tpots, 50)), tpot_p99_s=_round(percentile(tpots, 99)),
        e2e_p50_s=_round(percentile([r.e2e for r in done], 50)), e2e_p99_s=_round(percentile([r.e2e for r in done], 99)),
        goodput_req_per_s=round(len(good) / duration, 3), goodput_fraction=round(len(good) / len(results), 3),
        num_rejected_overloaded=sum(1 for r in results if r.error and "overloaded" in r.error),
        errors=sorted({r.error for r in results if r.error})[:5])


def add_client_cost(point: RatePoint, plan: list[tuple[float, str | list[int], int]],
                    results: list[RequestResult], shares: list[ClientShare]) -> None:
    """The client's CPU time per process and how late its sends left: a busy client delays both."""
    point.client_processes = len(shares)
    point.client_cpu_s_per_process = [round(share.cpu_s, 3) for share in shares]
    point.client_cpu_util_per_process = [round(share.cpu_s / share.wall_s, 3) if share.results and share.wall_s > 0
                                         else 0.0 for share in shares]
    point.client_cpu_s = round(sum(share.cpu_s for share in shares), 3)
    point.client_cpu_util = max(point.client_cpu_util_per_process)
    lags = [max(0.0, r.send_time - offset) for (offset, _, _), r in zip(plan, results)]
    point.send_lag_p99_s = _round(percentile(lags, 99))
    point.send_lag_max_s = _round(max(lags)) if lags else None


def client_warnings(point: RatePoint) -> list[str]:
    """A line per rate whose client ran near one core in some process: its figures may be the client's."""
    if point.client_cpu_util is None or point.client_cpu_util <= CLIENT_CPU_WARN:
        return []
    # Enough processes that each would run at about half a core at this load.
    total = sum(point.client_cpu_util_per_process)
    suggest = max(point.client_processes + 1, math.ceil(total / 0.5))
    return [f"warning: at {point.request_rate:g} req/s a client process used "
            f"{100 * point.client_cpu_util:.0f}% of one core (> {100 * CLIENT_CPU_WARN:.0f}%): the client is "
            f"likely the bottleneck (send lag p99 {point.send_lag_p99_s} s); rerun with --client-processes {suggest}"]


@dataclass
class BurstPoint:
    """N requests sent at once against a server with latency targets (--slo-ttft --slo-shed): how fast
    the ones that cannot be served in time are told so, and whether the admitted ones meet the target."""
    num_requests: int
    num_admitted: int                  # completed with a 200 stream
    num_rejected_overloaded: int       # HTTP 503 or an in-stream "overloaded" event
    num_other_errors: int
    reject_time_p50_s: Optional[float]
    reject_time_p99_s: Optional[float]
    reject_time_max_s: Optional[float]
    admitted_ttft_p50_s: Optional[float]
    admitted_ttft_p99_s: Optional[float]
    admitted_ttft_max_s: Optional[float]
    admitted_meeting_ttft_fraction: Optional[float]
    admitted_tpot_p50_s: Optional[float]
    admitted_tpot_p99_s: Optional[float]
    duration_s: float
    output_tokens_per_s: float
    errors: list[str] = field(default_factory=list)


async def _raw_burst_request(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], payload: bytes,
                             token_ids: bool, start: float, go: asyncio.Event) -> RequestResult:
    """One streamed request on an open connection, timed from the moment its bytes are written.
    A burst through an HTTP client library would time the client: on a 2-core machine, building and
    writing 200 requests takes it longer than the server takes to answer them."""
    reader, writer = connection
    result = RequestResult(send_time=0.0)
    await go.wait()
    writer.write(payload)
    await writer.drain()
    sent = now()
    result.send_time = sent - start
    try:
        status_line = await reader.readline()
        status = int(status_line.split()[1])
        head = await reader.readuntil(b"\r\n\r\n")
        if status != 200:
            result.error = f"HTTP {status}: {(await reader.read())[:200]!r}"
            result.error_time = now() - sent
            return result
        chunked = b"chunked" in head.lower()
        async for line in _sse_lines(reader, chunked):
            if not record_sse_line(result, line, token_ids, sent):
                return result
        finish_result(result, sent)
    except (OSError, ValueError, IndexError, asyncio.IncompleteReadError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        result.error_time = now() - sent
    finally:
        writer.close()
    return result


async def _sse_lines(reader: asyncio.StreamReader, chunked: bool):
    """Lines of an SSE body, de-chunked (uvicorn sends streamed bodies with chunked encoding)."""
    buffer = b""
    while True:
        if chunked:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            buffer += await reader.readexactly(size)
            await reader.readexactly(2)
        else:
            data = await reader.read(65536)
            if not data:
                break
            buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode("utf-8").rstrip("\r")


async def run_burst(url: str, model: str, count: int, args: argparse.Namespace,
                    headers: dict[str, str]) -> BurstPoint:
    plan = make_requests(1.0, count, args.min_tokens, args.max_tokens, args.seed, args.prompt_tokens)[:count]
    host_port = url.split("://", 1)[1].rstrip("/")
    host, port = host_port.rsplit(":", 1)
    payloads = []
    for _, prompt, max_tokens in plan:
        common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
        if isinstance(prompt, list):
            path, body = "/v1/completions", {**common, "prompt": prompt, "ignore_eos": True, "logprobs": 0}
        else:
            path, body = "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
        data = json.dumps(body).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        payloads.append((f"POST {path} HTTP/1.1\r\nHost: {host_port}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\nConnection: close\r\n{extra}\r\n").encode() + data)
    # Connections are opened first and not timed; then every request is written at once.
    connections = [await asyncio.open_connection(host, int(port)) for _ in plan]
    go = asyncio.Event()
    start = now()
    tasks = [asyncio.ensure_future(_raw_burst_request(conn, payload, isinstance(prompt, list), start, go))
             for conn, payload, (_, prompt, _) in zip(connections, payloads, plan)]
    go.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.request_timeout)
    duration = now() - start
    done = [r for r in results if r.error is None and r.e2e is not None]
    shed = [r for r in results if r.error and ("overloaded" in r.error or r.error.startswith("HTTP 503"))]
    other = [r for r in results if r.error and r not in shed]
    shed_times = [r.error_time for r in shed if r.error_time is not None]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    return BurstPoint(
        num_requests=len(results), num_admitted=len(done), num_rejected_overloaded=len(shed),
        num_other_errors=len(other),
        reject_time_p50_s=_round(percentile(shed_times, 50)), reject_time_p99_s=_round(percentile(shed_times, 99)),
        reject_time_max_s=_round(max(shed_times)) if shed_times else None,
        admitted_ttft_p50_s=_round(percentile(ttfts, 50)), admitted_ttft_p99_s=_round(percentile(ttfts, 99)),
        admitted_ttft_max_s=_round(max(ttfts)) if ttfts else None,
        admitted_meeting_ttft_fraction=(round(sum(t <= args.slo_ttft for t in ttfts) / len(ttfts), 3)
                                        if ttfts else None),
        admitted_tpot_p50_s=_round(percentile([r.tpot for r in done if r.tpot is not None], 50)),
        admitted_tpot_p99_s=_round(percentile([r.tpot for r in done if r.tpot is not None], 99)),
        duration_s=round(duration, 3),
        output_tokens_per_s=round(sum(r.output_tokens for r in done) / duration, 2),
        errors=sorted({r.error[:200] for r in other})[:5])


def format_burst(point: BurstPoint, ttft_target: float) -> str:
    def f(v):
        return f"{v:.3f}" if v is not None else "-"
    return (f"burst of {point.num_requests}: {point.num_admitted} admitted, {point.num_rejected_overloaded} shed "
            f"(503 after p50 {f(point.reject_time_p50_s)} / p99 {f(point.reject_time_p99_s)} / max "
            f"{f(point.reject_time_max_s)} s), {point.num_other_errors} other errors; admitted TTFT p50 "
            f"{f(point.admitted_ttft_p50_s)} / p99 {f(point.admitted_ttft_p99_s)} / max {f(point.admitted_ttft_max_s)} s "
            f"against {ttft_target:g} s ({f(point.admitted_meeting_ttft_fraction)} meet it), TPOT p50 "
            f"{f(point.admitted_tpot_p50_s)} / p99 {f(point.admitted_tpot_p99_s)} s; "
            f"{point.output_tokens_per_s:.1f} out tok/s over {point.duration_s:.1f} s")


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 4)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = names[0] if names else None
    except OSError:
        pass
    try:
        import torch
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        sys.path.insert(0, repo)
        import kvserve
        info["kvserve"] = kvserve.__version__
    except ImportError:
        pass
    finally:
        sys.path.remove(repo)
    try:
        def git(*cmd: str) -> str:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=repo).stdout.strip()
        info["git_commit"] = git("rev-parse", "HEAD") or None
        info["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no"))
    except OSError:
        pass
    return info


def start_server(serve_args: list[str], port: int, log_path: str) -> subprocess.Popen:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), *serve_args],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def split_serve_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the benchmark's own arguments, the `kvserve serve` flags after `--`)."""
    if "--" not in argv:
        return list(argv), []
    split = argv.index("--")
    return argv[:split], argv[split + 1:]


def add_overload_args(parser: argparse.ArgumentParser, overload: float, overload_help: str) -> None:
    """The flags the overload benchmarks share (qos_classes_bench, fairness_bench): a Poisson trace
    of --duration at --overload times the capacity, measured from a burst unless given."""
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument("--overload", type=float, default=overload, help=overload_help)
    parser.add_argument("--capacity", type=float, default=None, help="requests/s; default: measured")
    parser.add_argument("--capacity-burst", type=int, default=48)
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--json", default=None)


def serve_on_free_port(serve_args: list[str], log_path: str, timeout: float,
                       headers: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen, str, str]:
    """`kvserve serve` with these flags on a free loopback port, once healthy: (process, url, the
    model name /v1/models lists first; `headers` carry the API key when the flags set keys)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = start_server(serve_args, port, log_path)
    try:
        wait_healthy(url, proc, timeout)
        model = httpx.get(url + "/v1/models", headers=headers or {}, timeout=10).json()["data"][0]["id"]
    except BaseException:
        stop_server(proc)
        raise
    return proc, url, model


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within a minute."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def server_processes(server_pid: int) -> dict[str, int]:
    """The local server's processes by role: "server" (the launcher, which is also the front end with
    one API server), "core" (the engine core) and "front-end-N" (more API servers): the spawned
    children of the launcher (multiprocessing's resource tracker left out)."""
    roles = {"server": server_pid}
    try:
        with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
            children = [int(pid) for pid in f.read().split()]
    except OSError:
        return roles
    front_ends = 0
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" not in cmdline or "resource_tracker" in cmdline:
            continue
        # The core is spawned first (the front ends wait for it to be ready).
        if "core" not in roles:
            roles["core"] = pid
        else:
            front_ends += 1
            roles[f"front-end-{front_ends}"] = pid
    return roles


class RateProfiler:
    """py-spy stacks of the local server's processes in the middle of each rate's run: sampling starts
    30% into the arrivals and lasts half of them, so it sees the steady state, not the ramp or the
    drain. Raw (collapsed-stack) files, idle frames included: the core's time waiting in its poll or on
    the GPU is part of the answer to "what limits the rate"."""

    def __init__(self, directory: str, server_pid: int, duration_s: float) -> None:
        self.py_spy = shutil.which("py-spy")
        if self.py_spy is None:
            raise SystemExit("--profile-dir needs py-spy on PATH (pip install py-spy)")
        self.directory, self.server_pid, self.duration_s = directory, server_pid, duration_s
        os.makedirs(directory, exist_ok=True)
        self.timer: Optional[threading.Timer] = None
        self.running: list[subprocess.Popen] = []

    def start(self, label: str) -> None:
        self.timer = threading.Timer(0.3 * self.duration_s, self._record, args=(label,))
        self.timer.start()

    def _record(self, label: str) -> None:
        seconds = str(max(1, round(0.5 * self.duration_s)))
        for role, pid in server_processes(self.server_pid).items():
            out = os.path.join(self.directory, f"{role}_rate_{label}.txt")
            self.running.append(subprocess.Popen(
                [self.py_spy, "record", "--pid", str(pid), "--duration", seconds, "--rate", "100", "--idle",
                 "--format", "raw", "--output", out, "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))

    def finish(self) -> None:
        if self.timer is not None:
            self.timer.join()
        for process in self.running:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        self.running.clear()


def wait_healthy(url: str, proc: Optional[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy within {timeout:.0f} s")


def format_table(points: list[RatePoint]) -> str:
    header = (f"{'rate':>5} {'reqs':>5} {'err':>4} {'dur s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9} {'TPOT p99':>9} {'goodput':>8} {'good %':>7} {'out tok':>7} {'cli cpu':>7} "
              f"{'lag p99':>9} {'batch':>6} {'queue':>6}")
    rows = [header]
    for p in points:
        def f(v):
            return f"{v:9.3f}" if v is not None else f"{'-':>9}"
        rows.append(f"{p.request_rate:5.2f} {p.num_requests:5d} {p.num_errors:4d} {p.duration_s:7.1f} "
                    f"{p.output_tokens_per_s:9.1f} {f(p.ttft_p50_s)} {f(p.ttft_p99_s)} {f(p.tpot_p50_s)} "
                    f"{f(p.tpot_p99_s)} {p.goodput_req_per_s:8.3f} {100 * p.goodput_fraction:6.1f}% "
                    f"{p.mean_output_tokens:7.1f} {_percent(p.client_cpu_util):>7} "
                    f"{f(p.send_lag_p99_s)} {_count(p.running_mean)} {_count(p.waiting_max)}")
    return "\n".join(rows)


def _count(value: Optional[float]) -> str:
    """The server's mean running batch or largest queue ('-' when /metrics was not read)."""
    return f"{'-':>6}" if value is None else f"{value:6.1f}"


def _percent(fraction: Optional[float]) -> str:
    """The client's busiest process as a share of one core ('-' when not measured)."""
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def main(argv: Optional[list[str]] = None) -> int:
    argv, serve_args = split_serve_args(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server; default: start `kvserve serve` "
                                                    "with the flags after `--`")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"))
    parser.add_argument("--rates", default="1,2,4", help="comma-separated request rates (req/s)")
    parser.add_argument("--burst", type=int, default=0,
                        help="instead of Poisson rates: send this many requests at once (load shedding: run the "
                             "server with --slo-ttft/--slo-shed) and report time to each 503 and the admitted TTFT")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="send random token-id prompts of this length to /v1/completions (no tokenizer needed)")
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.2, help="seconds per output token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="requests sent one by one before measuring")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--client-processes", type=int, default=1,
                        help="send each rate's arrivals from this many client processes (round-robin, same "
                             "send times) when one process would be the bottleneck; 1 sends from this process. "
                             "They share the machine's cores with a local server")
    parser.add_argument("--profile-dir", default=None,
                        help="with a server this script starts: py-spy stacks (raw format) of its core and "
                             "front-end processes in the middle of each rate, one file per process and rate")
    parser.add_argument("--json", default=None, help="write results here (e.g. benchmarks/results/serving/cpu_poisson.json)")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if args.client_processes < 1:
        parser.error("--client-processes must be at least 1")
    if args.profile_dir and args.url:
        parser.error("--profile-dir profiles a server this script starts; it cannot follow --url")

    load_before = os.getloadavg()
    proc = None
    url = args.url
    if url is None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvserve-serve-bench-{port}.log")
        print(f"starting kvserve serve {' '.join(serve_args)} on {url} (log: {log_path})", flush=True)
        proc = start_server(serve_args, port, log_path)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        wait_healthy(url, proc, args.startup_timeout)
        models = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"]
        model = args.model or models[0]["id"]

        async def warmup() -> None:
            async with httpx.AsyncClient(timeout=args.request_timeout) as client:
                for i in range(args.warmup):
                    prompt = list(range(10, 10 + args.prompt_tokens)) if args.prompt_tokens else "Say hello."
                    await one_request(client, url, model, prompt, 8, now(), headers)

        asyncio.run(warmup())
        points: list[Any] = []
        if args.burst:
            rates = []
            point = asyncio.run(run_burst(url, model, args.burst, args, headers))
            points.append(point)
            print(format_burst(point, args.slo_ttft), flush=True)
        profiler = (RateProfiler(args.profile_dir, proc.pid, args.duration)
                    if args.profile_dir and proc is not None else None)
        for index, rate in enumerate(rates):
            if profiler is not None:
                profiler.start(f"{index}_{rate:g}")
            point = asyncio.run(run_rate(url, model, rate, args, headers, point_index=index))
            if profiler is not None:
                profiler.finish()
            points.append(point)
            lines = format_table([point]).splitlines()
            print("\n".join(lines if len(points) == 1 else lines[1:]), flush=True)
            for warning in client_warnings(point):
                print(warning, flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()

    print()
    print(format_burst(points[0], args.slo_ttft) if args.burst else format_table(points))
    for point in [] if args.burst else points:
        for warning in client_warnings(point):
            print(warning)
    if args.json:
        report = {
            "benchmark": "serve_bench", "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "server_flags": serve_args, "url": args.url, "model": model,
            "max_model_len": models[0].get("max_model_len"), "endpoint": ("/v1/completions (stream, token-id prompts, ignore_eos)" if args.prompt_tokens
                         else "/v1/chat/completions (stream)"),
            "workload": {"arrivals": f"burst of {args.burst} at once" if args.burst else "poisson", "duration_s_per_rate": args.duration,
                         "max_tokens_uniform": [args.min_tokens, args.max_tokens], "temperature": 0,
                         "prompts": (f"{args.prompt_tokens} random token ids" if args.prompt_tokens else
                                     "one-sentence instructions (TASKS x TOPICS in the script)"), "seed": args.seed},
            "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
            "client_processes": args.client_processes,
            "goodput_definition": "requests meeting both SLOs / seconds from first send to last completion",
            "machine": machine_info(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            # Other work on a shared machine skews CPU figures; the 1-minute load says how much.
            "loadavg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "results": [asdict(p) for p in points],
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
