"""The KV tiers below host RAM through real `kvserve serve` processes (the default model on CPU): a
disk tier that a restarted server finds, one Redis shared by two replicas (a prefix one computed is
a hit on the other, never across tenants), a Redis that dies and comes back under a running server,
and the /metrics series of the tiers. Every text is compared with a server without any tier (greedy:
a hit must give the cold run's text). Blocks filled by a request's last step go down while the
server is idle, and a single-step request's blocks survive a clean restart."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from conftest import requires_default_model
from loopback_server import ServeProcess
from redis_fixture import RedisServers

from kvserve.obs.metrics import COLD_TIER_METRIC_NAMES

pytestmark = [pytest.mark.slow, requires_default_model]

BLOCK = 16                  # the default block size
KEYS = {"sk-anon": None, "sk-a": "tenant-a", "sk-b": "tenant-b"}
ANON, TENANT_A, TENANT_B = "sk-anon", "sk-a", "sk-b"
# About 290 tokens of prose that does not repeat itself (a repeated text is continued by copying,
# whatever the KV holds): 17 full blocks before its last token, each of which a hit must bring back.
STORY = (
    "The ferry to the island left at seven, and Marta was the only passenger who had brought a bicycle. "
    "The deckhand, a tall man with a grey beard and a knitted cap, helped her lift it over the rail and "
    "tied it to a post with a length of blue rope. The crossing took forty minutes. She spent most of it "
    "watching the gulls that followed the wake, and the rest reading the letter her grandmother had sent "
    "in March, which described the house, the orchard behind it, the well that had been sealed after the "
    "war, and the neighbour who kept goats and sold cheese at the Saturday market in the harbour town. "
    "When the ferry docked, the village was still asleep. A baker was sweeping the step of his shop, and "
    "a dog lay in the sun beside the church. Marta asked him the way to the old Keller house. He pointed "
    "up the hill with his broom and told her to follow the stone wall until she reached a gate painted "
    "green, then to keep left at the fork, past the chapel with the broken bell. The road was steep and "
    "the gravel loose, so she pushed the bicycle most of the way. At the top she stopped to catch her "
    "breath and turned around. Below her, the whole bay lay open: the fishing boats, the lighthouse on "
    "its rock, and far out on the water the ferry already turning back towards the mainland. She"
)
COMPLETION = {"max_tokens": 12, "temperature": 0}


def _prompt(name: str) -> str:
    """A prompt of its own for each use: its first block differs, so no cache holds any of it."""
    return f"Chapter {name}.\n" + STORY


# --- helpers ------------------------------------------------------------------------------------------
def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of `name`'s series with these labels in the server's /metrics (one must exist)."""
    return _metric_in(httpx.get(url + "/metrics", timeout=10).text, name, **labels)


def _metric_in(text: str, name: str, **labels: str) -> float:
    total, found = 0.0, False
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total, found = total + float(match.group(2)), True
    assert found, f"{name}{labels} is not in /metrics"
    return total


def _hit_tokens(url: str, tier: str) -> float:
    return _metric(url, "kvserve:kv_tier_hit_tokens_total", tier=tier)


def _written(url: str, tier: str) -> float:
    return _metric(url, "kvserve:kv_tier_blocks_written_total", tier=tier)


