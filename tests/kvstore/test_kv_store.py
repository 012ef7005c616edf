"""KVCacheStore (kvserve/kvstore/store.py): block and row transfer between stores, and byte buffers.

The round trips run a real engine on tiny random models: a request decodes part-way, its blocks (and
its per-sequence window / residual row) are copied out to a host store, the device copies are
scribbled over, the blocks are copied back, and the request finishes with the greedy tokens it
gets without any of that. A control run scribbles without copying back and must change them, so
the round trip is shown to carry what the outputs depend on."""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_checkpoint
from deepseek_fixtures import build_tiny_deepseek
from kvserve import SamplingParams
from kvserve.engine.engine import Engine
from kvserve.kvstore import KVCacheStore, LayerKV, build_kv_cache_spec
from kvserve.sched.output import BlockCopy

PROMPT = [5, 17, 33, 2 + 40, 61, 7, 99, 12, 140, 3, 77, 18, 29, 201, 9, 64, 88, 31, 45, 150]
MAX_NEW = 16
SWAP_AFTER = 6

# name -> engine KV options. int4 keeps a full-precision window (and sinks) by default.
FORMATS = {
    "bf16": dict(kv_cache_dtype="bf16"),
    "fp16": dict(kv_cache_dtype="fp16"),
    "fp8": dict(kv_cache_dtype="fp8_e4m3"),
    "int8": dict(kv_cache_dtype="int8"),
    "int4-window": dict(kv_cache_dtype="int4", kv_quant_window=8, kv_quant_sinks=2),
    "int4-no-window": dict(kv_cache_dtype="int4", kv_quant_window=0, kv_quant_sinks=0),
    "int8-error-feedback": dict(kv_cache_dtype="int8", kv_error_feedback=True),
}
MLA_FORMATS = {
    "mla-latent-bf16": dict(),
    "mla-latent-fp8": dict(kv_cache_dtype="fp8_e4m3"),
}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store-llama")
    build_tiny_checkpoint("llama", folder)
    return str(folder)


@pytest.fixture(scope="module")
def deepseek_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("store-deepseek")
    build_tiny_deepseek("deepseek_v2", folder, "cpu")
    return str(folder)


def _engine(folder: str, **options) -> Engine:
    return Engine.from_options(model=folder, device="cpu", dtype="float32", kv_cache_memory=2 << 20,
                               block_size=4, async_scheduling="off", enable_prefix_caching=False, **options)


