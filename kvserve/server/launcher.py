"""`kvserve serve`: the process picture (docs/server.md#processes).

    launcher (this process) ── spawns ──> engine core (kvserve/engine/core_process.py)
        │                                      ^  ZMQ ROUTER at ipc://<run dir>/engine-core.sock
        └─ is front end 0 (--api-server-count 1), or spawns N front ends (HTTP on one port,
           SO_REUSEPORT), each a CoreClient (DEALER) + the FastAPI app + uvicorn.

The engine is built first, in its process, so a bad model or flag fails before any port opens
(exit 1 with the reason). Every process watches the one above it through a pidfd: the core and
the front ends exit if the launcher dies, so nothing is left behind holding the GPU or the port.

Exit codes: 0 after SIGTERM / SIGINT (front ends drain for --shutdown-timeout, then the core
drains what is left, then everything exits); 1 when the engine core died (in-flight requests got
`engine_dead` errors first) or it could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_processes
from typing import Any, Optional

import uvicorn

from kvserve import envs

logger = logging.getLogger("kvserve.server")

# After the core dies, how long the front end keeps running so open streams get their error event
# and /health can be seen failing, before the server exits.
CORE_DEATH_GRACE_S = 2.0
# How long the launcher waits for a process beyond its own drain time before killing it.
STOP_MARGIN_S = 10.0


@dataclass(frozen=True)
class FrontEndSpec:
    """What a front-end process needs (picklable: it crosses a spawn)."""
    config: Any                   # ServerConfig
    served: Any                   # ServedModel
    address: str
    core_pid: int
    launcher_pid: int
    log_level: str
    reuse_port: bool
    metrics_dir: Optional[str] = None


def _context() -> multiprocessing.context.SpawnContext:
    # spawn, not fork: the launcher may hold threads (tokenizers) and the core a CUDA context.
    return multiprocessing.get_context("spawn")


def start_engine_core(engine_options: dict[str, Any], address: str, log_level: str,
                      drain_timeout: float) -> tuple[multiprocessing.process.BaseProcess, Any]:
    """Starts the core process and waits until its engine is built. Returns (process, ServedModel);
    raises RuntimeError with the core's reason when it cannot start."""
    import msgspec

    from kvserve.engine.client import ServedModel
    from kvserve.engine.core_process import run_engine_core
    context = _context()
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=run_engine_core, name="kvserve-engine-core",
                              args=(engine_options, address, os.getpid(), writer, log_level, drain_timeout))
    process.start()
    writer.close()                 # the core holds the only writer: its death ends the wait below
    try:
        kind, payload = reader.recv()
    except EOFError:
        process.join(5)
        raise RuntimeError(f"the engine core exited during startup (exit code {process.exitcode})") from None
    finally:
        reader.close()
    if kind != "ready":
        process.join(5)
        raise RuntimeError(payload)
    return process, msgspec.msgpack.decode(payload, type=ServedModel)


def stop_process(process: multiprocessing.process.BaseProcess, timeout: float) -> Optional[int]:
    """SIGTERM, then SIGKILL after `timeout` s; returns the exit code."""
    if process.is_alive():
        process.terminate()
        process.join(timeout)
    if process.is_alive():
        logger.error("%s did not stop within %.0f s; killing it", process.name, timeout)
        process.kill()
        process.join(5)
    return process.exitcode


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def serve_front_end(spec: FrontEndSpec, sock: Optional[socket.socket] = None) -> int:
    """One HTTP front end until it is stopped: 0 after a signal, 1 if the engine core died."""
    from kvserve.engine.core_client import CoreClient
    from kvserve.model.loader import resolve_model
    from kvserve.server.app import build_app
    served, config = spec.served, spec.config
    tokenizer = resolve_model(served.model, served.load_format).load_tokenizer()
    state = {"core_dead": False}
    server: Optional[_FrontEndServer] = None

    def on_core_dead() -> None:
        state["core_dead"] = True
        asyncio.get_running_loop().call_later(CORE_DEATH_GRACE_S, stop_serving)

    def stop_serving() -> None:
        if server is not None:
            server.should_exit = True

    client = CoreClient(spec.address, spec.core_pid, served, tokenizer, on_core_dead=on_core_dead)
    app = build_app(client, config, metrics_dir=spec.metrics_dir)
    sock = sock or listening_socket(config.host, config.port, spec.reuse_port)
    server = _FrontEndServer(uvicorn.Config(app, log_level=spec.log_level, access_log=config.access_log,
                                            timeout_graceful_shutdown=config.shutdown_timeout,
                                            timeout_keep_alive=30), spec.launcher_pid)
    # uvicorn hands a caught SIGTERM back to the handler it found once it has shut down; this one
    # lets the process go on to its own cleanup instead of dying there.
    stopped_by: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stopped_by.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    return 1 if state["core_dead"] else 0


