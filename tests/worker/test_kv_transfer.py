"""Tier copies off the step's critical path (kvserve/worker/kv_transfer.py): a request whose KV comes
from the host waits outside the batch until its copy is reported landed (a load too long to run
inline in the step: --kv-host-inline-load-ms 0 here), or computes in the step that issues a small load (the
step waits for it); a failed copy makes it recompute (same tokens) either way, and a request
aborted while loading gives its blocks back only after the copy has landed. On CPU copies run at
once and are reported at the next poll: the same path."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve import LLM, SamplingParams
from kvserve.kvstore import DEVICE_STORE, HOST_STORE, LOAD, WRITE_BACK, BlockCopy, KVCacheStore
from kvserve.worker.kv_transfer import KVTransfers

BLOCK = 4
PROMPT = [3 + (7 * i) % 200 for i in range(41)]          # 10 full blocks + 1 token
FRESH = [2, 2, 2, 2, 5, 5, 5, 5, 9]                        # shares no block with the prompts above
FILLERS = [[11 + (13 * i + 5 * j) % 230 for i in range(41)] for j in range(4)]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv-transfer-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


def _llm(folder: str, **options) -> LLM:
    probe = LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20)
    block_bytes = probe.engine.kv_bytes_per_token * BLOCK
    return LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=block_bytes * 16,
               kv_host_memory=block_bytes * 64, async_scheduling="off", **options)


def _tokens(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def _evict_to_host(llm: LLM) -> list[int]:
    cold = _tokens(llm, PROMPT)
    for filler in FILLERS:
        _tokens(llm, filler)
    assert llm.engine.make_stats().kv_cache.host.used_blocks >= 10
    return cold


def test_a_host_hit_waits_outside_the_batch_until_its_copy_lands(folder):
    llm = _llm(folder, kv_host_inline_load_ms=0)
    cold = _evict_to_host(llm)
    engine = llm.engine
    request_id = engine.add_request(None, {"prompt_token_ids": PROMPT}, PARAMS)
    request = engine._groups[request_id].children[0]
    engine.step()                       # admitted: blocks allocated, load issued, not computed
    assert request.request_id in engine.scheduler.loading and request not in engine.scheduler.running
    assert request.num_computed_tokens == 10 * BLOCK and not request.output_token_ids
    assert engine.make_stats().scheduler.num_loading == 1
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output.outputs[0].token_ids
    assert list(final) == cold
    stats = engine.make_stats().kv_cache
    assert stats.host.hit_tokens == 10 * BLOCK
    assert stats.transfers.loads >= 1 and stats.transfers.bytes_to_device >= 10 * engine.host_store.block_nbytes
    assert sum(count for _, count in stats.transfers.load_buckets) == stats.transfers.loads


@pytest.mark.parametrize("inline_ms", [0.0, 1e6], ids=["beside", "inline"])
def test_a_failed_load_recomputes_with_the_same_tokens(folder, monkeypatch, inline_ms):
    llm = _llm(folder, kv_host_inline_load_ms=inline_ms)
    cold = _evict_to_host(llm)
    store = llm.engine.host_store
    real = KVCacheStore.take_rows
    failures = []

    def flaky(self, ids, out):
        if self is store and not failures:
            failures.append(len(ids))
            raise RuntimeError("injected: a host-to-device copy failed")
        return real(self, ids, out)

    monkeypatch.setattr(KVCacheStore, "take_rows", flaky)
    transfers = llm.engine.runner.transfers
    if transfers.kernel is not None:            # on a GPU with triton, loads run the block-copy kernel
        kernel = transfers.kernel

        def flaky_kernel(pieces, block_ids, segments, row_ids, rows_per_segment, to_rows, max_programs=None):
            if not to_rows and not failures:
                failures.append(len(block_ids))
                raise RuntimeError("injected: a host-to-device copy failed")
            return kernel(pieces, block_ids, segments, row_ids, rows_per_segment, to_rows, max_programs)
        monkeypatch.setattr(transfers, "kernel", flaky_kernel)
    assert _tokens(llm, PROMPT) == cold
    stats = llm.engine.make_stats().kv_cache
    assert failures == [10] and stats.transfers.copy_failures == 1 and stats.host.load_failures == 1
    # The doubtful host blocks left the index; the recompute wrote the prefix back into the GPU cache.
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks
    assert _tokens(llm, PROMPT) == cold


def _step_until_output(engine, request_id: str) -> int:
    """Steps until the request has a token; returns how many steps that took."""
    for steps in range(1, 50):
        engine.step()
        if engine._groups[request_id].children[0].output_token_ids:
            return steps
    raise AssertionError("no token in 50 steps")


def _step_until_finished(engine, request_id: str) -> list[int]:
    """Steps until nothing is left; returns the request's tokens."""
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                final = list(output.outputs[0].token_ids)
    return final


