"""The `kvserve` command line: flags map onto engine options; errors name the problem."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import TEST_DEVICE, requires_default_model
from kvserve.cli import build_parser, main
from kvserve.config import engine_options_from_args


def test_every_engine_option_is_a_flag():
    args = build_parser().parse_args(["generate", "hi", "--block-size", "32", "--kv-cache-memory", "512MiB",
                                      "--max-num-seqs", "4", "--no-enable-chunked-prefill", "--dtype", "bf16"])
    options = engine_options_from_args(args)
    assert options["block_size"] == 32 and options["kv_cache_memory"] == 512 << 20
    assert options["max_num_seqs"] == 4 and options["enable_chunked_prefill"] is False
    assert options["dtype"] == "bf16"


def test_missing_model_is_a_clear_cli_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--model", str(tmp_path / "nope")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err and "nope" in err and "Traceback" not in err


def test_bench_writes_json(tiny_checkpoint, tmp_path):
    """Also: the command freezes its start-up objects out of the garbage collector's generations
    (engine.freeze_startup_objects); undone here, since the test process goes on building engines."""
    import gc
    folder, _ = tiny_checkpoint
    out = tmp_path / "bench.json"
    gc.unfreeze()
    try:
        assert main(["bench", "--model", folder, "--device", TEST_DEVICE, "--batch-sizes", "1,4", "--input-len", "8",
                     "--output-len", "4", "--kv-cache-memory", "4MiB", "--json", str(out)]) == 0
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    record = json.loads(out.read_text())
    points = record["points"]
    assert [p["batch_size"] for p in points] == [1, 4]
    assert all(p["output_tokens_per_s"] > 0 and p["extra"]["peak_kv_usage"] > 0 for p in points)
    assert record["command"].startswith("kvserve bench")


def test_bench_reports_the_host_tier(tiny_checkpoint, tmp_path):
    """With --kv-host-memory, each point's JSON carries the host tier's counters."""
    import gc
    folder, _ = tiny_checkpoint
    out = tmp_path / "bench.json"
    try:
        assert main(["bench", "--model", folder, "--device", TEST_DEVICE, "--batch-sizes", "2", "--input-len", "8",
                     "--output-len", "4", "--kv-cache-memory", "4MiB", "--kv-host-memory", "1MiB",
                     "--json", str(out)]) == 0
    finally:
        gc.unfreeze()
    host = json.loads(out.read_text())["points"][0]["extra"]["kv_host"]
    assert host["num_blocks"] > 0 and set(host) >= {"hit_tokens", "blocks_written", "blocks_loaded", "swapped_out"}


def test_bench_reports_the_cold_tiers_hits_by_tier(tiny_checkpoint, tmp_path):
    """With --kv-disk-path, each point's JSON carries the disk tier's counters and its hit tokens; a
    second bench on the same directory (a restart) finds the first one's blocks."""
    import gc
    folder, _ = tiny_checkpoint
    points = []
    for run in range(2):
        out = tmp_path / f"bench{run}.json"
        try:
            assert main(["bench", "--model", folder, "--device", TEST_DEVICE, "--batch-sizes", "2", "--input-len",
                         "40", "--output-len", "4", "--block-size", "4", "--kv-cache-memory", "4MiB",
                         "--kv-host-memory", "1MiB", "--kv-disk-path", str(tmp_path / "kv"), "--kv-disk-size",
                         "64MiB", "--json", str(out)]) == 0
        finally:
            gc.unfreeze()
        points.append(json.loads(out.read_text())["points"][0]["extra"])
    (disk,) = points[0]["kv_tiers"]
    assert disk["name"] == "disk" and disk["blocks_written"] > 0
    assert points[1]["kv_tier_hit_tokens"].get("disk", 0) > 0


CAPITAL_QUESTION = "What is the capital of France? Answer in one sentence."


@requires_default_model
def test_generate_default_model_subprocess():
    # The bare question is a coin toss for the 135M model (first-token margin under 0.15 nats, kept
    # blocks or not); asking for a sentence gives a margin near 1.5, so this checks the wiring.
    proc = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", CAPITAL_QUESTION,
                           "--max-tokens", "16", "--kv-cache-memory", "64MiB", "--device", "cpu"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@requires_default_model
def test_interactive_chat_streams_a_reply():
    proc = subprocess.run([sys.executable, "-m", "kvserve.cli", "chat", "--max-tokens", "16", "--kv-cache-memory",
                           "64MiB", "--device", "cpu"], input=CAPITAL_QUESTION + "\n/reset\n",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
