"""KV reservations per request class (`kv_reservation_blocks` / `kv_reservation_fraction`; kvserve/sched/
kv_reservations.py): an idle class lends its reserved blocks; once it has waiting work it takes them
back by preempting the borrowers, whatever their priority, and their outputs come out unchanged.
Reservations past the pool, or both fields, are refused at start."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import TEST_DEVICE, build_tiny_checkpoint, outputs_alone
from kvserve import SamplingParams
from kvserve.engine.engine import Engine
from kvserve.sched.qos_config import load_qos_config

BLOCK = 16
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-reservation-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


def _qos(tmp_path, reserved: dict) -> str:
    # "batch" runs below "interactive" in priority: only its reservation can get it blocks early.
    body = {"classes": {"interactive": {"priority": 0, "ttft_p99": 600},
                        "batch": {"priority": 1, "ttft_p99": 600, **reserved}}}
    path = tmp_path / "qos.json"
    path.write_text(json.dumps(body))
    return str(path)


def _prompt(seed: int) -> list[int]:
    return [1] + [3 + (seed * 29 + 7 * i) % 240 for i in range(2 * BLOCK - 1)]   # 2 blocks, 4 with its outputs


def _engine(folder: str, **options) -> Engine:
    base = dict(model=folder, dtype="float32", device=TEST_DEVICE, max_model_len=256, block_size=BLOCK,
                async_scheduling="off", enable_prefix_caching=False)
    return Engine.from_options(**{**base, **options})


def _alone(folder: str, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return outputs_alone(_engine(folder), prompts, PARAMS)


@pytest.mark.parametrize("reserved", [{"kv_reservation_blocks": 8}, {}])
def test_a_class_takes_its_lent_reservation_back_from_a_higher_priority_class(folder, tmp_path, reserved):
    prompts = {f"i{n}": _prompt(n) for n in range(8)} | {"b0": _prompt(50), "b1": _prompt(51)}
    expected = _alone(folder, prompts)
    probe = _engine(folder, kv_cache_memory=1 << 20)
    block_bytes = probe.kv_bytes_per_token * BLOCK
    engine = _engine(folder, kv_cache_memory=20 * block_bytes, scheduling_policy="priority",
                     qos_config=_qos(tmp_path, reserved))
    assert engine.kv_manager.num_blocks == 20
    for n in range(8):          # interactive fills the pool while batch is idle (its reservation lent)
        engine.add_request(f"i{n}", {"prompt_token_ids": prompts[f"i{n}"]}, _in_class(PARAMS, "interactive"))
    outputs, first_token, finished_at, step = {}, {}, {}, 0
    while engine.has_unfinished_requests():
        if step == 3:
            assert engine.kv_manager.num_free_blocks < 8           # the reservation is borrowed
            for request_id in ("b0", "b1"):
                engine.add_request(request_id, {"prompt_token_ids": prompts[request_id]},
                                   _in_class(PARAMS, "batch"))
        for output in engine.step():
            if output.outputs[0].token_ids and output.request_id not in first_token:
                first_token[output.request_id] = step
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
                finished_at[output.request_id] = step
        step += 1
    assert outputs == expected
    preemptions = engine.make_stats().scheduler.num_preemptions_total
    batch = next(c for c in engine.make_stats().scheduler.classes if c.name == "batch")
    assert batch.kv_reserved_blocks == reserved.get("kv_reservation_blocks", 0) and batch.kv_blocks == 0
    interactive_done = sorted(finished_at[f"i{n}"] for n in range(8))
    if reserved:
        # Taken back at once: batch starts the step it arrives and is done before most interactive
        # requests; the lent blocks come back with a few preemptions, not a ping-pong.
        assert first_token["b0"] == first_token["b1"] == 3
        assert finished_at["b1"] < interactive_done[4] and 1 <= preemptions <= 8
    else:
        # Lower priority, no reservation: batch waits until the interactive requests leave room.
        assert first_token["b0"] >= interactive_done[0]


def _in_class(params: SamplingParams, qos_class: str) -> SamplingParams:
    return replace(params, qos_class=qos_class)


def test_reservations_past_the_pool_or_with_both_fields_are_refused(folder, tmp_path):
    probe = _engine(folder, kv_cache_memory=1 << 20)
    block_bytes = probe.kv_bytes_per_token * BLOCK
    with pytest.raises(ValueError, match="sum to 30 blocks, more than the KV cache's 20"):
        _engine(folder, kv_cache_memory=20 * block_bytes, scheduling_policy="priority",
                qos_config=_qos(tmp_path, {"kv_reservation_blocks": 30}))
    path = tmp_path / "both.json"
    path.write_text(json.dumps({"classes": {"a": {"ttft_p99": 1, "kv_reservation_blocks": 2,
                                                  "kv_reservation_fraction": 0.1}}}))
    with pytest.raises(ValueError, match="give one"):
        load_qos_config(str(path))