def test_a_small_host_hit_computes_in_the_step_that_loads_it(folder):
    """Under --kv-host-inline-load-ms the load runs inline in the step that admits the request (its forward
    waits for the copy): the first token comes from that step, beside a running request, with the
    cold run's tokens; with inline loads off the same hit waits a step outside the batch."""
    for inline_ms, expected_steps in ((1e6, 1), (0.0, 2)):
        llm = _llm(folder, kv_host_inline_load_ms=inline_ms)
        cold = _evict_to_host(llm)
        engine = llm.engine
        running = engine.add_request(None, {"prompt_token_ids": FRESH}, PARAMS)
        _step_until_output(engine, running)             # a batch is running: only a small load runs inline
        assert engine.kv_manager.inline_load_max_blocks >= (10 if inline_ms else 0)
        request_id = engine.add_request(None, {"prompt_token_ids": PROMPT}, PARAMS)
        assert _step_until_output(engine, request_id) == expected_steps, inline_ms
        assert _step_until_finished(engine, request_id) == cold
        stats = engine.make_stats().kv_cache
        assert stats.host.hit_tokens == 10 * BLOCK and stats.host.load_failures == 0
        assert stats.transfers.loads_inline == (1 if inline_ms else 0)
        assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


def test_a_load_of_any_size_runs_inline_when_nothing_runs(folder):
    """A load over the inline bound streams beside a running batch but runs inline when no
    request runs (nothing waits for it there)."""
    llm = _llm(folder, kv_host_inline_load_ms=1e-9)      # bound: 0 blocks
    cold = _evict_to_host(llm)
    engine = llm.engine
    assert engine.kv_manager.inline_load_max_blocks == 0
    request_id = engine.add_request(None, {"prompt_token_ids": PROMPT}, PARAMS)
    assert _step_until_output(engine, request_id) == 1
    while engine.has_unfinished_requests():
        engine.step()
    for filler in FILLERS:                             # evict it again
        _tokens(llm, filler)
    running = engine.add_request(None, {"prompt_token_ids": FRESH}, PARAMS)
    _step_until_output(engine, running)
    request_id = engine.add_request(None, {"prompt_token_ids": PROMPT}, PARAMS)
    engine.step()
    assert engine._groups[request_id].children[0].request_id in engine.scheduler.loading
    assert _step_until_finished(engine, request_id) == cold


def test_abort_while_loading_frees_the_blocks_once_the_copy_lands(folder):
    llm = _llm(folder, kv_host_inline_load_ms=0)
    _evict_to_host(llm)
    engine = llm.engine
    manager = engine.kv_manager
    request_id = engine.add_request(None, {"prompt_token_ids": PROMPT}, PARAMS)
    engine.step()
    child = engine._groups[request_id].children[0]
    assert manager.is_loading(child.request_id)
    held = len(manager.block_table(child.request_id))
    free_before = manager.pool.num_free_blocks
    engine.abort(request_id)
    # Not back in the pool yet: the worker has not reported the copy into them.
    assert manager.pool.num_free_blocks == free_before
    assert held >= 10
    # On CPU the copy lands by the next step; on a GPU it may take a few (it runs on its own
    # stream): step until it is reported, with a bound so a lost report fails instead of hanging.
    for _ in range(200):
        engine.step()
        if manager.num_free_blocks == manager.num_blocks:
            break
        time.sleep(0.005)
    assert manager.num_free_blocks == manager.num_blocks and not engine.scheduler.loading


def _stores(num_blocks: int = 8):
    from kvserve.kvstore import build_kv_cache_spec
    spec = build_kv_cache_spec(num_layers=2, num_kv_heads=2, head_dim=8, model_dtype=torch.float32)
    device = KVCacheStore.allocate(spec, num_blocks, BLOCK, "cpu")
    host = KVCacheStore.allocate_flat(spec, num_blocks, BLOCK)
    generator = torch.Generator().manual_seed(0)
    device.write_blocks(list(range(num_blocks)), torch.randint(0, 256, (num_blocks, device.block_nbytes),
                                                              dtype=torch.uint8, generator=generator))
    return device, host


