"""Test helper: a real `redis-server` (the Debian package; scripts/install_system_packages.sh installs
it in CI) on a free loopback port, in a temporary directory, without persistence.

    from redis_fixture import RedisServers     # a test module's fixture: see RedisServers

`RedisServers().start(maxmemory=..., policy=...)` starts one (stopped when the `with` ends);
`RedisServer.kill()` / `.restart()` simulate an outage (the restart keeps the port, so a client
keeps its URL); `.pause()` / `.resume()` (SIGSTOP / SIGCONT) a server that accepts connections and
never answers.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Optional

import pytest

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, directory: str, maxmemory: Optional[str] = None, policy: Optional[str] = None,
                 port: Optional[int] = None) -> None:
        self.directory = directory
        self.maxmemory = maxmemory
        self.policy = policy
        self.port = port or free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def start(self, timeout_s: float = 10.0) -> None:
        args = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.directory,
                "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
                "--logfile", os.path.join(self.directory, "redis.log")]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory]
        if self.policy:
            args += ["--maxmemory-policy", self.policy]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} at start: {self.log_tail()}")
            try:
                if self.client().ping():
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout_s} s")
            time.sleep(0.02)

    def log_tail(self) -> str:
        try:
            with open(os.path.join(self.directory, "redis.log")) as f:
                return f.read()[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """Kills it at once (SIGKILL): its clients' connections are reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        """Starts it again on the same port (empty: no persistence)."""
        self.kill()
        self.start()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)      # a paused server would ignore SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None


class RedisServers:
    """Starts redis-servers on free loopback ports, each in a temporary directory; stops them and
    removes the directories on exit. A test module's fixture:

        @pytest.fixture
        def redis_server_factory():
            with RedisServers() as servers:
                yield servers.start          # factory(maxmemory="1mb", policy="allkeys-lru")
    """

    def __init__(self) -> None:
        if not os.path.exists(REDIS_SERVER):
            pytest.skip("redis-server is not installed (bash scripts/install_system_packages.sh)")
        self.servers: list[RedisServer] = []
        self.directories: list[str] = []

    def start(self, maxmemory: Optional[str] = None, policy: Optional[str] = None) -> RedisServer:
        directory = tempfile.mkdtemp(prefix="kvserve-redis-")
        self.directories.append(directory)
        server = RedisServer(directory, maxmemory=maxmemory, policy=policy)
        self.servers.append(server)
        return server

    def __enter__(self) -> "RedisServers":
        return self

    def __exit__(self, *exc_info) -> None:
        for server in self.servers:
            server.stop()
        for directory in self.directories:
            shutil.rmtree(directory, ignore_errors=True)
