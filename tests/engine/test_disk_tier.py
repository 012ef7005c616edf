"""The disk KV tier (--kv-disk-path): blocks the host tier receives are written to files in their
stored format; a new engine on the same directory (a restarted server) finds them, and its tokens
equal a cold run's. Files that are not exactly the block asked for (another tenant, another model,
corrupted, torn) are misses, never wrong tokens."""

from __future__ import annotations

import glob
import os
import subprocess

import pytest

from conftest import TEST_DEVICE, build_tiny_checkpoint
from kvserve import LLM, SamplingParams

BLOCK = 4
PROMPT = [3 + (7 * i) % 200 for i in range(41)]          # 10 full blocks + 1 token
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("disk-tier-llama")
    build_tiny_checkpoint("llama", path)
    return str(path)


@pytest.fixture(scope="module")
def cold_tokens(folder):
    """The tokens without any KV tier."""
    with LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20) as llm:
        return _tokens(llm, PROMPT)


def _llm(folder: str, disk: str, disk_size: int = 64 << 20, host_memory: int = 1 << 20, **options) -> LLM:
    return LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, kv_host_memory=host_memory,
               kv_disk_path=disk, kv_disk_size=disk_size, async_scheduling="off", **options)


def _tokens(llm: LLM, prompt: list[int], **request) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt, **request}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


def _disk(llm: LLM):
    (disk,) = llm.engine.make_stats().kv_cache.cold
    return disk


def _disk_hit_tokens(llm: LLM) -> int:
    """Prompt tokens the disk tier supplied, its blocks checked."""
    return llm.engine.make_stats().kv_cache.cold_hit_tokens.get("disk", 0)


def _files(disk: str) -> list[str]:
    return sorted(glob.glob(os.path.join(disk, "*", "*.kvb")))


def _first_run(folder: str, disk: str) -> None:
    with _llm(folder, disk) as llm:
        _tokens(llm, PROMPT)
        assert _disk(llm).hits == 0


def test_a_restarted_engine_finds_the_blocks_and_its_tokens_equal_a_cold_run(folder, cold_tokens, tmp_path):
    disk = str(tmp_path / "kv")
    with _llm(folder, disk) as llm:
        assert _tokens(llm, PROMPT) == cold_tokens
        stats = _disk(llm)
        assert stats.hits == 0
    # 41 prompt + 6 generated tokens: 11 full blocks, each written once.
    assert len(_files(disk)) == 11
    with _llm(folder, disk) as llm:
        assert _tokens(llm, PROMPT) == cold_tokens
        stats, host = _disk(llm), llm.engine.make_stats().kv_cache.host
        assert _disk_hit_tokens(llm) == 10 * BLOCK and stats.hits == 10 and stats.corrupt == 0
        assert host.hit_tokens == 10 * BLOCK                 # and from there through the host tier
        assert stats.bytes_read > 0


def test_another_tenant_or_cache_salt_never_hits(folder, cold_tokens, tmp_path):
    disk = str(tmp_path / "kv")
    _first_run(folder, disk)
    with _llm(folder, disk) as llm:
        assert _tokens(llm, PROMPT, cache_salt="other") == cold_tokens
        assert _disk(llm).hits == 0 and _disk_hit_tokens(llm) == 0
        llm.engine.add_request("t", {"prompt_token_ids": PROMPT}, PARAMS, tenant="tenant-b")
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert _disk(llm).hits == 0
    with _llm(folder, disk) as llm:                         # the default namespace still hits
        assert _tokens(llm, PROMPT) == cold_tokens
        assert _disk_hit_tokens(llm) == 10 * BLOCK