class _BrokenStore(KVCacheStore):
    """A tier whose every copy fails as a copy does at run time (a CUDA error, an I/O error)."""

    def copy_blocks(self, src_ids, dst_ids, dst) -> None:
        raise RuntimeError("injected: the tier's copy failed")

    def put_rows(self, ids, data) -> None:
        raise RuntimeError("injected: the tier's copy failed")


def test_transfers_report_tickets_and_lost_write_backs():
    device, host = _stores()
    broken = _BrokenStore.allocate_flat(device.spec, 4, BLOCK)
    transfers = KVTransfers({DEVICE_STORE: device, HOST_STORE: host, "disk": broken}, torch.device("cpu"))
    transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, (1, 2), (5, 6)),
                   BlockCopy(HOST_STORE, DEVICE_STORE, (5, 6), (3, 4), LOAD, ticket=7),
                   BlockCopy(DEVICE_STORE, "disk", (0,), (0,)),
                   BlockCopy("disk", DEVICE_STORE, (2,), (0,), LOAD, ticket=8)])
    report = transfers.poll()
    assert report.landed == [7] and report.failed == [8] and report.lost_host_blocks == [0]
    assert torch.equal(device.read_blocks([3, 4]), device.read_blocks([1, 2]))
    assert not transfers.poll()
    with pytest.raises(KeyError, match="unknown KV store"):       # a bug, not a fault: raised
        transfers.run([BlockCopy(DEVICE_STORE, "nowhere", (0,), (0,))])
    stats = transfers.make_stats()
    assert stats.copy_failures == 2 and stats.loads == 1 and stats.bytes_to_host == 2 * device.block_nbytes


def test_a_load_from_a_write_back_that_was_dropped_fails_too():
    device, host = _stores()
    transfers = KVTransfers({DEVICE_STORE: device, HOST_STORE: host}, torch.device("cpu"), max_write_back_bytes=0)
    transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, (1,), (5,), WRITE_BACK),
                   BlockCopy(HOST_STORE, DEVICE_STORE, (5,), (3,), LOAD, ticket=1),
                   BlockCopy(HOST_STORE, DEVICE_STORE, (6,), (4,), LOAD, ticket=2)])
    report = transfers.poll()
    assert report.lost_host_blocks == [5] and report.failed == [1] and report.landed == [2]
    assert transfers.make_stats().write_back_blocks_dropped == 1


def test_a_write_back_past_the_bound_keeps_its_first_blocks_and_drops_the_rest():
    device, host = _stores()
    transfers = KVTransfers({DEVICE_STORE: device, HOST_STORE: host}, torch.device("cpu"),
                            max_write_back_bytes=2 * device.block_nbytes + 1)
    transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, (1, 2, 3, 4), (5, 6, 7, 0), WRITE_BACK)])
    report = transfers.poll()
    assert report.lost_host_blocks == [7, 0]
    assert torch.equal(host.read_blocks([5, 6]), device.read_blocks([1, 2]))
    assert not torch.equal(host.read_blocks([7]), device.read_blocks([3]))
    stats = transfers.make_stats()
    assert stats.write_back_blocks_dropped == 2 and stats.bytes_to_host == 2 * device.block_nbytes
    # With the blocks' depths in their prefix chains, the deepest are dropped, the rest keep their order.
    transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, (4, 5, 6, 7), (1, 2, 3, 4), WRITE_BACK, depths=(9, 0, 7, 3))])
    assert transfers.poll().lost_host_blocks == [1, 3]
    assert torch.equal(host.read_blocks([2, 4]), device.read_blocks([5, 7]))


# The ways of moving blocks on a GPU, as KVTransfers options: torch copies only; the Triton
# block-copy kernel for every copy; the kernel with loads alone from long runs of host rows by the
# copy engine (the default where triton imports).
_PATHS = {"torch": dict(use_kernel=False), "kernel": dict(use_kernel=True, copy_engine_loads="never"),
          "kernel+copy-engine": dict(use_kernel=True, copy_engine_loads="alone"),
          "kernel+copy-engine-always": dict(use_kernel=True, copy_engine_loads="always")}


