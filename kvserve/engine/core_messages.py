"""The messages between the engine core process and its front ends (docs/server.md#messages).

msgpack through msgspec: typed structs, no pickle, a few microseconds per step's message. Each
direction is one tagged union, so a reader decodes any message with one Decoder.

Front end -> core: Hello once, then AddRequest / Abort / FinishSample / Utility.
Core -> front end: AddResult per AddRequest, one Step per engine step that produced tokens for
this front end (every request's new tokens together), Snapshot a few times a second and after
every change of an idle engine, UtilityResult per Utility. (The served model's facts travel once,
at start, through the launcher: kvserve/server/launcher.py.)
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from kvserve.engine.client import EngineSnapshot
from kvserve.sampling_params import SamplingParams


class Hello(msgspec.Struct, tag=True):
    """A front end's first message: its pid, so the core can end its requests if it dies."""
    pid: int


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float                      # time.monotonic(): CLOCK_MONOTONIC is one clock for every process
    tenant: Optional[str] = None
    cache_salt: Optional[str] = None
    pin_ttl: Optional[float] = None
    pin_prefix_tokens: Optional[int] = None
    priority: int = 0
    trace: bool = False                      # record its phases: they come back with its last delta


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class FinishSample(msgspec.Struct, tag=True):
    """The front end found a stop string in sample `index`'s text: end it and free its blocks."""
    request_id: str
    index: int
    stop_reason: str


class Utility(msgspec.Struct, tag=True):
    """A call answered between steps (pins); `method` names an EngineCore utility."""
    call_id: int
    method: str
    args: dict[str, Any]


ToCore = Union[Hello, AddRequest, Abort, FinishSample, Utility]


class AddResult(msgspec.Struct, tag=True):
    """error_kind None: admitted. Else the class of what Engine.add_request raised (rejected,
    overloaded, invalid, shutting_down) and its message, raised again on the front end."""
    request_id: str
    error_kind: Optional[str] = None
    message: str = ""


class SampleDelta(msgspec.Struct, array_like=True):
    index: int
    token_ids: list[int]                                 # new since the last Step
    logprobs: Optional[list[dict[int, float]]] = None    # one per new token, with logprobs on
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    samples: list[SampleDelta]
    finished: bool
    # time.monotonic() stamps: arrival, first scheduled, first token, finished; preemptions.
    times: tuple[float, Optional[float], Optional[float], Optional[float], int]
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None   # once, in the first delta
    # The request was aborted in the core: "step_failed" (a step raised with it in the batch) or
    # "shutting_down" (the drain timeout ran out); `error` says so in words.
    error_kind: Optional[str] = None
    error: str = ""
    num_cached_tokens: Optional[int] = None     # RequestOutput.num_cached_tokens, once admitted
    # A traced request's phases (RequestOutput.phases: name, start, end or None, attributes), once,
    # with its last delta.
    phases: Optional[list[tuple[str, float, Optional[float], dict[str, Union[str, int, float, bool]]]]] = None


class Step(msgspec.Struct, tag=True):
    outputs: list[RequestDelta]


class Snapshot(msgspec.Struct, tag=True):
    snapshot: EngineSnapshot


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: Any = None
    error_kind: Optional[str] = None
    message: str = ""


FromCore = Union[AddResult, Step, Snapshot, UtilityResult]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder_to_core() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToCore)


def decoder_from_core() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromCore)
