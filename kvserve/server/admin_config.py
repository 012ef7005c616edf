"""/v1/admin/config: the operator reads and changes engine settings while the server runs (admin
key only, as /v1/usage). GET answers every reconfigurable setting and the latest config events;
PATCH (or POST) takes a JSON object of the settings to change, which the engine checks as their
flags are checked at start and applies between steps, all or none (kvserve/engine/runtime_config.py;
docs/observability.md#online-reconfiguration). A refused change is a 400 naming the field, and
nothing changes; an unknown field is a 400 naming it, before the engine sees the body.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Awaitable, Callable, Optional, Union

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from kvserve.config import EVICTION_POLICIES
from kvserve.engine.client import EngineClient
from kvserve.server.errors import APIError
from kvserve.server.serving_base import call_engine

PATH = "/v1/admin/config"


class ConfigChanges(BaseModel):
    """The settings to change; those left out stay as they are, null unsets an optional one (a
    latency target, the default press). Each field is the engine flag of the same name."""
    model_config = ConfigDict(strict=True, extra="forbid")

    eviction_policy: Optional[str] = Field(None, description="the prefix cache's eviction policy",
                                           json_schema_extra={"enum": list(EVICTION_POLICIES)})
    lru_k: Optional[int] = Field(None, description="K of lru-k and fanout (1-8)")
    heat_half_life_s: Optional[float] = Field(None, description="lru-k / fanout heat half-life, seconds")
    slo_ttft: Optional[float] = Field(None, description="target time to first token, seconds (null: none)")
    slo_tpot: Optional[float] = Field(None, description="target time per output token, seconds (null: none)")
    qos_classes: Optional[dict[str, dict[str, Optional[float]]]] = Field(
        None, description="request classes' p99 targets: {class: {ttft_p99, tpot_p99}} (seconds; null unsets one)")
    kv_press: Optional[str] = Field(None, description="default press of new requests (null or 'none': no press)")
    kv_keep_ratio: Optional[float] = Field(None, description="share of the prunable KV the default press keeps")
    kv_keep_tokens: Optional[int] = Field(None, description="KV tokens the default press keeps (instead of a ratio)")
    kv_press_mode: Optional[str] = Field(None, description="drop or tier", json_schema_extra={"enum": ["drop", "tier"]})
    kv_host_memory: Optional[Union[int, str]] = Field(None, description="host KV tier size: bytes or e.g. '2GiB', "
                                                                       "up to what was allocated at start")
    max_num_batched_tokens: Optional[int] = Field(None, description="token budget of one engine step")


def _body_schema() -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": ConfigChanges.model_json_schema()}}}}


def _field_of(message: str) -> Optional[str]:
    """The field a refusal names first ("lru_k must be ...", "--kv-press 'x' is not a press",
    "qos_classes.gold.ttft_p99 must be ..."), as the body names it; None if it names none."""
    first = message.split(" ", 1)[0].rstrip(":")
    name = first.lstrip("-").replace("-", "_")
    if name.split(".", 1)[0] in ConfigChanges.model_fields and re.fullmatch(r"[\w.]+", name):
        return name
    return None


def install_admin_config(app: FastAPI, async_engine: EngineClient, authenticate_admin: Callable[..., Awaitable[None]],
                         read_body: Callable[[Request, type[BaseModel]], Awaitable[Any]]) -> None:
    """Adds GET and PATCH/POST /v1/admin/config. `authenticate_admin` is the app's admin-key check
    (401 / 403 as for /v1/usage); `read_body` its JSON body reader (415, 413, 400 naming the field)."""

    def events() -> list[dict[str, Any]]:
        return [dataclasses.asdict(event) for event in async_engine.snapshot.config_events]

    @app.get(PATH, summary="the engine settings that can change at run time, and the latest changes (admin key)")
    async def get_config(_admin: None = Depends(authenticate_admin)) -> dict[str, Any]:
        config = await call_engine(async_engine.runtime_config())
        return {"object": "engine_config", "config": config, "events": events()}

    async def change_config(request: Request, _admin: None = Depends(authenticate_admin)) -> dict[str, Any]:
        body = await read_body(request, ConfigChanges)
        try:
            reply = await call_engine(async_engine.reconfigure(body.model_dump(exclude_unset=True)))
        except ValueError as exc:
            message = str(exc) or "invalid change"
            raise APIError(400, message, param=_field_of(message), code="invalid_config") from None
        return {"object": "engine_config", "changed": reply["changed"], "config": reply["config"],
                "events": events()}

    app.add_api_route(PATH, change_config, methods=["PATCH"], openapi_extra=_body_schema(),
                      summary="change engine settings at run time, all or none (admin key)")
    app.add_api_route(PATH, change_config, methods=["POST"], openapi_extra=_body_schema(), include_in_schema=False)