def _kernel_choices():
    from kvserve.worker.kv_transfer import block_copy_kernel
    choices = ["torch"]
    if torch.cuda.is_available() and block_copy_kernel(torch.device("cuda")) is not None:
        choices += ["kernel", "kernel+copy-engine", "kernel+copy-engine-always"]
    return choices


def test_a_load_alone_from_long_runs_of_host_rows_takes_the_copy_engine():
    from kvserve.worker.kv_transfer import COPY_ENGINE_MIN_MEAN_RUN, load_by_copy_engine, mean_run_length
    run = COPY_ENGINE_MIN_MEAN_RUN
    long_runs = list(range(100, 100 + 2 * run)) + list(range(7, 7 + 2 * run))
    scattered = [5 * i for i in range(4 * run)]
    assert mean_run_length(long_runs) == 2 * run and mean_run_length(scattered) == 1 and mean_run_length([]) == 0
    assert load_by_copy_engine(long_runs, beside_a_batch=False, kernel_runs=True)
    assert not load_by_copy_engine(long_runs, beside_a_batch=True, kernel_runs=True)
    assert not load_by_copy_engine(scattered, beside_a_batch=False, kernel_runs=True)
    assert not load_by_copy_engine(long_runs, beside_a_batch=False, kernel_runs=True, mode="never")
    assert load_by_copy_engine(long_runs, beside_a_batch=True, kernel_runs=True, mode="always")
    assert not load_by_copy_engine(scattered, beside_a_batch=True, kernel_runs=True, mode="always")
    assert load_by_copy_engine(scattered, beside_a_batch=True, kernel_runs=False)     # no kernel: copies only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the transfer stream")
@pytest.mark.parametrize("path", _kernel_choices())
def test_cuda_copies_land_on_the_transfer_stream_and_match_the_source(path):
    from kvserve.kvstore import build_kv_cache_spec
    spec = build_kv_cache_spec(num_layers=4, num_kv_heads=4, head_dim=64, model_dtype=torch.bfloat16)
    gpu = KVCacheStore.allocate(spec, 64, 16, "cuda")
    host = KVCacheStore.allocate_flat(spec, 64, 16, pin_memory=True)
    data = torch.randint(0, 256, (64, gpu.block_nbytes), dtype=torch.uint8)
    gpu.write_blocks(list(range(64)), data)
    # Staging for 3 blocks a slot: the copies go through the ring in many chunks.
    transfers = KVTransfers({DEVICE_STORE: gpu, HOST_STORE: host}, torch.device("cuda"),
                            staging_bytes=6 * gpu.block_nbytes, **_PATHS[path])
    assert (transfers.kernel is not None) == (path != "torch")
    out_ids, host_ids = list(range(0, 40)), [63 - i for i in range(40)]
    transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, tuple(out_ids), tuple(host_ids))])
    # The forward after the copies may overwrite the blocks at once: the gather already read them.
    gpu.write_blocks(out_ids, torch.zeros(40, gpu.block_nbytes, dtype=torch.uint8))
    transfers.run([BlockCopy(HOST_STORE, DEVICE_STORE, tuple(host_ids), tuple(range(20, 60)), LOAD, ticket=3)])
    report = transfers.poll(wait=True)
    while 3 not in report.landed:
        report = transfers.poll(wait=True)
    assert torch.equal(gpu.read_blocks(list(range(20, 60))), data[:40])
    assert transfers.make_stats().load_seconds > 0


def _wait_landed(transfers: KVTransfers, ticket: int) -> None:
    for _ in range(1000):
        if ticket in transfers.poll(wait=True).landed:
            return
    raise AssertionError(f"copy {ticket} never landed")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the copy engine and the kernel")
