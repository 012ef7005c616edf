"""benchmarks/serving/serve_bench.py's client against a fake streaming server (no kvserve engine): every
planned request is sent once and completes, from one process or dealt to several (--client-processes)
with the same counts, and the client's own CPU time is measured and plausible (> 0, at most one core per
process), so a run can show the client was not the bottleneck."""

from __future__ import annotations

import importlib
import json
import pathlib
import subprocess
import sys

import httpx
import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "serving"

# A raw asyncio HTTP/1.1 server in its own process (so that the in-process client's CPU time is the
# client's alone): GET /health, GET /v1/models, GET /stats (completions served), and POST
# /v1/chat/completions streamed in OpenAI's chunk format, one content chunk per token of max_tokens,
# then a usage chunk and [DONE], chunked as uvicorn sends it. It prints its port on the first line.
FAKE_SERVER = r'''
import asyncio, json, socket, sys

served = 0

def event(payload):
    data = b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)

def plain(writer, status, body):
    body = body.encode()
    writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (status, len(body), body))

async def stream(writer, request):
    global served
    tokens = request["max_tokens"]
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    base = {"id": "c", "object": "chat.completion.chunk", "model": request["model"]}
    writer.write(event({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
    for i in range(tokens):
        await asyncio.sleep(0.01)
        writer.write(event({**base, "choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}))
        await writer.drain()
    writer.write(event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
    writer.write(event({**base, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": tokens,
                                                          "total_tokens": 7 + tokens}}))
    writer.write(event(b"[DONE]") + b"0\r\n\r\n")
    served += 1

async def handle(reader, writer):
    try:
        while True:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
            method, path, _ = head.split("\r\n", 1)[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in
                       (line.split(":", 1) for line in head.split("\r\n")[1:] if ":" in line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "POST" and path == "/v1/chat/completions":
                await stream(writer, json.loads(body))
            elif path == "/v1/models":
                plain(writer, 200, json.dumps({"object": "list", "data": [{"id": "fake", "max_model_len": 256}]}))
            elif path == "/health":
                plain(writer, 200, "{}")
            elif path == "/stats":
                plain(writer, 200, json.dumps({"completions": served}))
            else:
                plain(writer, 404, "{}")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()

async def main():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(handle, sock=sock, backlog=128)
    print(sock.getsockname()[1], flush=True)
    await server.serve_forever()

asyncio.run(main())
'''


@pytest.fixture(scope="module")
def fake_server():
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def bench():
    # Imported by its name from a folder on sys.path (not from a file spec): the spawned client
    # processes inherit sys.path and find the worker function by that module name.
    sys.path.insert(0, str(SCRIPTS))
    try:
        yield importlib.import_module("serve_bench")
    finally:
        sys.modules.pop("serve_bench", None)
        sys.path.remove(str(SCRIPTS))


def _served(url: str) -> int:
    return httpx.get(url + "/stats", timeout=5).json()["completions"]


def _run(bench, url: str, tmp_path, processes: int, capsys) -> tuple[dict, str, int]:
    out = tmp_path / f"serve_bench_{processes}.json"
    served_before = _served(url)
    assert bench.main(["--url", url, "--rates", "5", "--duration", "2", "--min-tokens", "3", "--max-tokens", "6",
                       "--seed", "3", "--warmup", "1", "--client-processes", str(processes),
                       "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["client_processes"] == processes
    [point] = report["results"]
    return point, capsys.readouterr().out, _served(url) - served_before


def test_one_and_two_client_processes_send_the_same_requests(bench, fake_server, tmp_path, capsys):
    plan = bench.make_requests(5, 2, 3, 6, 3)
    planned_tokens = sum(max_tokens for _, _, max_tokens in plan)
    points = {}
    for processes in (1, 2):
        point, printed, served = _run(bench, fake_server, tmp_path, processes, capsys)
        points[processes] = point
        # Every planned request was sent once (plus the one warmup) and completed with all its tokens.
        assert served == len(plan) + 1
        assert point["num_requests"] == point["num_completed"] == len(plan), point["errors"]
        assert point["num_errors"] == 0
        assert round(point["mean_output_tokens"] * point["num_completed"]) == planned_tokens
        # The client's own CPU time: per process, > 0 and at most that process's wall time (one thread
        # sends and reads), so below the run's wall time times the number of processes in all.
        assert point["client_processes"] == processes
        assert len(point["client_cpu_s_per_process"]) == len(point["client_cpu_util_per_process"]) == processes
        assert all(0 < cpu <= point["duration_s"] for cpu in point["client_cpu_s_per_process"])
        assert 0 < point["client_cpu_s"] < point["duration_s"] * processes
        assert point["client_cpu_util"] == max(point["client_cpu_util_per_process"]) > 0
        assert point["send_lag_p99_s"] is not None and 0 <= point["send_lag_p99_s"] <= point["send_lag_max_s"]
        assert "cli cpu" in printed and f"{100 * point['client_cpu_util']:.0f}%" in printed
    for key in ("num_requests", "num_completed", "num_errors", "mean_output_tokens", "mean_prompt_tokens"):
        assert points[1][key] == points[2][key], key


def test_merge_puts_the_shares_back_in_plan_order(bench):
    shares = [bench.ClientShare([bench.RequestResult(send_time=float(i)) for i in range(k, 5, 2)], 0.1, 1.0)
              for k in range(2)]
    assert [r.send_time for r in bench.merge_shares(shares, 5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    # A share that lost a result cannot be merged silently.
    shares[1].results.pop()
    with pytest.raises(ValueError):
        bench.merge_shares(shares, 5)
    plain = bench.ClientShare.from_plain(shares[0].to_plain())
    assert plain == shares[0]


def test_a_busy_client_process_is_flagged(bench):
    point = bench.RatePoint(request_rate=8, num_requests=1, num_completed=1, num_errors=0, duration_s=1.0,
                            output_tokens_per_s=1.0, requests_per_s=1.0, mean_prompt_tokens=1.0,
                            mean_output_tokens=1.0, ttft_p50_s=None, ttft_p99_s=None, tpot_p50_s=None,
                            tpot_p99_s=None, e2e_p50_s=None, e2e_p99_s=None, goodput_req_per_s=1.0,
                            goodput_fraction=1.0, client_processes=1, client_cpu_s=0.95, client_cpu_util=0.95,
                            client_cpu_s_per_process=[0.95], client_cpu_util_per_process=[0.95])
    [warning] = bench.client_warnings(point)
    assert "--client-processes 2" in warning
    point.client_cpu_util = point.client_cpu_util_per_process[0] = 0.3
    assert bench.client_warnings(point) == []
