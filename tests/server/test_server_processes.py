"""`kvserve serve` as processes (docs/server.md#processes): the engine core killed mid-stream, a
SIGTERM drain, several front ends on one port, and a front end dying alone. Each test runs the
real command on a tiny random Llama (the default model's tokenizer) and checks the process tree."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import ServeProcess, build_tiny_chat_model, process_tree, wait_gone

pytestmark = [pytest.mark.slow, requires_default_model]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-processes"), max_position_embeddings=8192)


def _serve(tiny_model, tmp_path, *extra: str) -> ServeProcess:
    return ServeProcess(["--model", tiny_model, "--max-model-len", "8192", "--kv-cache-memory", "64MiB",
                         "--shutdown-timeout", "10", *extra], tmp_path / "serve.log")


def _stream(url: str, results: dict, name: str, max_tokens: int, started: threading.Event = None) -> None:
    """A streamed completion; results[name] = (its data lines, when the last one arrived) or the
    exception that ended it."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    lines = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if started is not None and len(lines) == 2:
                        started.set()
        results[name] = (lines, time.monotonic())
    except httpx.HTTPError as exc:
        results[name] = exc


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _established_on_port(pid: int, port: int) -> int:
    """How many established TCP connections on the server's port process `pid` holds (its socket
    inodes in /proc/PID/fd matched against /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port == port and fields[3] == "01" and fields[9] in inodes:
                    count += 1
    return count


def test_a_killed_engine_core_fails_every_stream_and_the_server_exits(tiny_model, tmp_path):
    server = _serve(tiny_model, tmp_path)
    pids = server.tree()
    try:
        results, events, threads = {}, [], []
        for i in range(3):
            events.append(threading.Event())
            threads.append(threading.Thread(target=_stream, args=(server.url, results, f"s{i}", 7000, events[-1])))
            threads[-1].start()
        assert all(event.wait(60) for event in events), server.log()
        killed = time.monotonic()
        os.kill(server.core_pid, signal.SIGKILL)
        for thread in threads:
            thread.join(10)
            assert not thread.is_alive(), "a stream hung after the engine core died"
        for name in ("s0", "s1", "s2"):
            lines, ended = results[name]
            assert ended - killed < 2.0, f"{name} learned of the dead core after {ended - killed:.2f} s"
            assert "engine_dead" in lines[-2] and lines[-1] == "data: [DONE]", lines[-3:]
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        assert server.process.wait(30) == 1, server.log()
        assert not wait_gone(pids), "processes left behind"
    finally:
        server.kill()


def test_sigterm_lets_open_streams_finish_then_exits_zero(tiny_model, tmp_path):
    server = _serve(tiny_model, tmp_path)
    pids = server.tree()
    assert len(pids) >= 3         # launcher, engine core, and multiprocessing's resource tracker
    try:
        results, started = {}, threading.Event()
        thread = threading.Thread(target=_stream, args=(server.url, results, "drained", 400, started))
        thread.start()
        assert started.wait(60), server.log()
        assert server.stop(signal.SIGTERM, timeout=60) == 0, server.log()
        thread.join(10)
        lines, _ = results["drained"]
        assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2], lines[-2:]
        assert not wait_gone(pids), "processes left behind"
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=2)
    finally:
        server.kill()


def test_front_ends_share_the_core_and_one_dying_spares_the_others(tiny_model, tmp_path):
    server = _serve(tiny_model, tmp_path, "--api-server-count", "2")
    try:
        pids = server.tree()
        children = process_tree(server.process.pid) - {server.process.pid, server.core_pid}
        front_ends = [pid for pid in children
                      if "resource_tracker" not in open(f"/proc/{pid}/cmdline").read()]
        assert len(front_ends) == 2, front_ends
        # Each request on a connection of its own: the kernel spreads them over both front ends.
        bodies = [{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0} for _ in range(12)]
        texts = set()
        for body in bodies:
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            texts.add(response.json()["choices"][0]["text"])
        assert len(texts) == 1          # greedy: the same answer whichever front end served it
        # Every front end's /metrics counts the requests of all of them (prometheus multiprocess mode).
        for _ in range(6):
            text = httpx.get(server.url + "/metrics", timeout=10).text
            assert _metric(text, "kvserve:request_success_total", finished_reason="length") == len(bodies)
            assert _metric(text, "kvserve:generation_tokens_total") >= 8 * len(bodies)

        # Streams over both front ends; one front end is killed: the other's streams finish, and
        # the core frees the dead one's blocks. The kernel picks a front end per connection, so
        # streams are added until each front end holds some (all ten on one happens now and then).
        port = int(server.url.rsplit(":", 1)[1])
        results, threads = {}, []

        def start_stream():
            threads.append(threading.Thread(target=_stream, args=(server.url, results, f"s{len(threads)}", 6000)))
            threads[-1].start()

        for _ in range(10):
            start_stream()
        deadline = time.monotonic() + 60
        while True:
            running = _metric(httpx.get(server.url + "/metrics").text, "kvserve:num_requests_running")
            held = {pid: _established_on_port(pid, port) for pid in front_ends}
            if running == len(threads) and sum(held.values()) >= len(threads):
                if min(held.values()) > 0 or len(threads) >= 24:
                    break
                start_stream()
            assert time.monotonic() < deadline, f"the streams did not all start: {held}"
            time.sleep(0.05)
        assert min(held.values()) > 0, f"every stream landed on one front end: {held}"
        streams = len(threads)
        os.kill(front_ends[0], signal.SIGKILL)
        killed = time.monotonic()
        while time.monotonic() - killed < 1.0:       # the dead one's clients see their connections reset
            time.sleep(0.05)
        cut_now = sum(isinstance(r, Exception) for r in results.values())
        assert cut_now == held[front_ends[0]], (cut_now, held)
        # ...and the core has dropped its requests at once, long before the others' streams end.
        deadline = time.monotonic() + 3
        while _metric(httpx.get(server.url + "/metrics").text, "kvserve:num_requests_running") != streams - cut_now:
            assert time.monotonic() < deadline, "the dead front end's requests kept running"
            time.sleep(0.05)
        assert len(results) < streams, "the streams ended too soon to tell"
        for thread in threads:
            thread.join(120)
        finished = [r for r in results.values() if not isinstance(r, Exception) and r[0][-1] == "data: [DONE]"
                    and '"finish_reason": "length"' in r[0][-2]]
        cut = [r for r in results.values() if isinstance(r, Exception)]
        assert finished and cut and len(finished) + len(cut) == streams, results
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert _metric(text, "kvserve:num_requests_running") == 0
        assert _metric(text, "kvserve:kv_cache_blocks_used") == 0
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert server.stop(signal.SIGTERM, timeout=60) == 0, server.log()
        assert not wait_gone(pids), "processes left behind"
    finally:
        server.kill()


def test_an_engine_that_cannot_start_is_a_cli_error(tmp_path):
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--model", str(tmp_path / "missing"),
                             "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "the engine could not start" in result.stdout, result.stdout + result.stderr