@pytest.mark.parametrize("path", [p for p in _kernel_choices() if p != "torch"])
def test_cuda_loads_take_the_copy_engine_only_alone_and_from_long_runs(path):
    """With the kernel, a load alone from consecutive host rows goes by memcpys + scatters (where
    allowed), the same load beside a batch or from scattered rows by the kernel; each lands the
    host's bytes."""
    from kvserve.kvstore import build_kv_cache_spec
    spec = build_kv_cache_spec(num_layers=4, num_kv_heads=4, head_dim=64, model_dtype=torch.bfloat16)
    count = 48
    gpu = KVCacheStore.allocate(spec, 2 * count, 16, "cuda")
    host = KVCacheStore.allocate_flat(spec, count, 16, pin_memory=True)
    data = torch.randint(0, 256, (count, gpu.block_nbytes), dtype=torch.uint8)
    host.write_blocks(list(range(count)), data)
    transfers = KVTransfers({DEVICE_STORE: gpu, HOST_STORE: host}, torch.device("cuda"),
                            staging_bytes=5 * gpu.block_nbytes, **_PATHS[path])
    runs, scattered = tuple(range(count)), tuple((7 * i) % count for i in range(count))
    expected = 0
    cases = [(runs, False, path != "kernel"), (runs, True, path == "kernel+copy-engine-always"),
             (scattered, False, False)]
    for ticket, (host_ids, beside_a_batch, by_copy_engine) in enumerate(cases, start=1):
        destination = tuple(range(count, 2 * count)) if ticket % 2 else tuple(range(count))
        gpu.write_blocks(list(destination), torch.zeros(count, gpu.block_nbytes, dtype=torch.uint8))
        transfers.run([BlockCopy(HOST_STORE, DEVICE_STORE, host_ids, destination, LOAD, ticket=ticket)],
                      beside_a_batch=beside_a_batch)
        expected += by_copy_engine
        assert transfers.make_stats().loads_by_copy_engine == expected, (host_ids[:3], beside_a_batch)
        _wait_landed(transfers, ticket)
        assert torch.equal(gpu.read_blocks(list(destination)), data[list(host_ids)])


def _compiled_block_copy_variants(forget: bool = False) -> int:
    """The block-copy kernel's variants this process holds (`forget`: drops them first, so the next
    launch of each variant compiles or loads it from Triton's disk cache again)."""
    from kvserve.kernels.triton.block_copy import _block_rows_kernel
    if forget:
        _block_rows_kernel.device_caches.clear()
    return sum(len(cache[0]) for cache in _block_rows_kernel.device_caches.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the block-copy kernel")
@pytest.mark.parametrize("path", [p for p in _kernel_choices() if p not in ("torch", "kernel")])
def test_cuda_the_block_copy_kernel_is_compiled_at_start_not_by_a_load(path):
    """A store's kernel variants are compiled when KVTransfers is built, leaving block 0 as it was;
    loads and write-backs of any count (1, a multiple of 16, other) by either path then compile
    nothing (the first long host hit paid ~90 ms for it on an H100)."""
    from kvserve.kvstore import build_kv_cache_spec
    spec = build_kv_cache_spec(num_layers=3, num_kv_heads=2, head_dim=48, model_dtype=torch.bfloat16)
    count = 40
    gpu = KVCacheStore.allocate(spec, 2 * count, 16, "cuda")
    host = KVCacheStore.allocate_flat(spec, 2 * count, 16, pin_memory=True)
    data = torch.randint(0, 256, (2 * count, gpu.block_nbytes), dtype=torch.uint8)
    gpu.write_blocks(list(range(2 * count)), data)
    assert _compiled_block_copy_variants(forget=True) == 0      # earlier tests compiled them in this process
    transfers = KVTransfers({DEVICE_STORE: gpu, HOST_STORE: host}, torch.device("cuda"),
                            staging_bytes=7 * gpu.block_nbytes, **_PATHS[path])
    assert torch.equal(gpu.read_blocks([0]), data[:1])
    warmed = _compiled_block_copy_variants()
    assert warmed > 0
    ticket = 0
    for size in (1, 16, 17, count):
        for beside_a_batch in (False, True):
            ticket += 1
            transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, tuple(range(size)), tuple(range(size)))])
            transfers.run([BlockCopy(HOST_STORE, DEVICE_STORE, tuple(range(size)), tuple(range(count, count + size)),
                                     LOAD, ticket=ticket)], beside_a_batch=beside_a_batch)
            _wait_landed(transfers, ticket)
            assert torch.equal(gpu.read_blocks(list(range(count, count + size))), data[:size])
    assert transfers.make_stats().loads_by_copy_engine > 0
    assert _compiled_block_copy_variants() == warmed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the write and load streams")
