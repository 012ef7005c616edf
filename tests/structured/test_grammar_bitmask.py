"""The sampler's grammar mask: the packed bitmask (bit t % 32 of word t // 32) unpacked on the
logits' device forbids exactly the tokens whose bit is clear, and an all-ones row nothing; and a
real xgrammar matcher's mask lets through exactly the tokens its grammar allows."""

from __future__ import annotations

import pytest
import torch

from conftest import requires_cuda, requires_default_model
from kvserve.sampling_params import SamplingParams
from kvserve.worker.sampler import GrammarBitmask, Sampler, SamplingRow, apply_grammar_bitmask


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[rows, V] bool -> [rows, ceil(V / 32)] int32 words, the reference packing."""
    rows, vocab = allowed.shape
    words = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int64)
    for row in range(rows):
        for token in allowed[row].nonzero().flatten().tolist():
            words[row, token // 32] |= 1 << (token % 32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_only_the_allowed_tokens_of_the_constrained_rows_survive(device):
    generator = torch.Generator().manual_seed(0)
    vocab = 100                       # not a multiple of 32: the last word's high bits are past the vocab
    logits = torch.randn(4, vocab, generator=generator)
    allowed = torch.rand(4, vocab, generator=generator) < 0.3
    allowed[:, 31] = True             # bit 31: the sign bit of an int32 word
    allowed[[0, 2]] = True            # rows without a grammar: all ones
    bitmask = _pack(allowed)
    assert (bitmask[[0, 2], :3] == -1).all()
    masked = apply_grammar_bitmask(logits.to(device), GrammarBitmask(bitmask)).cpu()
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    for row in (1, 3):
        keep = allowed[row]
        assert torch.equal(masked[row][keep], logits[row][keep])
        assert torch.isneginf(masked[row][~keep]).all()


def test_a_greedy_row_takes_its_best_allowed_token():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0], [5.0, 4.0, 3.0, 2.0]])
    allowed = torch.tensor([[False, False, True, True], [True, True, True, True]])
    rows = [SamplingRow(SamplingParams(temperature=0), [1], []) for _ in range(2)]
    result = Sampler()(logits, rows, set(), GrammarBitmask(_pack(allowed)))
    assert result.token_ids == [2, 0]


@requires_default_model
def test_xgrammar_masks_follow_the_grammar():
    from kvserve.model.loader import resolve_model
    from kvserve.structured.grammar import GrammarCompiler, GrammarMatcher, bitmask_words
    from kvserve.structured.params import StructuredOutputParams

    tokenizer = resolve_model(None).load_tokenizer()
    vocab = len(tokenizer)
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    matcher = GrammarMatcher(compiler.compile(StructuredOutputParams(choice=["yes", "no"])))
    bitmask = torch.empty(1, bitmask_words(vocab), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    logits = apply_grammar_bitmask(torch.zeros(1, vocab), GrammarBitmask(bitmask))
    allowed = {tokenizer.decode([t]) for t in torch.isfinite(logits[0]).nonzero().flatten().tolist()}
    assert allowed and all("yes".startswith(text) or "no".startswith(text) for text in allowed), allowed
    assert {"yes", "no"} & allowed or {"y", "n"} & allowed
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert all(matcher.accept(t) for t in yes)
    assert not matcher.is_terminated and not matcher.accept(yes[0])     # nothing but the end may follow
    assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated


@requires_default_model
def test_length_bounded_strings_keep_control_characters_out():
    """xgrammar 0.2.9 lets raw control characters into minLength / maxLength strings; the compiler
    rewrites those bounds as a pattern of JSON characters (grammar._bound_strings)."""
    from kvserve.model.loader import resolve_model
    from kvserve.structured.grammar import GrammarCompiler, GrammarMatcher, bitmask_words
    from kvserve.structured.params import StructuredOutputParams

    tokenizer = resolve_model(None).load_tokenizer()
    vocab = len(tokenizer)
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 4}},
              "required": ["name"], "additionalProperties": False}
    matcher = GrammarMatcher(GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id]).compile(
        StructuredOutputParams(json=schema)))
    prefix = tokenizer.encode('{"name": "a', add_special_tokens=False)
    assert all(matcher.accept(t) for t in prefix)
    bitmask = torch.empty(1, bitmask_words(vocab), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    allowed = torch.isfinite(apply_grammar_bitmask(torch.zeros(1, vocab), GrammarBitmask(bitmask))[0])
    control = [t for t in range(vocab) if any(ord(c) < 32 for c in tokenizer.decode([t]))]
    assert control and not allowed[control].any()
    quote = tokenizer.encode('"', add_special_tokens=False)
    assert not allowed[quote[0]]                              # minLength 2: "a" is too short
    for token in tokenizer.encode('bcd', add_special_tokens=False):
        assert matcher.accept(token)
    assert not matcher.accept(tokenizer.encode('e', add_special_tokens=False)[0])     # maxLength 4