def test_another_model_finds_nothing(folder, cold_tokens, tmp_path):
    disk = str(tmp_path / "kv")
    _first_run(folder, disk)
    other = tmp_path / "other-model"
    build_tiny_checkpoint("qwen2", other)
    with LLM(str(other), device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20, kv_host_memory=1 << 20,
             kv_disk_path=disk, kv_disk_size=64 << 20) as llm:
        _tokens(llm, PROMPT)
        assert _disk(llm).hits == 0 and _disk_hit_tokens(llm) == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_damaged_file_is_a_miss_and_is_removed(folder, cold_tokens, tmp_path, damage):
    disk = str(tmp_path / "kv")
    with _llm(folder, disk) as llm:
        _tokens(llm, PROMPT)
        cold = llm.engine.cold
        namespace = llm.engine.prefix.namespace(None, None)
        fifth = cold.tiers.key_of(cold.identities(namespace, PROMPT)[4])
        victim = cold.tiers.stores[0].file_of(fifth)    # the prompt's fifth block
    data = bytearray(open(victim, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncate":
        data = data[:len(data) - 100]
    else:
        data = bytearray(b"not a block at all")
    with open(victim, "wb") as f:
        f.write(bytes(data))
    with _llm(folder, disk) as llm:
        assert _tokens(llm, PROMPT) == cold_tokens
        stats = _disk(llm)
        assert _disk_hit_tokens(llm) == 4 * BLOCK and stats.corrupt == 1   # the fifth failed its checks
    # Removed as a miss, then written again by the run that recomputed the block.
    assert open(victim, "rb").read() != bytes(data)
    with _llm(folder, disk) as llm:                    # rewritten by the run that computed it
        assert _tokens(llm, PROMPT) == cold_tokens
        assert _disk_hit_tokens(llm) == 10 * BLOCK


def test_host_blocks_reused_before_they_went_down_are_not_written(folder, cold_tokens, tmp_path):
    """A host tier of 3 blocks gets the prompt's 10 in one step: most host blocks are reused before
    their turn to go down, and only blocks still holding what they were given reach the disk."""
    disk = str(tmp_path / "kv")
    with LLM(folder, device=TEST_DEVICE, block_size=BLOCK, kv_cache_memory=1 << 20) as probe:
        block_bytes = probe.engine.kv_bytes_per_token * BLOCK
    with _llm(folder, disk, host_memory=3 * block_bytes) as llm:
        assert _tokens(llm, PROMPT) == cold_tokens
    assert 0 < len(_files(disk)) < 11
    with _llm(folder, disk) as llm:
        assert _tokens(llm, PROMPT) == cold_tokens


def test_a_disk_tier_smaller_than_one_block_drops_writes(folder, cold_tokens, tmp_path):
    disk = str(tmp_path / "kv")
    with _llm(folder, disk, disk_size=100) as llm:
        assert _tokens(llm, PROMPT) == cold_tokens
        llm.engine.cold.tiers.flush()
        stats = _disk(llm)
        assert stats.blocks_written == 0 and stats.writes_dropped >= 10
    assert _files(disk) == []


def test_the_size_cap_evicts_least_recently_used_files(folder, cold_tokens, tmp_path):
    disk = str(tmp_path / "kv")
    with _llm(folder, disk) as llm:
        _tokens(llm, PROMPT)
    block_file = os.path.getsize(_files(disk)[0])      # after close: the writes run on threads until then
    with _llm(folder, disk, disk_size=block_file * 6) as llm:
        # The index rebuilt at start counts the 11 files against a cap of 6: the oldest go.
        llm.engine.cold.tiers.stores[0].scan_done.wait(10)
        assert len(_files(disk)) <= 6
        assert _tokens(llm, PROMPT) == cold_tokens


@pytest.fixture
def tiny_disk(tmp_path):
    """A real file system of 96 KiB (tmpfs), so writes meet a full disk."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield str(mount)
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_writes_not_the_engine(folder, cold_tokens, tiny_disk):
    # More blocks than 96 KiB holds: the disk fills, writes are dropped, tokens stay right.
    with _llm(folder, tiny_disk, disk_size=64 << 20) as llm:
        for shift in range(6):
            prompt = [(t + 17 * shift) % 250 + 1 for t in PROMPT]
            _tokens(llm, prompt)
        assert _tokens(llm, PROMPT) == cold_tokens
        llm.engine.cold.tiers.flush()
        stats = _disk(llm)
        assert stats.writes_dropped > 0 and stats.blocks_written > 0
        assert not stats.available


def test_the_read_or_compute_choice_charges_a_prefix_its_context(folder, tmp_path):
    """The prefetch weighs a read against computing the prefix's tokens after the context before
    them (kvserve/model/compute_shape.py): the engine's cost model has the model's shape, and steps
    of a long prompt measure its rate."""
    from kvserve.model.compute_shape import compute_shape
    with _llm(folder, str(tmp_path / "disk")) as llm:
        _tokens(llm, [3 + (11 * i) % 200 for i in range(300)])
        cost = llm.engine.preemption_cost
        assert cost.shape == compute_shape(llm.engine.source.hf_config)
        assert cost.prefill_tokens_per_s > 0
        bridge = llm.engine.cold
        assert bridge._compute_seconds(64, 0) == cost.recompute_seconds(64)
        assert bridge._compute_seconds(64, 4096) > bridge._compute_seconds(64, 0)