class _FrontEndServer(uvicorn.Server):
    """uvicorn.Server that also stops when the launcher process exits (watched through a pidfd)."""

    def __init__(self, config: uvicorn.Config, launcher_pid: int) -> None:
        super().__init__(config)
        self.launcher_pid = launcher_pid

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.launcher_pid == os.getpid():
            return
        try:
            fd = os.pidfd_open(self.launcher_pid)
        except OSError:
            self.should_exit = True          # already gone
            return
        asyncio.get_running_loop().add_reader(fd, self._launcher_gone)

    def _launcher_gone(self) -> None:
        logger.error("front end: the launcher exited; stopping")
        self.should_exit = True


def _front_end_main(spec: FrontEndSpec) -> None:
    """Entry of a spawned front-end process."""
    logging.basicConfig(level=spec.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    raise SystemExit(serve_front_end(spec))


def run_server(args: argparse.Namespace) -> int:
    """`kvserve serve`: the engine core process, then the front end(s); returns the exit code."""
    from kvserve.config import engine_options_from_args
    from kvserve.server.app import default_model_name
    from kvserve.server.config import server_config_from_args

    config = server_config_from_args(args)
    config.validate()
    # A bad keys file, or an admin key that is also an API key, is an error before the model loads.
    config.load_admin_key(config.load_api_keys())
    engine_options = engine_options_from_args(args)
    log_level = args.log_level      # the global --log-level (kvserve/cli.py) sets uvicorn's too
    with tempfile.TemporaryDirectory(prefix="kvserve-") as run_dir:
        address = f"ipc://{os.path.join(run_dir, 'engine-core.sock')}"
        try:
            core, served = start_engine_core(engine_options, address, log_level, config.shutdown_timeout)
        except RuntimeError as exc:
            print(f"kvserve serve: the engine could not start: {exc}", flush=True)
            return 1
        try:
            name = (", ".join(config.served_model_name) if config.served_model_name
                    else default_model_name(served.model, served.source_path))
            many = config.api_server_count > 1
            spec = FrontEndSpec(config, served, address, core.pid, os.getpid(), log_level, reuse_port=many)
            try:
                sock = listening_socket(config.host, config.port, reuse_port=many)
            except OSError as exc:
                print(f"kvserve serve: cannot listen on {config.host}:{config.port}: {exc.strerror}", flush=True)
                return 1
            print(f"kvserve: serving {name} on http://{config.host}:{config.port} "
                  f"(KV cache {served.capacity_tokens} tokens, max_model_len {served.max_model_len}, "
                  f"engine core pid {core.pid}, {config.api_server_count} front end"
                  f"{'s' if many else ''})", flush=True)
            if not many:
                code = serve_front_end(spec, sock)
            else:
                code = _supervise_front_ends(spec, sock, core, run_dir)
        finally:
            core_code = stop_process(core, config.shutdown_timeout + STOP_MARGIN_S)
        if code == 0 and core_code not in (0, None):
            logger.error("the engine core exited with code %s", core_code)
            code = 1
        return code


def _supervise_front_ends(spec: FrontEndSpec, sock: socket.socket, core: Any, run_dir: str) -> int:
    """Runs config.api_server_count front-end processes on one port until a signal (0) or the
    core's death (1). A front end that dies alone is logged; the others keep serving."""
    metrics_dir = os.path.join(run_dir, "metrics")
    os.makedirs(metrics_dir)
    # Set before the front ends import prometheus_client: it picks multiprocess mode at import.
    envs.PROMETHEUS_MULTIPROC_DIR.set(metrics_dir)
    spec = FrontEndSpec(**{**spec.__dict__, "metrics_dir": metrics_dir})
    context = _context()
    front_ends = [context.Process(target=_front_end_main, args=(spec,), name=f"kvserve-front-end-{i}")
                  for i in range(spec.config.api_server_count)]
    sock.close()   # held only to fail fast on a taken port; each front end binds its own (SO_REUSEPORT)
    for process in front_ends:
        process.start()
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        alive = list(front_ends)
        while alive and not stop:
            ready = wait_for_processes([p.sentinel for p in alive] + [core.sentinel], timeout=0.5)
            if core.sentinel in ready:
                logger.error("the engine core exited (code %s); the front ends are stopping", core.exitcode)
                code = 1
                break
            for process in [p for p in alive if p.sentinel in ready]:
                logger.error("%s exited (code %s); the other front ends keep serving", process.name,
                             process.exitcode)
                alive.remove(process)
        if not alive:
            code = 1
        deadline = time.monotonic() + spec.config.shutdown_timeout + STOP_MARGIN_S
        for process in front_ends:
            if process.is_alive() and code == 0:
                process.terminate()
        for process in front_ends:
            process.join(max(0.0, deadline - time.monotonic()))
            stop_process(process, 1.0)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
