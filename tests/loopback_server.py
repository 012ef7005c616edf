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


class LoopbackServer:
    """uvicorn in a thread on a free loopback port, serving `engine` under the model name "tiny"."""

    def __init__(self, engine, **server_options) -> None:
        import uvicorn

        from kvserve.engine.async_engine import AsyncEngine
        from kvserve.server.app import build_app
        from kvserve.server.config import ServerConfig

        self.engine = engine
        config = ServerConfig(**server_options)
        self.app = build_app(AsyncEngine(engine), config, model_names=["tiny"])
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
        return time.monotonic() - started