@pytest.mark.parametrize("path", _kernel_choices())
def test_cuda_host_blocks_keep_their_order_across_the_write_and_load_streams(path):
    """Writes and loads run on streams of their own; a host block is still written and read in
    issue order (a load waits for the write that fills it, a write for the load still reading it),
    and a block evicted and loaded into in one step, or loaded into the step after its write-back,
    is gathered before the load overwrites it.
    Each case holds back the stream that must go first (a GPU sleep), so a missing wait shows."""
    from kvserve.kvstore import build_kv_cache_spec
    spec = build_kv_cache_spec(num_layers=4, num_kv_heads=4, head_dim=64, model_dtype=torch.bfloat16)
    count = 32
    gpu = KVCacheStore.allocate(spec, 3 * count, 16, "cuda")
    host = KVCacheStore.allocate_flat(spec, 2 * count, 16, pin_memory=True)
    first = torch.randint(0, 256, (count, gpu.block_nbytes), dtype=torch.uint8)
    second = torch.randint(0, 256, (count, gpu.block_nbytes), dtype=torch.uint8)
    transfers = KVTransfers({DEVICE_STORE: gpu, HOST_STORE: host}, torch.device("cuda"), **_PATHS[path])
    ids, spare, third = tuple(range(count)), tuple(range(count, 2 * count)), tuple(range(2 * count, 3 * count))
    stall = 200_000_000                     # GPU cycles: ~0.1 s

    def hold(stream: torch.cuda.Stream) -> None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(stall)

    gpu.write_blocks(list(ids), first)
    transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, ids, ids)])
    transfers.synchronize()
    # A load of host blocks (held back), then a write-back into them: the write waits for the read.
    gpu.write_blocks(list(ids), second)
    hold(transfers.load_stream)
    transfers.run([BlockCopy(HOST_STORE, DEVICE_STORE, ids, spare, LOAD, ticket=1, after_inflight=False)])
    transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, ids, ids)])
    _wait_landed(transfers, 1)
    transfers.synchronize()
    assert torch.equal(gpu.read_blocks(list(spare)), first)
    assert torch.equal(host.read_blocks(list(ids)), second)
    # A write-back (held back), then a load of the host blocks it writes: the load waits for the write.
    hold(transfers.write_stream)
    transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, ids, spare)])
    transfers.run([BlockCopy(HOST_STORE, DEVICE_STORE, spare, third, LOAD, ticket=2, after_inflight=False)])
    _wait_landed(transfers, 2)
    assert torch.equal(gpu.read_blocks(list(third)), second)
    # Blocks evicted (written back) and loaded into in one step: the write-back (held back, off the
    # main stream) reads them before the load's scatters overwrite them.
    transfers.synchronize()
    gpu.write_blocks(list(third), first)
    hold(transfers.write_stream)
    transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, third, ids),
                   BlockCopy(HOST_STORE, DEVICE_STORE, spare, third, LOAD, ticket=3, after_inflight=False)])
    _wait_landed(transfers, 3)
    transfers.synchronize()
    assert torch.equal(host.read_blocks(list(ids)), first)
    assert torch.equal(gpu.read_blocks(list(third)), second)
    # Blocks written back one step (gathered on the main stream, held back there: the step in
    # flight) and loaded into the next, not freed in between (after_inflight False): the load
    # waits for that gather, not for the main stream.
    transfers.synchronize()
    fourth = torch.randint(0, 256, (count, gpu.block_nbytes), dtype=torch.uint8)
    gpu.write_blocks(list(third), fourth)
    hold(torch.cuda.current_stream())
    transfers.run([BlockCopy(DEVICE_STORE, HOST_STORE, third, ids)])
    transfers.run([BlockCopy(HOST_STORE, DEVICE_STORE, spare, third, LOAD, ticket=4, after_inflight=False)])
    _wait_landed(transfers, 4)
    transfers.synchronize()
    assert torch.equal(host.read_blocks(list(ids)), fourth)
    assert torch.equal(gpu.read_blocks(list(third)), second)
    transfers.poll()
    assert not transfers._last_read and not transfers._last_write       # forgotten once landed
    # Two loads of one step, the first into blocks the step in flight (held back) may still use:
    # the second does not queue behind it, it lands while the step still runs.
    transfers.synchronize()
    transfers.poll()
    hold(torch.cuda.current_stream())
    transfers.run([BlockCopy(HOST_STORE, DEVICE_STORE, ids, spare, LOAD, ticket=5, after_inflight=True),
                   BlockCopy(HOST_STORE, DEVICE_STORE, spare, third, LOAD, ticket=6, after_inflight=False)])
    landed = set()
    for _ in range(2000):
        landed |= set(transfers.poll().landed)
        if 6 in landed:
            break
        time.sleep(0.0005)
    assert 6 in landed and 5 not in landed, landed
    _wait_landed(transfers, 5)
    transfers.synchronize()
