"""The live KV map (docs/observability.md#the-live-kv-map): GET /dashboard, a static page (plain
HTML, CSS and JS from kvserve/server/static/, no data in it), and GET /dashboard/events, the admin
key's stream of server-sent events it draws from.

Each event is one JSON object: the engine's KV map (Engine.make_kv_map, made on the engine thread
between steps and only when asked: KVMapSnapshot.as_dict) and the gauges of the EngineSnapshot the
page needs (hit rates by tier, eviction and load totals, config events, bandwidth). The page turns
successive totals into rates.

Cost to the engine: every open page shares one feed (`KVMapFeed`), which asks the engine for a map
no more often than the fastest page wants, nor so often that making maps would take more than
ENGINE_SHARE of the engine thread's time (each map says what it cost: a big pool's refresh slows
down), and asks for the prefix trees, the costlier part on a big cache, only every
TREES_INTERVAL_S. An event whose content did not change since the stream's last is not sent (a
comment line keeps the connection alive instead).

A stream ends when its client goes, when the engine stops, or after STREAM_LIFETIME_S, when the
page opens the next: uvicorn gives open responses the whole --shutdown-timeout before it stops a
server, and no ASGI event tells an endless stream that a shutdown began, so a stream that ended on
its own is what keeps an open page from holding a shutdown up for longer than that.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from importlib import resources
from typing import Any, Awaitable, Callable, Optional

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import Response, StreamingResponse

from kvserve.engine.client import EngineClient, EngineDeadError, EngineShutdownError, EngineSnapshot
from kvserve.server.errors import APIError

logger = logging.getLogger("kvserve.server")

DEFAULT_HZ, MIN_HZ, MAX_HZ = 2.0, 0.2, 5.0      # events a second a page may ask for
DEFAULT_CELLS, MIN_CELLS, MAX_CELLS = 4096, 64, 16384   # grid cells per tier (payload bound)
MAX_TREES, MAX_TREE_NODES = 8, 32               # prefix trees per event, segments per tree
ENGINE_SHARE = 0.02              # of the engine thread's time, at most this goes to making maps
TREES_INTERVAL_S = 2.0           # prefix trees are asked for at most this often
STREAM_LIFETIME_S = 5.0          # a stream ends after this; the page opens the next at once
KEEPALIVE_S = 5.0                # an unchanged stream sends a comment line this often

# The page's files, each with its type: only these are served (no path from the URL reaches the disk).
STATIC_FILES = {"dashboard.html": "text/html; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
                "dashboard.css": "text/css; charset=utf-8"}
# The page loads only its own script and style, talks only to this server, and may not be framed.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def static_file(name: str) -> bytes:
    return resources.files("kvserve.server").joinpath("static", name).read_bytes()


class KVMapFeed:
    """The KV maps every open page shares: one request to the engine at a time, and none while the
    last map is fresh enough (younger than the reader's interval, or than ENGINE_SHARE allows for
    what it cost). Prefix trees come with a map every TREES_INTERVAL_S; maps in between carry None."""

    def __init__(self, kv_map: Callable[..., Awaitable[dict[str, Any]]]) -> None:
        self._kv_map = kv_map
        self._lock = asyncio.Lock()
        self._latest: Optional[dict[str, Any]] = None
        self._latest_cells = 0
        self._made_at = float("-inf")        # time.monotonic() when the latest map came
        self._trees_at = float("-inf")
        self.trees: Optional[list] = None     # the latest prefix trees (a new list each time they come)
        self.num_trees = 0                    # and how many trees the cache had then

    def pause_after(self, kv_map: dict[str, Any]) -> float:
        """The least time between maps for the engine to spend under ENGINE_SHARE on them."""
        return float(kv_map.get("build_seconds") or 0.0) / ENGINE_SHARE

    async def get(self, max_age_s: float, cells: int) -> dict[str, Any]:
        async with self._lock:
            latest, now = self._latest, time.monotonic()
            if latest is not None and self._latest_cells == cells and (
                    now - self._made_at < max(max_age_s, self.pause_after(latest))):
                return latest
            with_trees = now - self._trees_at >= TREES_INTERVAL_S
            kv_map = await self._kv_map(max_cells=cells, max_trees=MAX_TREES if with_trees else 0,
                                        max_tree_nodes=MAX_TREE_NODES)
            self._made_at = time.monotonic()
            if with_trees:
                self._trees_at, self.trees, self.num_trees = self._made_at, kv_map["prefix_trees"], \
                    kv_map["num_prefix_trees"]
            self._latest, self._latest_cells = kv_map, cells
            return kv_map


def engine_gauges(snapshot: EngineSnapshot) -> dict[str, Any]:
    """The EngineSnapshot fields the page shows, as JSON-ready data (totals: the page makes rates)."""
    def plain(value: Any) -> Any:
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    prefix = snapshot.prefix_cache
    transfers = snapshot.kv_transfers
    return {
        "num_running": snapshot.num_running, "num_waiting": snapshot.num_waiting,
        "num_blocks": snapshot.num_blocks, "num_free_blocks": snapshot.num_free_blocks,
        "kv_usage": snapshot.kv_usage, "capacity_tokens": snapshot.capacity_tokens,
        "prompt_tokens_total": snapshot.prompt_tokens_total,
        "generation_tokens_total": snapshot.generation_tokens_total,
        "num_preemptions_total": snapshot.num_preemptions_total, "num_steps_total": snapshot.num_steps_total,
        "requests_finished_total": dict(snapshot.requests_finished_total),
        "prefix_cache": None if prefix is None else {**plain(prefix), "hit_rate": prefix.hit_rate},
        "kv_host": plain(snapshot.kv_host),
        "kv_transfers": None if transfers is None else {
            "bytes_to_device": transfers.bytes_to_device, "bytes_to_host": transfers.bytes_to_host,
            "loads": transfers.loads, "load_seconds": transfers.load_seconds,
            "copy_failures": transfers.copy_failures},
        "kv_cold": [plain(store) for store in snapshot.kv_cold],
        "kv_cold_hit_tokens": dict(snapshot.kv_cold_hit_tokens),
        # Tenant None (requests without one) cannot be a JSON key: pairs instead.
        "kv_blocks_by_tenant": [[tenant, blocks] for tenant, blocks in snapshot.kv_blocks_by_tenant.items()],
        "kv_quotas": {tenant: list(pair) for tenant, pair in snapshot.kv_quotas.items()},
        "qos_classes": [plain(c) for c in snapshot.qos_classes],
        "presses": [plain(p) for p in snapshot.presses],
        "bandwidth": None if snapshot.bandwidth is None else {
            key: value for key, value in plain(snapshot.bandwidth).items() if key != "utilization_buckets"},
        "config_events": [plain(e) for e in snapshot.config_events],
    }


def _unchanged_key(event: dict[str, Any]) -> str:
    """The event without what changes every time (its times) and its trees (sent when new):
    equal keys, nothing to draw anew."""
    kv_map = {key: value for key, value in event["kv_map"].items()
              if key not in ("time", "monotonic_time", "build_seconds", "prefix_trees")}
    return json.dumps([kv_map, event["engine"], event["interval_s"]], sort_keys=True, default=str)


def install_dashboard(app: FastAPI, async_engine: EngineClient, authenticate_admin: Callable[..., Any],
                      model_name: str) -> None:
    """GET /dashboard (the page, public: it holds no data and asks for the admin key),
    GET /dashboard/static/NAME (its script and style), GET /dashboard/events (admin key)."""
    feed = KVMapFeed(async_engine.kv_map)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return Response(static_file("dashboard.html"), media_type=STATIC_FILES["dashboard.html"],
                        headers=PAGE_HEADERS)

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_static(name: str) -> Response:
        if name not in STATIC_FILES or name == "dashboard.html":
            raise APIError(404, "no such dashboard file", code="not_found")
        return Response(static_file(name), media_type=STATIC_FILES[name], headers=PAGE_HEADERS)

    @app.get("/dashboard/events", summary="the live KV map as server-sent events (admin key; the /dashboard page)")
    async def dashboard_events(request: Request, _admin: None = Depends(authenticate_admin),
                               hz: float = Query(DEFAULT_HZ, ge=MIN_HZ, le=MAX_HZ,
                                                 description="events a second"),
                               cells: int = Query(DEFAULT_CELLS, ge=MIN_CELLS, le=MAX_CELLS,
                                                  description="grid cells per tier: more blocks fold into cells")
                               ) -> StreamingResponse:
        return StreamingResponse(_events(request, async_engine, feed, model_name, 1.0 / hz, cells),
                                 media_type="text/event-stream", headers=SSE_HEADERS)


async def _events(request: Request, async_engine: EngineClient, feed: KVMapFeed, model_name: str,
                  interval_s: float, cells: int):
    started = last_sent = time.monotonic()
    last_key: Optional[str] = None
    seq = 0
    sent_trees: Optional[list] = None       # the page keeps the trees it has: sent again only when new
    while async_engine.is_running and time.monotonic() - started < STREAM_LIFETIME_S:
        tick = time.monotonic()
        try:
            # A little younger than the interval: the map a tick ago is too old for this tick.
            kv_map = await feed.get(0.8 * interval_s, cells)
        except (EngineShutdownError, EngineDeadError):
            return
        except Exception:
            logger.exception("dashboard: could not make the KV map")
            return
        trees = feed.trees if feed.trees is not sent_trees else None
        # `monotonic_time`: when the gauges were read (the page's rates divide by its steps).
        event = {"model": model_name, "interval_s": max(interval_s, feed.pause_after(kv_map)),
                 "monotonic_time": time.monotonic(),
                 "kv_map": {**kv_map, "prefix_trees": trees, "num_prefix_trees": feed.num_trees}, "engine": engine_gauges(async_engine.snapshot)}
        key = _unchanged_key(event)
        if key != last_key or trees is not None:
            seq += 1
            event["seq"] = seq
            yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
            last_key, last_sent = key, time.monotonic()
            if trees is not None:
                sent_trees = trees
        elif time.monotonic() - last_sent >= KEEPALIVE_S:
            yield ": unchanged\n\n"
            last_sent = time.monotonic()
        if await request.is_disconnected():
            return
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - tick)))
    yield "event: end\ndata: {}\n\n"