def _greedy(engine: Engine, swap=None) -> list[int]:
    """The request's greedy tokens; `swap(engine, request)` runs once after SWAP_AFTER tokens."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    request_id = engine.add_request(None, {"prompt_token_ids": PROMPT}, params)
    request = engine._groups[request_id].children[0]
    swapped, final = False, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output.outputs[0].token_ids
        if swap is not None and not swapped and len(request.output_token_ids) >= SWAP_AFTER \
                and not request.is_finished:
            swap(engine, request)
            swapped = True
    assert swap is None or swapped
    return list(final)


def _scribble(store: KVCacheStore, blocks: list[int], row: int | None) -> None:
    noise = torch.randint(0, 256, (len(blocks), store.block_nbytes), dtype=torch.uint8)
    store.write_blocks(blocks, noise)
    for part in store.quantized_parts():
        for state in (part.window, part.residual):
            if state is not None:
                state.normal_()


def _round_trip(via: str, copy_back: bool = True):
    def swap(engine: Engine, request) -> None:
        store = engine.runner.kv_store
        blocks = engine.kv_manager.block_tables[request.request_id]
        entry = engine.runner._kv_row_of.get(request.request_id)
        row = entry[0] if entry is not None else None
        # Host ids differ from the device ids, and the host store has other rows: nothing lines up by luck.
        host = KVCacheStore.allocate(store.spec, len(blocks) + 3, store.block_size, "cpu", num_rows=3)
        host_ids = list(range(3, 3 + len(blocks)))[::-1]
        saved = None
        if via == "copy_blocks":
            store.copy_blocks(blocks, host_ids, host)
        else:
            saved = store.read_blocks(blocks)
        if row is not None:
            store.copy_rows([row], [2], host)
        _scribble(store, blocks, row)
        if not copy_back:
            return
        if via == "copy_blocks":
            host.copy_blocks(host_ids, blocks, store)
        else:
            store.write_blocks(blocks, saved)
        if row is not None:
            host.copy_rows([2], [row], store)
    return swap


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_swap_round_trip_keeps_greedy_outputs(llama_folder, name):
    engine = _engine(llama_folder, **FORMATS[name])
    reference = _greedy(engine)
    assert _greedy(engine, _round_trip("copy_blocks")) == reference
    assert _greedy(engine, _round_trip("bytes")) == reference
    assert _greedy(engine, _round_trip("copy_blocks", copy_back=False)) != reference


@pytest.mark.parametrize("name", sorted(MLA_FORMATS))
def test_mla_latent_swap_round_trip(deepseek_folder, name):
    engine = _engine(deepseek_folder, **MLA_FORMATS[name])
    reference = _greedy(engine)
    assert _greedy(engine, _round_trip("copy_blocks")) == reference
    assert _greedy(engine, _round_trip("bytes")) == reference
    assert _greedy(engine, _round_trip("copy_blocks", copy_back=False)) != reference


def _random_store(spec, num_blocks: int, seed: int, num_rows: int = 0) -> KVCacheStore:
    store = KVCacheStore.allocate(spec, num_blocks, 4, "cpu", num_rows=num_rows)
    generator = torch.Generator().manual_seed(seed)
    store.write_blocks(list(range(num_blocks)),
                       torch.randint(0, 256, (num_blocks, store.block_nbytes), dtype=torch.uint8, generator=generator))
    return store


@pytest.mark.parametrize("dtype", ["auto", "fp8_e4m3", "int8", "int4"])
def test_copy_blocks_moves_exactly_the_named_blocks(dtype):
    spec = build_kv_cache_spec(2, 2, 8, torch.float32, kv_cache_dtype=dtype, kv_quant_window=0, kv_quant_sinks=0,
                               block_size=4)
    src, dst = _random_store(spec, 6, 1), _random_store(spec, 5, 2)
    before = dst.read_blocks(range(5))
    src.copy_blocks([4, 0, 2], [1, 3, 0], dst)
    after = dst.read_blocks(range(5))
    assert torch.equal(after[[1, 3, 0]], src.read_blocks([4, 0, 2]))
    assert torch.equal(after[[2, 4]], before[[2, 4]])        # untouched blocks stay as they were
    # One block's bytes are every layer's and part's payload and scales.
    expected = 4 * spec.bytes_per_token
    assert dst.block_nbytes == expected


def test_layers_read_as_key_value_pairs():
    spec = build_kv_cache_spec(3, 2, 8, torch.float32, kv_cache_dtype_k="int8", kv_cache_dtype_v="auto")
    store = KVCacheStore.allocate(spec, 2, 4, "cpu")
    assert len(store) == 3 and all(isinstance(layer, LayerKV) for layer in store)
    key, value = store[0]
    assert not store[0].full_precision and key.fmt.name == "int8" and value.dtype == torch.float32
    assert KVCacheStore.allocate(build_kv_cache_spec(1, 2, 8, torch.float32), 2, 4, "cpu")[0].full_precision


def test_transfers_refuse_what_does_not_fit():
    spec = build_kv_cache_spec(2, 2, 8, torch.float32, kv_cache_dtype="int8")
    store = KVCacheStore.allocate(spec, 4, 4, "cpu")
    other = KVCacheStore.allocate(build_kv_cache_spec(2, 2, 8, torch.float32, kv_cache_dtype="fp8_e4m3"), 4, 4, "cpu")
    with pytest.raises(ValueError, match="layout"):
        store.copy_blocks([0], [0], other)
    with pytest.raises(ValueError, match="layout"):       # same formats, other block size
        store.copy_blocks([0], [0], KVCacheStore.allocate(spec, 4, 8, "cpu"))
    with pytest.raises(IndexError, match="block id"):
        store.copy_blocks([4], [0], store)
    with pytest.raises(ValueError, match="destination"):
        store.copy_blocks([0, 1], [2], store)
    with pytest.raises(ValueError, match="uint8"):
        store.write_blocks([0], torch.zeros(1, store.block_nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="num_rows"):       # per-token int4 keys keep a window per sequence
        KVCacheStore.allocate(build_kv_cache_spec(1, 2, 8, torch.float32, kv_cache_dtype="int4",
                                                  kv_quant_key_layout="token"), 2, 4, "cpu")


def test_runner_runs_block_copies_between_named_stores(llama_folder):
    engine = _engine(llama_folder)
    runner, store = engine.runner, engine.runner.kv_store
    noise = torch.randint(0, 256, (2, store.block_nbytes), dtype=torch.uint8)
    store.write_blocks([0, 1], noise)
    host = KVCacheStore.allocate(store.spec, 4, store.block_size, "cpu")
    runner.register_store("host", host)
    assert runner.run_block_copies([BlockCopy("device", "host", (0, 1), (3, 2)),
                                    BlockCopy("host", "device", (3,), (5,))]) == []
    assert torch.equal(host.read_blocks([3, 2]), noise)
    assert torch.equal(store.read_blocks([5]), noise[:1])
    with pytest.raises(KeyError, match="unknown KV store"):
        runner.run_block_copies([BlockCopy("device", "disk", (0,), (0,))])
    with pytest.raises(ValueError, match="as many"):
        BlockCopy("device", "host", (0, 1), (0,))


@pytest.mark.parametrize("dtype", ["auto", "int8", "int4"])
def test_a_flat_tier_store_keeps_blocks_byte_for_byte(dtype):
    """A tier's store (allocate_flat: one [blocks, block_nbytes] tensor) takes and gives back blocks
    by runs of consecutive ids and one by one, and holds the bytes read_blocks gives."""
    spec = build_kv_cache_spec(2, 2, 8, torch.float32, kv_cache_dtype=dtype, kv_quant_window=0, kv_quant_sinks=0,
                               block_size=4)
    device = _random_store(spec, 8, 3)
    tier = KVCacheStore.allocate_flat(spec, 10, 4)
    assert tier.block_nbytes == device.block_nbytes and (tier.flat.num_live_blocks, tier.flat.block_nbytes) == (10, device.block_nbytes)
    device.copy_blocks([0, 1, 2, 5, 7], [4, 5, 6, 0, 9], tier)          # runs 4-6, then 0, then 9
    assert torch.equal(tier.read_blocks([4, 5, 6, 0, 9]), device.read_blocks([0, 1, 2, 5, 7]))
    back = KVCacheStore.allocate(spec, 8, 4, "cpu")
    tier.copy_blocks([9, 4, 5], [3, 4, 5], back)
    assert torch.equal(back.read_blocks([3, 4, 5]), device.read_blocks([7, 0, 1]))
    with pytest.raises(ValueError, match="rows"):
        device.copy_rows([0], [0], tier)
