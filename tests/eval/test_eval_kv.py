"""`kvserve eval-kv` (kvserve.eval.kv_fidelity) through the CLI's own code path: every listed
format on a tiny random Llama with a byte-level tokenizer (so each engine builds in milliseconds),
over a short text and a few tokens each; its refusals; and the two CPU forward paths agreeing at
full precision."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import build_tiny_checkpoint
from kvserve.cli import main
from kvserve.eval.kv_fidelity import DEFAULT_FORMATS, REFERENCE_FORMAT

TEXT = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings "
        "and arrows of outrageous fortune, or to take arms against a sea of troubles and by opposing end "
        "them. To die: to sleep; no more; and by a sleep to say we end the heart-ache and the thousand "
        "natural shocks that flesh is heir to. ")
ENGINE_FLAGS = ["--device", "cpu", "--kv-cache-memory", "8MiB", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    """The tiny random Llama (vocabulary 256) saved with a byte-level tokenizer: one token per
    byte of UTF-8, no merges, no special tokens."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    folder = tmp_path_factory.mktemp("tiny-bytes")
    build_tiny_checkpoint("llama", folder)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={char: index for index, char in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(TEXT * 4)
    return str(path)


@pytest.fixture(scope="module")
def scales_file(chat_model, text_file, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("scales") / "scales.json")
    assert main(["calibrate", "--model", chat_model, "--text", text_file, "--max-text-tokens", "64",
                 "--output", path, *ENGINE_FLAGS]) == 0
    return path


def _eval_kv(chat_model, text_file, formats: list[str], *extra: str) -> list[str]:
    return ["eval-kv", "--model", chat_model, "--text", text_file, "--formats", ",".join(formats),
            "--num-segments", "1", "--segment-len", "8", "--num-prompts", "1", "--prompt-len", "8",
            "--greedy-tokens", "2", *ENGINE_FLAGS, *extra]


def test_eval_kv_runs_every_listed_format(chat_model, text_file, scales_file, tmp_path, capsys):
    """All of DEFAULT_FORMATS, the reference listed last: it runs first, every other format is
    compared with it, and all run through one forward path."""
    names = [name for name in DEFAULT_FORMATS if name != REFERENCE_FORMAT] + [REFERENCE_FORMAT]
    out = tmp_path / "eval.json"
    assert main(_eval_kv(chat_model, text_file, names, "--kv-scales-file", scales_file, "--json", str(out))) == 0
    result = json.loads(out.read_text())
    rows = {row["name"]: row for row in result["formats"]}
    assert [row["name"] for row in result["formats"]] == [REFERENCE_FORMAT] + names[:-1]
    assert result["reference"] == REFERENCE_FORMAT and result["attention_backend"] == "torch"
    for name, row in rows.items():
        assert row["attention_backend"] == "torch", name
        if row["options"].get("kv_press"):
            assert row["perplexity"] is None, name          # not measurable outside the engine's steps
            continue
        assert row["perplexity"]["tokens_scored"] == 7 and row["perplexity"]["perplexity"] > 1, name
        if name == REFERENCE_FORMAT:
            assert row["greedy"] is None and row["perplexity"]["delta_vs_reference_pct"] == 0
        else:
            assert 0 <= row["greedy"]["token_agreement"] <= 1, name
        if DEFAULT_FORMATS[name].get("kv_scales_file"):
            assert row["options"]["kv_scales_file"] == scales_file
    assert rows["int8-static-kv"]["kv_bytes_per_token"] < rows["int8"]["kv_bytes_per_token"]  # no scale bytes
    # What keeps every position exact here measures as the reference does (a 128-token window
    # covers the 8-token segment; the 2-layer model keeps both layers full); what quantizes them
    # all does not.
    reference_ppl = rows[REFERENCE_FORMAT]["perplexity"]["perplexity"]
    for name in ("int4-g32-w128-s4", "int4-g32-window128-only", "int4-g64-w128-s4", "int4-g32-w128-s4+error-feedback",
                 "int4-w128-s4-keys-per-channel", "int8+first/last-2-layers-full"):
        assert rows[name]["perplexity"]["perplexity"] == pytest.approx(reference_ppl, rel=1e-5), name
    assert rows["int4-g32-nowindow-nosinks"]["perplexity"]["delta_vs_reference_pct"] > 0.1
    # The press formats' continuation perplexity: 6 of each 8-token segment prompt (3/4, the
    # default), the last 2 forced and scored, and the reference's by the same procedure.
    assert result["press_prompt_len"] == 6 and result["continuation_tokens_scored"] == 2
    assert rows[REFERENCE_FORMAT]["continuation_perplexity"]["forced_vs_decode_rel_diff"] == pytest.approx(0, abs=1e-5)
    for name, row in rows.items():
        if row["options"].get("kv_press"):
            assert row["continuation_perplexity"]["tokens_scored"] == 2, name
            # 6 prompt tokens are under the 64-token minimum: left whole, so exactly the reference.
            assert row["continuation_perplexity"]["delta_vs_reference_pct"] == 0, name
        elif name != REFERENCE_FORMAT:
            assert row["continuation_perplexity"] is None, name
    log = capsys.readouterr().out.splitlines()
    assert len(log) == len(names) + 1                     # and the reference's continuation line
    assert log[0].startswith(REFERENCE_FORMAT) and "(    ref)  agree    ref" in log[0]
    assert "continuation" in log[1] and "ppl*" in log[1]
    assert all("agree    ref" not in line and "agree    n/a" not in line for line in log[2:])


def test_eval_kv_passkey(chat_model, text_file, tmp_path):
    out = tmp_path / "eval.json"
    # The passkey prompt's fixed text alone is some 300 byte tokens.
    assert main(_eval_kv(chat_model, text_file, ["full", "int4-g32-w128-s4"], "--passkey-len", "24",
                         "--max-model-len", "512", "--json", str(out))) == 0
    for row in json.loads(out.read_text())["formats"]:
        assert row["passkey"]["context_tokens"] == 24 and len(row["passkey"]["trials"]) == 3
        assert 0 <= row["passkey"]["accuracy"] <= 1


def test_eval_kv_says_na_for_what_it_did_not_measure(chat_model, text_file, capsys):
    """Without prompts (or segments) nothing is printed as measured: no "agree 1.000"."""
    args = _eval_kv(chat_model, text_file, ["full", "int8"])
    args[args.index("--num-prompts") + 1] = "0"
    args[args.index("--num-segments") + 1] = "0"
    assert main(args) == 0
    full, int8 = capsys.readouterr().out.splitlines()
    assert "ppl      n/a (    n/a)  agree    ref" in full
    assert "ppl      n/a (    n/a)  agree    n/a  first-div    n/a  passkey n/a" in int8


@pytest.mark.parametrize("extra, problem", [
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype: each format in --formats sets the KV cache options"),
    (["--kv-error-feedback"], "--kv-error-feedback: each format"),
    (["--kv-full-precision-last-layers", "1", "--kv-static-scale-parts", "k"],
     "--kv-full-precision-last-layers, --kv-static-scale-parts: each format"),
    (["--formats", "int8,fp8_e4m3"], "must include 'full'"),
    (["--formats", "full,int8-keys-per-channel"], "int8-keys-per-channel use static scales"),
    (["--formats", "full,int9"], "unknown formats ['int9']"),
    (["--formats", "full,snapkv@0.25", "--press-prompt-len", "8"], "--press-prompt-len must leave a continuation"),
], ids=["kv-cache-dtype", "error-feedback", "two-flags", "no-reference", "no-scales-file", "unknown",
        "no-continuation"])
def test_eval_kv_refuses_what_it_cannot_honour(tmp_path, capsys, extra, problem):
    """Refused before any model loads (the model folder does not exist), with the reason."""
    args = _eval_kv(str(tmp_path / "no-model"), str(tmp_path / "no-text"), ["full", "int8"], *extra)
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert problem in err and "Traceback" not in err


def test_native_and_torch_forward_agree_at_full_precision(tiny_checkpoint):
    """Why eval-kv may run its reference through torch like every quantized format (and what a
    native reference would have added to each difference): the CPU's native forward and the torch
    path give every forced token the same logprob at full precision, prefill and decode steps."""
    from kvserve.engine.engine import Engine
    from kvserve.kernels import cpu as cpu_kernels
    from kvserve.eval.kv_fidelity import teacher_forced_logprobs
    if not cpu_kernels.available():
        pytest.skip("no native CPU kernels here (no C compiler): the torch path is the only CPU forward")
    folder, _ = tiny_checkpoint
    prompts = [list(range(3, 40)), [7, 8, 9]]
    continuations = [[(11 * i + 5) % 250 + 3 for i in range(12)], [(7 * i + 1) % 250 + 3 for i in range(12)]]
    forced = {}
    for backend in ("native", "torch"):
        engine = Engine.from_options(model=folder, device="cpu", kv_cache_memory=1 << 20, attention_backend=backend)
        assert engine.runner.forward_path.name == backend
        forced[backend] = teacher_forced_logprobs(engine, prompts, continuations)
    for native, reference in zip(forced["native"], forced["torch"]):
        torch.testing.assert_close(native, reference, atol=1e-4, rtol=0)


def test_eval_kv_runs_presses_through_the_engine(chat_model, text_file, tmp_path, capsys):
    """A press format prunes the perplexity segments' prompts, the greedy prompts (they pass its
    64-token minimum) and the passkey prompt. Its perplexity is the continuation's, forced through
    the engine's steps after its prompt was pressed, against the reference's by the same procedure
    (decode_perplexity, outside the engine's steps, would be full KV's: not reported for it)."""
    out = tmp_path / "eval.json"
    args = _eval_kv(chat_model, text_file, ["full", "streaming_llm@0.25", "tier:snapkv@0.25"], "--passkey-len",
                    "400", "--max-model-len", "1024", "--press-prompt-len", "120", "--json", str(out))
    args[args.index("--prompt-len") + 1] = "200"
    args[args.index("--greedy-tokens") + 1] = "8"
    args[args.index("--segment-len") + 1] = "160"
    args[args.index("--num-segments") + 1] = "2"
    assert main(args) == 0
    result = json.loads(out.read_text())
    full, pressed, tiered = result["formats"]
    assert result["press_prompt_len"] == 120 and result["continuation_tokens_scored"] == 80
    assert pressed["options"]["kv_press"] == "streaming_llm" and pressed["perplexity"] is None
    assert full["perplexity"]["tokens_scored"] == 2 * 159
    reference = full["continuation_perplexity"]
    assert reference["tokens_scored"] == 80 and abs(reference["forced_vs_decode_rel_diff"]) < 1e-5
    for row, press in ((pressed, "streaming_llm"), (tiered, "snapkv")):
        part = row["continuation_perplexity"]
        assert part["tokens_scored"] == 80 and part["delta_vs_reference_pct"] != 0
        (stats,) = part["presses"]                     # the segments' prompts were pressed
        assert stats["press"] == press and stats["applied"] == 2
    assert pressed["continuation_perplexity"]["presses"][0]["tokens_pruned"] == 2 * (120 - 30)
    assert tiered["continuation_perplexity"]["presses"][0]["tokens_demoted"] > 0
    log = capsys.readouterr().out.splitlines()
    assert log[2].startswith("streaming_llm@0.25") and "ppl*" in log[2] and "(    ref)" not in log[2]
    assert pressed["greedy"] is not None and pressed["passkey"]["trials"]
    (stats,) = pressed["presses"]
    assert stats["press"] == "streaming_llm" and stats["applied"] == 2 + 4 and stats["tokens_pruned"] > 0
    # The tiering mode demotes blocks instead (tokens_pruned stays 0) and ranks them as it decodes.
    (stats,) = tiered["presses"]
    assert stats["press"] == "snapkv" and stats["applied"] > 0 and stats["tokens_demoted"] > 0
    assert stats["tokens_pruned"] == 0 and tiered["passkey"]["trials"]
