"""ServerConfig: every option of the HTTP server, one field each; the `serve` flags come from here.

Engine options stay in kvserve/config.py; `kvserve serve` takes both sets of flags. As there, a
field `max_request_bytes` is the flag `--max-request-bytes`, so a new option is added here only.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
from dataclasses import dataclass
from typing import Optional

from kvserve import envs
from kvserve.config import _opt, add_dataclass_args, check_fields
from kvserve.server.reasoning import PARSERS as REASONING_PARSERS
from kvserve.server.tool_parsers import TOOL_CALL_PARSERS


@dataclass
class ServerConfig:
    host: str = _opt("127.0.0.1", "address to listen on (0.0.0.0 for every interface)")
    port: int = _opt(8000, "TCP port to listen on")
    served_model_name: Optional[list[str]] = _opt(
        None, "model name(s) clients send and /v1/models lists, the first in responses and metrics (default: "
              "derived from --model)", nargs="+")
    chat_template: Optional[str] = _opt(None, "a Jinja chat template (a file, or the template itself) used instead "
                                              "of the tokenizer's")
    api_key: Optional[str] = _opt(None, "require `Authorization: Bearer KEY` on /v1 endpoints "
                                        "(also read from $KVSERVE_API_KEY)")
    api_keys_file: Optional[str] = _opt(None, "JSON object mapping API key -> tenant name (or null); any listed "
                                              "key is accepted and sets the request's tenant")
    admin_api_key: Optional[str] = _opt(None, "the operator's key: `Authorization: Bearer KEY` opens GET /v1/usage "
                                              "(per-tenant usage), /v1/admin/config (engine settings changed at "
                                              "run time) and /dashboard/events (the live KV map) and nothing else; must differ from every API key "
                                              "(also read from $KVSERVE_ADMIN_API_KEY)")
    trust_request_tenant: bool = _opt(False, "honour the request's `tenant` field for keys without a tenant: only "
                                             "behind a gateway that authenticates users and sets it")
    allowed_hosts: Optional[str] = _opt(None, "comma-separated names the Host header may carry (DNS-rebinding "
                                              "defence); default: loopback names if --host is loopback, else any; "
                                              "'*': any")
    max_request_bytes: int = _opt(4 << 20, "largest request body accepted (e.g. 4MiB); larger ones get 413 "
                                           "before anything is parsed", bytes=True)
    max_n: int = _opt(16, "largest n (samples per prompt) a request may ask for")
    max_prompts_per_request: int = _opt(256, "most prompts one /v1/completions request may carry")
    max_logprobs: int = _opt(20, "largest logprobs / top_logprobs a request may ask for")
    shutdown_timeout: float = _opt(30.0, "seconds in-flight requests get to finish on shutdown before "
                                         "they are aborted with an error")
    access_log: bool = _opt(False, "log every HTTP request (uvicorn access log)")
    generation_config: str = _opt("auto", "auto: sampling fields a request leaves unset take the model's "
                                          "generation_config.json defaults (temperature, top_p, top_k, min_p, "
                                          "repetition_penalty, max_new_tokens), as vLLM does; none: kvserve's own "
                                          "defaults (temperature 1, top_p 1); vllm: the same as none (vLLM's "
                                          "name for its own defaults)", choices=("auto", "none", "vllm"))
    reasoning_parser: Optional[str] = _opt(None, "split chat replies' <think>...</think> into message.reasoning_content "
                                                 "(also in stream deltas): deepseek_r1 (output starts inside the "
                                                 "think) or qwen3 (only when it opens one); default off",
                                           choices=REASONING_PARSERS)
    tool_call_parser: Optional[str] = _opt(None, "read tool calls out of chat replies (tool_choice auto) in the "
                                                 "format the model's template uses: hermes (Qwen2.5/3, "
                                                 "R1-Distill-Qwen), llama3_json (Llama 3.1/3.2), deepseek_v3 "
                                                 "(DeepSeek-V3/R1); needs --enable-auto-tool-choice",
                                           choices=TOOL_CALL_PARSERS)
    otlp_traces_endpoint: Optional[str] = _opt(None, "send a trace of every request, with a span per phase (queued, "
                                                     "tier loads, prefill chunks, decode, preemption, stream end), "
                                                     "to this OTLP/HTTP collector (e.g. http://127.0.0.1:4318; "
                                                     "/v1/traces is added to a URL without a path); a request's "
                                                     "W3C traceparent makes it a child of the caller's span")
    enable_auto_tool_choice: bool = _opt(False, "let requests with tools use tool_choice auto (the default), "
                                                "read by --tool-call-parser; without it only required and named "
                                                "tool choices are served")
    api_server_count: int = _opt(1, "HTTP front-end processes on the one port (SO_REUSEPORT), all talking to "
                                    "the one engine core process")
    vllm_metric_aliases: bool = _opt(False, "/metrics also shows the series that mean the same as vLLM's under "
                                            "their vllm: names (same values and labels), so dashboards and alerts "
                                            "written for vLLM work (docs/observability.md)")

    def validate(self) -> None:
        check_fields(self)          # the fields' choices (generation_config, reasoning_parser, tool_call_parser)
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (hermes, llama3_json or deepseek_v3)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_request_bytes", "max_n", "max_prompts_per_request", "api_server_count"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs must be in [0, 20] (the sampler's limit), got {self.max_logprobs}")
        if isinstance(self.served_model_name, str):         # ServerConfig(served_model_name="m") in Python
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and not all(name.strip() for name in self.served_model_name):
            raise ValueError(f"served_model_name must be non-empty names, got {self.served_model_name!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.otlp_traces_endpoint is not None:
            from kvserve.obs.tracing import traces_url
            traces_url(self.otlp_traces_endpoint)           # a clear error for what is not an http(s) URL
        if self.allowed_hosts is not None and not _host_list(self.allowed_hosts):
            raise ValueError(f"allowed_hosts must name at least one host (or '*'), got {self.allowed_hosts!r}")

    def allowed_host_names(self) -> Optional[frozenset[str]]:
        """Host header names served (lowercase, no port); None: any. A server on a loopback address
        answers only to loopback names by default: a web page that rebinds its own DNS name to
        127.0.0.1 is same-origin with the server, so CORS and Content-Type checks do not stop it,
        but its requests still carry its name in Host."""
        if self.allowed_hosts is not None:
            names = _host_list(self.allowed_hosts)
            return None if "*" in names else names
        return _LOOPBACK_NAMES if _is_loopback(self.host) else None

    def load_api_keys(self) -> dict[str, Optional[str]]:
        """API key -> tenant (None for --api-key). Empty: no authentication."""
        keys: dict[str, Optional[str]] = {}
        if self.api_keys_file:
            try:
                with open(self.api_keys_file, encoding="utf-8") as f:
                    mapping = json.load(f)
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read --api-keys-file {self.api_keys_file!r}: {exc}") from None
            # A tenant "" would be the anonymous namespace that --api-key and keyless requests share.
            if not isinstance(mapping, dict) or not all(
                    isinstance(k, str) and k and (v is None or (isinstance(v, str) and v)) for k, v in mapping.items()):
                raise ValueError(f"--api-keys-file {self.api_keys_file!r} must be a JSON object of "
                                 "non-empty key strings to non-empty tenant strings (or null for no tenant)")
            keys.update(mapping)
        api_key = self.api_key or envs.KVSERVE_API_KEY.get()
        if api_key:
            keys[api_key] = keys.get(api_key)
        return keys

    def load_admin_key(self, api_keys: dict[str, Optional[str]]) -> Optional[str]:
        """The admin key (None: no admin endpoints). One that is also an API key would make that
        key's holders operators, so it is refused."""
        admin_key = self.admin_api_key or envs.KVSERVE_ADMIN_API_KEY.get() or None
        if admin_key is not None and admin_key in api_keys:
            raise ValueError("admin_api_key must differ from --api-key and from every key of --api-keys-file: "
                             "a tenant's key would open the operator's endpoints")
        return admin_key


_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _host_list(text: str) -> frozenset[str]:
    return frozenset(name.strip().lower() for name in text.split(",") if name.strip())


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Adds one `--flag-name` per ServerConfig field."""
    add_dataclass_args(parser.add_argument_group("server"), ServerConfig)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    config = ServerConfig(**{k: v for k, v in vars(args).items() if k in names})
    config.validate()
    return config