def _complete(url: str, prompt, key: str = None, timeout: float = 60, **options) -> dict:
    """A greedy completion (`options` override COMPLETION's): {"status", "text", "prompt_tokens", "seconds"}."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    started = time.monotonic()
    response = httpx.post(url + "/v1/completions", json={"prompt": prompt, **COMPLETION, **options},
                          headers=headers, timeout=timeout)
    seconds = time.monotonic() - started
    if response.status_code != 200:
        return {"status": response.status_code, "text": response.text, "prompt_tokens": 0, "seconds": seconds}
    body = response.json()
    return {"status": 200, "text": body["choices"][0]["text"], "prompt_tokens": body["usage"]["prompt_tokens"],
            "seconds": seconds}


def _ok(result: dict) -> str:
    assert result["status"] == 200, result["text"]
    return result["text"]


def _prefetched_tokens(prompt_tokens: int) -> int:
    """The prompt tokens a prefetch can bring up: its full blocks, less the one holding its last token."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def _wait_for(what, condition, timeout: float, interval: float = 0.2):
    """Polls `condition()` until it returns something true (returned), at most `timeout` s; `what`
    (a string, or a function giving one) says what did not happen."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what() if callable(what) else what}: not within {timeout} s"
        time.sleep(interval)


def _wait_written(url: str, tier: str, at_least: float, timeout: float = 10) -> float:
    """Waits until the tier has written `at_least` blocks and its count has stopped growing."""
    last = [-1.0]

    def settled():
        now = _written(url, tier)
        done = now >= at_least and now == last[0]
        last[0] = now
        return now if done else None
    return _wait_for(lambda: f"{tier} tier writes reaching {at_least} blocks (at {last[0]})", settled, timeout)


def _start_all(*servers: tuple[list[str], object]) -> list[ServeProcess]:
    """Starts `kvserve serve` processes side by side (args, log path); all or none."""
    started: list = [None] * len(servers)
    errors: list = []

    def start(index: int, args: list[str], log) -> None:
        try:
            started[index] = ServeProcess(["--kv-cache-memory", "64MiB", "--shutdown-timeout", "10", *args], log)
        except BaseException as exc:          # reported below, in the test's thread
            errors.append(exc)
    threads = [threading.Thread(target=start, args=(i, args, log)) for i, (args, log) in enumerate(servers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for server in started:
            if server is not None:
                server.kill()
        raise errors[0]
    return started


def _host(*extra: str) -> list[str]:
    return ["--kv-host-memory", "16MiB", *extra]


# --- fixtures -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_thread_per_server():
    """Each server computes on one thread (unless OMP_NUM_THREADS says otherwise). With torch's default
    of a thread per core, a 300-token request took 13 s instead of 1.8 s on this 2-core machine while
    another process kept one core busy (threads spinning in each other's way), which no time bound
    of these tests survives. The reference server runs the same way, so texts still compare."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        yield


class ColdReference:
    """A server without any KV tier: each prompt's text computed once, from scratch."""

    def __init__(self, server: ServeProcess) -> None:
        self.server = server
        self._results: dict[str, dict] = {}

    def result(self, prompt: str) -> dict:
        if prompt not in self._results:
            result = _complete(self.server.url, prompt)
            assert result["status"] == 200, result["text"]
            self._results[prompt] = result
        return self._results[prompt]

    def text(self, prompt: str) -> str:
        return self.result(prompt)["text"]

    def limit(self, prompt: str) -> float:
        """A bound on a request that computes all of `prompt`: 10 s, or on a machine busy enough
        that computing it from scratch takes longer, 3 times what the server without tiers took."""
        return max(10.0, 3 * self.result(prompt)["seconds"])


@pytest.fixture(scope="module")
def first_wave(tmp_path_factory):
    """The reference server (no tier) and the first disk-tier server, started side by side."""
    logs = tmp_path_factory.mktemp("kv-tier-logs")
    disk = tmp_path_factory.mktemp("kv-disk")
    cold, disk_first = _start_all(([], logs / "cold.log"),
                                  (_host("--kv-disk-path", str(disk), "--kv-disk-size", "256MiB"),
                                   logs / "disk-1.log"))
    yield {"cold": cold, "disk_first": disk_first, "disk": disk, "logs": logs}
    cold.kill()
    disk_first.kill()


@pytest.fixture(scope="module")
def cold(first_wave):
    return ColdReference(first_wave["cold"])


@pytest.fixture(scope="module")
def disk_restart(first_wave):
    """Server 1 on a disk directory serves the prompt and is stopped (SIGTERM); server 2 starts on the
    same directory. What each saw is recorded for the test to check."""
    first, disk, prompt = first_wave["disk_first"], first_wave["disk"], _prompt("disk")
    run = {"prompt": prompt, "first": _complete(first.url, prompt)}
    run["first_hits"] = _hit_tokens(first.url, "disk")
    run["first_written"] = _written(first.url, "disk")
    # A request whose prefill is its only step (test_a_single_step_requests_blocks_survive_a_clean_restart).
    run["single_step_prompt"] = _prompt("single step")
    run["single_step"] = _complete(first.url, run["single_step_prompt"], max_tokens=1)
    run["first_exit"] = first.stop(signal.SIGTERM, timeout=60)
    run["first_log"] = first.log()
    (second,) = _start_all((_host("--kv-disk-path", str(disk), "--kv-disk-size", "256MiB"),
                            first_wave["logs"] / "disk-2.log"))
    run["second_server"] = second
    yield run
    second.kill()


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-tier-keys") / "keys.json"
    path.write_text(json.dumps(KEYS))
    return str(path)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, keys_file):
    """Two servers (replicas of one model) on one redis-server, with tenant keys."""
    logs = tmp_path_factory.mktemp("kv-replica-logs")
    with RedisServers() as redis_servers:
        redis = redis_servers.start(maxmemory="512mb", policy="allkeys-lru")
        args = _host("--kv-remote-url", redis.url, "--api-keys-file", keys_file)
        one, two = _start_all((args, logs / "replica-1.log"), (args, logs / "replica-2.log"))
        yield one, two, redis
        one.kill()
        two.kill()


