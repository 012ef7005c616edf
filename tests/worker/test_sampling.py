"""Tests for kvserve.sampling_params and kvserve.worker.sampler (CPU, fast)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch

from kvserve.sampling_params import SamplingParams
from kvserve.worker.sampler import (
    SampleResult,
    Sampler,
    SamplingRow,
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    compute_prompt_logprobs,
    make_generator,
    token_counts,
)

EOS = 3


def row(params: Optional[SamplingParams] = None, prompt: Optional[list[int]] = None,
        output: Optional[list[int]] = None,
        generator: Optional[torch.Generator] = None) -> SamplingRow:
    return SamplingRow(params=params or SamplingParams(), prompt_token_ids=prompt or [],
                       output_token_ids=output or [], generator=generator)


def sample(logits: list[list[float]] | torch.Tensor, rows: list[SamplingRow],
           eos: Optional[set[int]] = None) -> SampleResult:
    tensor = torch.as_tensor(logits, dtype=torch.float32)
    return Sampler()(tensor, rows, {EOS} if eos is None else eos)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ------------------------------------------------------------------------------------------
# SamplingParams
# ------------------------------------------------------------------------------------------


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (16, 0, None,
                                                                                   None, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.is_greedy


def test_stop_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 6)).stop_token_ids == [5, 6]


def test_built_from_json_dict_and_replace() -> None:
    body = {"temperature": 0, "top_k": 5, "stop": "x", "max_tokens": None, "logprobs": 3}
    p = SamplingParams(**body)
    assert p.is_greedy and p.stop == ["x"] and p.max_tokens is None
    q = dataclasses.replace(p, temperature=0.5)
    assert not q.is_greedy and q.stop == ["x"]


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.1), ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 2.1), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -1), ("logprobs", 21),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("temperature", float("nan")),
    ("temperature", float("inf")), ("n", "2"), ("top_k", 1.5), ("seed", "abc"),
    ("stop", [1]), ("stop_token_ids", ["a"]),
])
def test_validation_errors_name_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value)
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_min_tokens_above_max_tokens_rejected() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    assert SamplingParams(min_tokens=10, max_tokens=None).min_tokens == 10
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5


def test_boundary_values_accepted() -> None:
    p = SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                       logprobs=20, prompt_logprobs=0, temperature=0.0)
    assert p.is_greedy and p.logprobs == 20


def test_is_greedy_threshold() -> None:
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


# ------------------------------------------------------------------------------------------
# Greedy, temperature, top-k, top-p, min-p
# ------------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    result = sample(logits, [row(greedy()) for _ in range(8)])
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 8 and result.ranks == [None] * 8


def test_input_logits_not_modified_and_bf16_accepted() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    before = logits.clone()
    rows = [row(SamplingParams(repetition_penalty=1.5, top_k=3, top_p=0.5, min_p=0.1,
                               presence_penalty=1.0), prompt=[1, 2], output=[3, 4])
            for _ in range(3)]
    Sampler()(logits, rows, {EOS})
    assert torch.equal(logits, before)
    out = Sampler()(logits.to(torch.bfloat16), [row(greedy()) for _ in range(3)], set())
    assert out.token_ids == logits.to(torch.bfloat16).float().argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_sampling_matches_softmax(temperature: float) -> None:
    torch.manual_seed(1234)
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    draws = 20000
    result = sample(base.expand(draws, -1), [row(SamplingParams(temperature=temperature))
                                             for _ in range(draws)], eos=set())
    counts = torch.bincount(torch.tensor(result.token_ids), minlength=5).float()
    stat = chi_square(counts, torch.softmax(base / temperature, -1))
    assert stat < 18.47  # chi-square, 4 dof, p = 0.001
    # A wrong temperature would be detected: compare against the untempered softmax too.
    if temperature != 1.0:
        assert chi_square(counts, torch.softmax(base, -1)) > 100


def test_top_k_only_yields_top_k_ids() -> None:
    torch.manual_seed(0)
    base = torch.tensor([0.1, 2.0, -1.0, 1.9, 0.5, 1.8, 0.0, -3.0])
    draws = 4000
    result = sample(base.expand(draws, -1), [row(SamplingParams(top_k=3)) for _ in range(draws)])
    assert set(result.token_ids) == {1, 3, 5}


def test_top_k_disabled_values() -> None:
    torch.manual_seed(0)
    base = torch.zeros(4)
    for k in (0, -1, 10):
        result = sample(base.expand(2000, -1), [row(SamplingParams(top_k=k)) for _ in range(2000)],
                        eos=set())
        assert set(result.token_ids) == {0, 1, 2, 3}


def test_top_p_keeps_nucleus() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(3000, -1)
    for top_p, nucleus in ((0.4, {1}), (0.75, {1, 3}), (0.85, {1, 2, 3}), (1.0, {0, 1, 2, 3})):
        result = sample(logits, [row(SamplingParams(top_p=top_p)) for _ in range(3000)], eos=set())
        assert set(result.token_ids) == nucleus, top_p


def test_top_p_renormalises_within_nucleus() -> None:
    torch.manual_seed(5)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = 20000
    result = sample(probs.log().expand(draws, -1),
                    [row(SamplingParams(top_p=0.75)) for _ in range(draws)], eos=set())
    counts = torch.bincount(torch.tensor(result.token_ids), minlength=4).float()
    assert counts[2:].sum() == 0
    assert chi_square(counts[:2], torch.tensor([0.625, 0.375])) < 10.83  # 1 dof, p = 0.001


def test_min_p() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.4, 0.3, 0.19, 0.11])
    logits = probs.log().expand(3000, -1)
    # threshold = min_p * 0.4: 0.5 -> 0.2 keeps {0, 1}; 0.25 -> 0.1 keeps all.
    result = sample(logits, [row(SamplingParams(min_p=0.5)) for _ in range(3000)], eos=set())
    assert set(result.token_ids) == {0, 1}
    result = sample(logits, [row(SamplingParams(min_p=0.25)) for _ in range(3000)], eos=set())
    assert set(result.token_ids) == {0, 1, 2, 3}


def test_mixed_batch_each_row_uses_its_own_params() -> None:
    torch.manual_seed(0)
    base = torch.tensor([3.0, 2.9, 2.8, 2.7, -5.0, -5.0])
    rows = [row(greedy()), row(SamplingParams(top_k=1)), row(SamplingParams(top_k=2)),
            row(SamplingParams()), row(SamplingParams(min_p=0.99))]
    seen: list[set[int]] = [set() for _ in rows]
    for _ in range(300):
        for i, token in enumerate(sample(base.expand(len(rows), -1), rows, eos=set()).token_ids):
            seen[i].add(token)
    assert seen[0] == {0} and seen[1] == {0} and seen[2] == {0, 1} and seen[4] == {0}
    assert {0, 1, 2, 3} <= seen[3]


# ------------------------------------------------------------------------------------------
# Penalties and min_tokens
# ------------------------------------------------------------------------------------------


def test_repetition_penalty_formula_positive_logit() -> None:
    logits = [[2.0, 1.9, 0.0, -1.0]]
    # 2.0 / p < 1.9 iff p > 2.0 / 1.9 = 1.0526...
    assert sample(logits, [row(greedy(repetition_penalty=1.04), prompt=[0])]).token_ids == [0]
    assert sample(logits, [row(greedy(repetition_penalty=1.06), prompt=[0])]).token_ids == [1]
    # The penalty covers generated tokens as well as the prompt.
    assert sample(logits, [row(greedy(repetition_penalty=1.06), output=[0])]).token_ids == [1]
    # Penalty < 1 rewards seen tokens.
    assert sample(logits, [row(greedy(repetition_penalty=0.5), prompt=[2])]).token_ids == [0]


def test_repetition_penalty_formula_negative_logit() -> None:
    logits = [[-1.0, -1.05, -4.0, -9.0]]
    # -1.0 * p < -1.05 iff p > 1.05: negative logits are multiplied, not divided.
    assert sample(logits, [row(greedy(repetition_penalty=1.04), prompt=[0])]).token_ids == [0]
    assert sample(logits, [row(greedy(repetition_penalty=1.06), prompt=[0])]).token_ids == [1]


def test_repetition_penalty_exact_values() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0], [2.0, -2.0, 1.0]])
    seen = torch.tensor([[True, True, False], [True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0, 1.0]))
    assert torch.allclose(out, torch.tensor([[1.0, -4.0, 1.0], [2.0, -2.0, 1.0]]))


def test_frequency_penalty_formula() -> None:
    logits = [[3.0, 1.6, 0.0, 0.0]]
    # 3.0 - 0.5 * count: 2 repeats -> 2.0 (> 1.6), 3 repeats -> 1.5 (< 1.6).
    assert sample(logits, [row(greedy(frequency_penalty=0.5), output=[0, 0])]).token_ids == [0]
    assert sample(logits, [row(greedy(frequency_penalty=0.5), output=[0, 0, 0])]).token_ids == [1]
    # Prompt tokens are not counted.
    assert sample(logits, [row(greedy(frequency_penalty=2.0), prompt=[0, 0])]).token_ids == [0]
    # A negative penalty encourages repetition.
    assert sample([[1.0, 1.2]], [row(greedy(frequency_penalty=-0.3), output=[0])]).token_ids == [0]


def test_presence_penalty_formula() -> None:
    logits = [[3.0, 2.5, 0.0, 0.0]]
    # Subtracted once whatever the count.
    assert sample(logits, [row(greedy(presence_penalty=0.4), output=[0] * 5)]).token_ids == [0]
    assert sample(logits, [row(greedy(presence_penalty=0.6), output=[0])]).token_ids == [1]
    assert sample(logits, [row(greedy(presence_penalty=0.6), prompt=[0])]).token_ids == [0]


def test_frequency_presence_exact_values_and_counts() -> None:
    counts = token_counts([[0, 0, 2], [], [1, 99, -1]], 3, torch.device("cpu"))
    assert counts.tolist() == [[2, 0, 1], [0, 0, 0], [0, 1, 0]]
    out = apply_frequency_presence_penalties(torch.zeros(3, 3), counts,
                                             torch.tensor([0.5, 1.0, 0.25]),
                                             torch.tensor([0.1, 1.0, 1.0]))
    assert torch.allclose(out, torch.tensor([[-1.1, 0.0, -0.6], [0, 0, 0], [0, -1.25, 0]]))


def test_penalties_only_affect_their_own_rows() -> None:
    logits = [[2.0, 1.9, 0.0, 0.0]] * 2
    rows = [row(greedy(repetition_penalty=1.5), prompt=[0]), row(greedy(), prompt=[0])]
    assert sample(logits, rows).token_ids == [1, 0]
    rows = [row(greedy(), output=[0]), row(greedy(presence_penalty=1.0), output=[0])]
    assert sample(logits, rows).token_ids == [0, 1]


def test_min_tokens_masks_eos_and_stop_token_ids() -> None:
    logits = [[0.0, 1.0, 5.0, 9.0]]  # EOS (3) is the argmax, stop token 2 next
    p = greedy(min_tokens=2, stop_token_ids=[2])
    assert sample(logits, [row(p, output=[])]).token_ids == [1]
    assert sample(logits, [row(p, output=[1])]).token_ids == [1]
    assert sample(logits, [row(p, output=[1, 1])]).token_ids == [3]
    # ignore_eos does not lift the min_tokens mask.
    p2 = greedy(min_tokens=1, ignore_eos=True)
    assert sample(logits, [row(p2)]).token_ids == [2]
    # Several EOS ids are all masked.
    assert sample(logits, [row(greedy(min_tokens=1))], eos={2, 3}).token_ids == [1]


def test_min_tokens_masks_eos_when_sampling() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 1.0, 1.0, 3.0]).expand(500, -1)
    result = sample(logits, [row(SamplingParams(min_tokens=1)) for _ in range(500)])
    assert EOS not in result.token_ids and set(result.token_ids) == {0, 1, 2}


# ------------------------------------------------------------------------------------------
# Seeds
# ------------------------------------------------------------------------------------------


def _run_steps(logits: torch.Tensor, rows: list[SamplingRow], steps: int) -> list[list[int]]:
    sampler, out = Sampler(), []
    for _ in range(steps):
        out.append(sampler(logits, rows, set()).token_ids)
    return out


def test_seed_reproducible_regardless_of_batch() -> None:
    vocab = 100
    logits_row = torch.randn(vocab, generator=torch.Generator().manual_seed(7))
    seeded = SamplingParams(seed=42, top_k=50, top_p=0.95)
    other = SamplingParams(seed=7)

    def seeded_row() -> SamplingRow:
        return row(seeded, generator=make_generator(seeded, "cpu"))

    alone = [t[0] for t in _run_steps(logits_row.unsqueeze(0), [seeded_row()], 10)]
    torch.manual_seed(1)
    mixed_rows = [row(SamplingParams()), seeded_row(), row(other, generator=make_generator(other,
                                                                                           "cpu")),
                  row(greedy())]
    mixed = [t[1] for t in _run_steps(torch.randn(4, vocab).index_copy(
        0, torch.tensor([1]), logits_row.unsqueeze(0)), mixed_rows, 10)]
    torch.manual_seed(2)
    reversed_rows = [row(greedy()), row(SamplingParams()), seeded_row()]
    reordered = [t[2] for t in _run_steps(torch.stack([torch.randn(vocab), torch.randn(vocab),
                                                       logits_row]), reversed_rows, 10)]
    assert alone == mixed == reordered
    assert len(set(alone)) > 1  # really sampling, not a constant
    other_seed = SamplingParams(seed=43, top_k=50, top_p=0.95)
    different = [t[0] for t in _run_steps(
        logits_row.unsqueeze(0), [row(other_seed, generator=make_generator(other_seed, "cpu"))],
        10)]
    assert different != alone


def test_make_generator() -> None:
    assert make_generator(SamplingParams(), "cpu") is None
    g = make_generator(SamplingParams(seed=3), "cpu")
    assert g is not None and g.initial_seed() == 3


# ------------------------------------------------------------------------------------------
# Logprobs
# ------------------------------------------------------------------------------------------


def test_logprobs_are_raw_and_contain_sampled_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    raw = torch.log_softmax(logits, -1)
    rows = [row(SamplingParams(logprobs=3, temperature=0.7, repetition_penalty=1.3,
                               presence_penalty=0.5), prompt=[1, 2], output=[5]),
            row(SamplingParams()),
            row(SamplingParams(logprobs=0, top_k=5)),
            row(greedy(logprobs=5))]
    result = sample(logits, rows)
    assert result.logprobs[1] is None and result.ranks[1] is None
    for i, n in ((0, 3), (2, 0), (3, 5)):
        entry, token = result.logprobs[i], result.token_ids[i]
        assert entry is not None and token in entry
        top_ids = raw[i].topk(n).indices.tolist()
        assert set(entry) == set(top_ids) | {token}
        for tok, lp in entry.items():
            assert lp == pytest.approx(raw[i, tok].item(), abs=1e-5)
        assert list(entry)[0] == token
        assert result.ranks[i] == int((raw[i] > raw[i, token]).sum()) + 1
    assert result.ranks[3] == 1


def test_rank_of_penalised_choice() -> None:
    logits = [[2.0, 1.9, 0.0, -1.0]]
    result = sample(logits, [row(greedy(repetition_penalty=2.0, logprobs=1), prompt=[0])])
    assert result.token_ids == [1] and result.ranks == [2]
    raw = torch.log_softmax(torch.tensor(logits[0]), -1)
    assert result.logprobs[0] == pytest.approx({1: raw[1].item(), 0: raw[0].item()})


# ------------------------------------------------------------------------------------------
# Prompt logprobs
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1024, 2])
def test_compute_prompt_logprobs(chunk_size: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 12)
    next_ids = [3, 0, 11, 7, 7]
    raw = torch.log_softmax(logits, -1)
    out = compute_prompt_logprobs(logits, torch.tensor(next_ids), 2, chunk_size=chunk_size)
    assert len(out) == 5
    for t, entry in enumerate(out):
        assert list(entry)[0] == next_ids[t]
        assert set(entry) == {next_ids[t]} | set(raw[t].topk(2).indices.tolist())
        for tok, lp in entry.items():
            assert lp == pytest.approx(raw[t, tok].item(), abs=1e-5)
    only = compute_prompt_logprobs(logits, next_ids, 0)
    assert [list(e) for e in only] == [[i] for i in next_ids]
    assert math.isclose(only[2][11], raw[2, 11].item(), abs_tol=1e-5)


def test_compute_prompt_logprobs_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        compute_prompt_logprobs(torch.zeros(3, 4), [1, 2], 1)
    with pytest.raises(ValueError):
        compute_prompt_logprobs(torch.zeros(3, 4), [1, 2, 3], -1)


def test_sampler_rejects_row_count_mismatch() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 4), [row()], set())


def test_seed_out_of_generator_range_is_rejected():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-1)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63, n=1)
    assert SamplingParams(seed=2**63 - 3, n=2).seed == 2**63 - 3
