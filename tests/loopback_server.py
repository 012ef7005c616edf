"""Test helpers for the HTTP server: a tiny random Llama with the default model's real tokenizer and
chat template (every endpoint does its full work in milliseconds), and uvicorn in a thread on a
free loopback port around a given engine."""

from __future__ import annotations

import socket
import threading
import time


def build_tiny_chat_model(folder, max_position_embeddings: int) -> str:
    """A 2-layer random Llama saved with the default model's tokenizer; returns the folder."""
    import torch
    import transformers

    from kvserve.model.loader import resolve_model
    tokenizer = resolve_model(None).load_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


# On the GPU machine the product's default host tier pins up to 32 GiB per engine (seconds to pin,
# and several servers start at once under pytest-xdist); the suite's servers bound it, as conftest.py
# bounds its in-process engines. A test that sets kv_host_memory keeps its own value.
CUDA_TEST_HOST_TIER_BYTES = 1 << 30


def _on_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


class LoopbackServer:
    """uvicorn in a thread on a free loopback port under the model name "tiny", serving either
    `engine` (an Engine on an AsyncEngine thread of this process) or, given `engine_options`, an
    engine core process built from them (the path `kvserve serve` takes; stopped with the server)."""

    def __init__(self, engine=None, *, engine_options=None, **server_options) -> None:
        import os
        import tempfile

        import uvicorn

        from kvserve.engine.async_engine import AsyncEngine
        from kvserve.server.app import build_app
        from kvserve.server.config import ServerConfig

        self.engine = engine
        self.core = None
        config = ServerConfig(**server_options)
        if engine_options is not None:
            if _on_cuda():
                engine_options = {"kv_host_memory": CUDA_TEST_HOST_TIER_BYTES, **engine_options}
            from kvserve.engine.core_client import CoreClient
            from kvserve.model.loader import resolve_model
            from kvserve.server.launcher import start_engine_core
            self._run_dir = tempfile.TemporaryDirectory(prefix="kvserve-test-")
            address = f"ipc://{os.path.join(self._run_dir.name, 'core.sock')}"
            self.core, served = start_engine_core(engine_options, address, "warning", config.shutdown_timeout)
            tokenizer = resolve_model(served.model, served.load_format).load_tokenizer()
            client = CoreClient(address, self.core.pid, served, tokenizer)
        else:
            client = AsyncEngine(engine)
        self.app = build_app(client, config, model_names=list(config.served_model_name or ["tiny"]))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level="error",
                                                     timeout_graceful_shutdown=config.shutdown_timeout))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    @property
    def snapshot(self):
        return self.app.state.async_engine.snapshot

    def stop(self, timeout: float = 30) -> float:
        started = time.monotonic()
        self.uvicorn.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not shut down"
        self.sock.close()
        if self.core is not None:
            from kvserve.server.launcher import stop_process
            assert stop_process(self.core, timeout) == 0, "the engine core did not stop cleanly"
            self._run_dir.cleanup()
        return time.monotonic() - started


class ServeProcess:
    """`kvserve serve` as a real child process (launcher, engine core process, front ends) on a
    free loopback port; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(self, serve_args: list[str], log_path, startup_timeout: float = 180,
                 log_level: str = "warning") -> None:
        import os
        import subprocess
        import sys

        import httpx
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if _on_cuda() and not any(arg.startswith("--kv-host-memory") for arg in serve_args):
            serve_args = [*serve_args, "--kv-host-memory", str(CUDA_TEST_HOST_TIER_BYTES)]
        self.process = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "--log-level", log_level, "serve",
                                         "--port", str(self.port),
                                         *serve_args], stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + startup_timeout
        while True:
            assert self.process.poll() is None, f"server exited at start:\n{self.log()}"
            assert time.monotonic() < deadline, f"server did not start:\n{self.log()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    @property
    def core_pid(self) -> int:
        import re
        return int(re.search(r"engine core pid (\d+)", self.log()).group(1))

    def tree(self) -> set[int]:
        """The pids of the launcher and everything below it that is still alive."""
        return process_tree(self.process.pid)

    def stop(self, sig=None, timeout: float = 60) -> int:
        import signal
        if self.process.poll() is None:
            self.process.send_signal(sig or signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            for pid in self.tree():
                try:
                    import os
                    import signal
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.process.wait(10)
        self._log.close()


def process_tree(root: int) -> set[int]:
    """`root` and its live descendants (zombies included: not yet reaped is not gone), from /proc."""
    import os
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if os.path.exists(f"/proc/{pid}"):
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def wait_gone(pids: set[int], timeout: float = 10.0) -> dict[int, str]:
    """Those of `pids` still running after up to `timeout` s, with their command lines
    (multiprocessing's resource tracker ends a moment after the launcher that started it)."""
    import os

    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    deadline = time.monotonic() + timeout
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {}
    for pid in pids:
        if running(pid):
            try:
                with open(f"/proc/{pid}/cmdline") as f:
                    left[pid] = f.read().replace("\0", " ")[:200]
            except OSError:
                pass
    return left