# --- tests ---------------------------------------------------------------------------------------------
def test_a_restarted_server_finds_its_blocks_on_disk(cold, disk_restart):
    prompt, first = disk_restart["prompt"], disk_restart["first"]
    text_a = _ok(first)
    assert first["prompt_tokens"] >= 17 * BLOCK, first          # many blocks, or the test proves little
    assert disk_restart["first_hits"] == 0                      # an empty directory: computed
    assert disk_restart["first_written"] >= first["prompt_tokens"] // BLOCK
    assert disk_restart["first_exit"] == 0, disk_restart["first_log"]
    assert text_a == cold.text(prompt)                          # a disk tier does not change the text

    second = disk_restart["second_server"]
    result = _complete(second.url, prompt)
    assert _ok(result) == text_a
    hits = _hit_tokens(second.url, "disk")
    assert hits > 0, second.log()
    assert hits == _prefetched_tokens(result["prompt_tokens"]), hits        # every full block came up
    assert _metric(second.url, "kvserve:kv_tier_corrupt_total", tier="disk") == 0
    assert _metric(second.url, "kvserve:kv_host_hit_tokens_total") >= hits  # through the host tier


def test_a_prefix_one_replica_computed_is_a_hit_on_the_other(cold, replicas):
    one, two, _ = replicas
    prompt = _prompt("shared")
    written = _written(one.url, "remote")
    result = _complete(one.url, prompt, ANON)
    text = _ok(result)
    assert text == cold.text(prompt)
    _wait_written(one.url, "remote", written + result["prompt_tokens"] // BLOCK)

    hits = _hit_tokens(two.url, "remote")
    second = _complete(two.url, prompt, ANON)
    assert _ok(second) == text
    gained = _hit_tokens(two.url, "remote") - hits
    assert gained > 0, two.log()
    assert gained == _prefetched_tokens(second["prompt_tokens"]), gained
    assert _metric(two.url, "kvserve:kv_tier_available", tier="remote") == 1


def test_replicas_never_share_a_prefix_across_tenants(cold, replicas):
    one, two, _ = replicas
    prompt = _prompt("tenants")
    written = _written(one.url, "remote")
    result = _complete(one.url, prompt, TENANT_A)
    text = _ok(result)
    assert text == cold.text(prompt)
    _wait_written(one.url, "remote", written + result["prompt_tokens"] // BLOCK)

    hits = _hit_tokens(two.url, "remote")
    assert _ok(_complete(two.url, prompt, TENANT_B)) == text                # same prompt, other tenant
    assert _hit_tokens(two.url, "remote") == hits, "tenant B hit tenant A's blocks"

    result = _complete(two.url, prompt, TENANT_A)                           # the tenant that wrote them
    assert _ok(result) == text
    gained = _hit_tokens(two.url, "remote") - hits
    assert gained > 0, two.log()
    assert gained == _prefetched_tokens(result["prompt_tokens"]), gained


def test_every_cold_tier_series_is_exported(cold, disk_restart, replicas):
    disk_text = httpx.get(disk_restart["second_server"].url + "/metrics", timeout=10).text
    remote_text = httpx.get(replicas[0].url + "/metrics", timeout=10).text
    for name in COLD_TIER_METRIC_NAMES:
        # One write queue and one prefetch per request for all tiers: no tier label.
        if name in ("kvserve:kv_tier_write_queue_dropped_total", "kvserve:kv_tier_prefetches_total"):
            _metric_in(disk_text, name)
            _metric_in(remote_text, name)
            continue
        _metric_in(disk_text, name, tier="disk")
        _metric_in(remote_text, name, tier="remote")
    # ...and none without a tier below the host.
    plain = httpx.get(cold.server.url + "/metrics", timeout=10).text
    assert not [line for line in plain.splitlines() if line.startswith("kvserve:kv_tier_")]


def test_the_block_a_requests_last_step_filled_goes_down_while_the_server_is_idle(replicas):
    one, _, _ = replicas
    # KV is computed for prompt + max_tokens - 1 positions: 293 + 12 - 1 = 304 = 19 full blocks, the
    # 19th filled by the last decode step.
    prompt, max_tokens = [100 + (37 * i) % 5000 for i in range(293)], 12
    written = _written(one.url, "remote")
    response = httpx.post(one.url + "/v1/completions", headers={"Authorization": f"Bearer {ANON}"}, timeout=60,
                          json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_tokens
    blocks = (len(prompt) + max_tokens - 1) // BLOCK
    _wait_for(lambda: f"{blocks} blocks written (written: {_written(one.url, 'remote') - written:.0f})",
              lambda: _written(one.url, "remote") - written >= blocks, timeout=5)


def test_a_single_step_requests_blocks_survive_a_clean_restart(cold, disk_restart):
    assert disk_restart["single_step"]["status"] == 200, disk_restart["single_step"]
    assert disk_restart["first_exit"] == 0, disk_restart["first_log"]
    second = disk_restart["second_server"]
    hits = _hit_tokens(second.url, "disk")
    result = _complete(second.url, disk_restart["single_step_prompt"], max_tokens=1)
    assert cold.text(disk_restart["single_step_prompt"]).startswith(_ok(result))
    assert _hit_tokens(second.url, "disk") - hits == _prefetched_tokens(result["prompt_tokens"])


# Last: it takes the replicas' redis-server away (and brings it back, also when it fails).
def test_a_dead_redis_costs_misses_not_requests_and_the_tier_comes_back(cold, replicas):
    server, _, redis = replicas
    url = server.url
    try:
        written = _written(url, "remote")
        result = _complete(url, _prompt("before"), ANON)
        assert _ok(result) == cold.text(_prompt("before"))
        _wait_written(url, "remote", written + result["prompt_tokens"] // BLOCK)
        assert _metric(url, "kvserve:kv_tier_available", tier="remote") == 1
        assert _metric(url, "kvserve:kv_tier_errors_total", tier="remote") == 0

        redis.kill()
        written = _written(url, "remote")
        dropped = _metric(url, "kvserve:kv_tier_writes_dropped_total", tier="remote")
        for i in range(2):
            prompt = _prompt(f"outage {i}")
            result = _complete(url, prompt, ANON, timeout=60)
            assert _ok(result) == cold.text(prompt)
            assert result["seconds"] < cold.limit(prompt), (result, cold.result(prompt))
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        assert _metric(url, "kvserve:kv_tier_available", tier="remote") == 0
        assert _metric(url, "kvserve:kv_tier_errors_total", tier="remote") > 0
        assert _written(url, "remote") == written
        assert _metric(url, "kvserve:kv_tier_writes_dropped_total", tier="remote") > dropped

        redis.restart()                                   # same port, empty
        counter = iter(range(1000))

        def written_again():
            prompt = _prompt(f"after {next(counter)}")
            result = _complete(url, prompt, ANON, timeout=60)
            assert _ok(result) == cold.text(prompt)
            assert result["seconds"] < cold.limit(prompt), (result, cold.result(prompt))
            time.sleep(0.3)                               # its writes go down after it finished
            return _written(url, "remote") > written
        # The store tries the server again every ~2 s; a request or two later it is back.
        _wait_for("writes to the restarted redis", written_again, timeout=60, interval=0)
        assert _metric(url, "kvserve:kv_tier_available", tier="remote") == 1
        assert redis.client().dbsize() > 0
        log = server.log()
        assert log.count("remote KV tier at") == 1, log            # one warning for the outage
        assert "Traceback" not in log, log
    finally:
        if redis.proc is None or redis.proc.poll() is not None:
            redis.start()
