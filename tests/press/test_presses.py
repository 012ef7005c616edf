"""KV-cache presses (kvserve.press) against dense references written independently: plain Python
loops over heads and tokens, an explicit per-query softmax under the causal rule, explicit pooling
and explicit merge groups, and each press's keep rule stated directly (sinks + tail, window first,
...) rather than through the scores the presses use to encode it. Also the shared contract: exact
`keep` per head, kept indices increasing, keep == T the identity, the registry, and the errors."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvserve.press import PRESSES, Compressed, PressInputs, keep_top, make_press, press_names
from kvserve.press.h2o import H2OPress
from kvserve.press.knorm import KnormPress
from kvserve.press.similarity_merge import SimilarityMergePress
from kvserve.press.snapkv import SnapKVPress
from kvserve.press.streaming import StreamingLLMPress
from kvserve.press.tova import TOVAPress

KV_HEADS, HEAD_DIM = 2, 8
SHAPES = [(t, heads, w) for t in (7, 33, 64) for heads in (4, 2) for w in (1, 4)]
# A keep boundary closer than this (relative; float32 scores err by ~1e-6 of their size) would make
# the kept set float noise rather than the rule under test.
MARGIN = 1e-5


def make_inputs(t: int, heads: int, w: int, seed: int, runs: bool = False) -> PressInputs:
    """Random keys/values/queries; `runs`: keys in runs of near-copies (what similarity_merge is
    for), so that some neighbours are very similar and some are not."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g)
    if runs:
        run_start = torch.rand(t, KV_HEADS, generator=g) < 0.3
        for h in range(KV_HEADS):
            for i in range(1, t):
                if not run_start[i, h]:
                    keys[i, h] = keys[i - 1, h] + 0.2 * torch.randn(HEAD_DIM, generator=g)
    values = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g)
    queries = 2.0 * torch.randn(w, heads, HEAD_DIM, generator=g)    # sharper attention than unit
    return PressInputs(keys, values, queries, HEAD_DIM ** -0.5)


def case_id(shape) -> str:
    t, heads, w = shape
    return f"T{t}-H{heads}-W{w}"


# --- references -------------------------------------------------------------------------------------

def best(scores: dict[int, float], n: int) -> list[int]:
    """The n highest-scored tokens (ties: the earlier), checking the case has a clear boundary."""
    ranked = sorted(scores, key=lambda i: (-scores[i], i))
    if 0 < n < len(ranked):
        a, b = scores[ranked[n - 1]], scores[ranked[n]]
        gap = a - b
        assert gap > MARGIN * max(abs(a), abs(b)) + 1e-9, f"test data: near-tie at the keep boundary ({gap:.2e}); pick another seed"
    return ranked[:max(n, 0)]


def dot(a: torch.Tensor, b: torch.Tensor) -> float:
    return sum(float(x) * float(y) for x, y in zip(a.tolist(), b.tolist()))


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def query_probs(inputs: PressInputs, head: int, i: int) -> list[float]:
    """Window query i of query head `head`: probabilities over the region's T keys, zero past its
    own position T - W + i (it sits there, so it sees keys 0 .. T - W + i)."""
    t, w = inputs.num_tokens, inputs.queries.shape[0]
    kv = head // (inputs.queries.shape[1] // KV_HEADS)
    sees = t - w + i + 1
    logits = [dot(inputs.queries[i, head], inputs.keys[j, kv]) * inputs.scale for j in range(sees)]
    return softmax(logits) + [0.0] * (t - sees)


def group(inputs: PressInputs, kv: int) -> list[int]:
    size = inputs.queries.shape[1] // KV_HEADS
    return list(range(kv * size, (kv + 1) * size))


def gathered(inputs: PressInputs, kept: list[list[int]]) -> Compressed:
    keys = torch.stack([inputs.keys[idx, h] for h, idx in enumerate(kept)], dim=1)
    values = torch.stack([inputs.values[idx, h] for h, idx in enumerate(kept)], dim=1)
    return Compressed(keys, values, torch.tensor(kept))


def ref_streaming(inputs: PressInputs, keep: int, sinks: int = 4) -> Compressed:
    t = inputs.num_tokens
    first = min(sinks, keep)
    idx = list(range(first)) + list(range(t - (keep - first), t))
    return gathered(inputs, [idx] * KV_HEADS)


def ref_knorm(inputs: PressInputs, keep: int) -> Compressed:
    kept = []
    for h in range(KV_HEADS):
        norms = {j: math.sqrt(dot(inputs.keys[j, h], inputs.keys[j, h])) for j in range(inputs.num_tokens)}
        kept.append(sorted(best({j: -n for j, n in norms.items()}, keep)))
    return gathered(inputs, kept)


def tail_first(t: int, n: int, keep: int) -> list[int]:
    """The protected tail: the last n tokens, or the last `keep` of them when keep < n."""
    return list(range(t - min(n, keep), t))


def ref_snapkv(inputs: PressInputs, keep: int, kernel_size: int = 5) -> Compressed:
    t, w = inputs.num_tokens, inputs.queries.shape[0]
    prefix = t - w
    kept = []
    for kv in range(KV_HEADS):
        heads = group(inputs, kv)
        mean = [0.0] * prefix
        for head in heads:
            for i in range(w):
                p = query_probs(inputs, head, i)
                for j in range(prefix):
                    mean[j] += p[j] / (len(heads) * w)
        r = kernel_size // 2
        pooled = {j: sum(mean[j + o] for o in range(-r, r + 1) if 0 <= j + o < prefix) / kernel_size
                  for j in range(prefix)}
        window = tail_first(t, w, keep)
        kept.append(sorted(best(pooled, keep - len(window)) + window))
    return gathered(inputs, kept)


def ref_tova(inputs: PressInputs, keep: int) -> Compressed:
    """One token set for the layer: the last query's probabilities averaged over every query head."""
    t, w = inputs.num_tokens, inputs.queries.shape[0]
    heads = [head for kv in range(KV_HEADS) for head in group(inputs, kv)]
    mean = [0.0] * t
    for head in heads:
        # The last query sits at T - 1 and so sees the whole region.
        for j, p in enumerate(query_probs(inputs, head, w - 1)):
            mean[j] += p / len(heads)
    kept = sorted(best({j: mean[j] for j in range(t - 1)}, keep - 1) + [t - 1])
    return gathered(inputs, [kept] * KV_HEADS)


def ref_h2o(inputs: PressInputs, keep: int, recent: int = 0) -> Compressed:
    t, w = inputs.num_tokens, inputs.queries.shape[0]
    tail = tail_first(t, min(recent or w, t), keep)
    kept = []
    for kv in range(KV_HEADS):
        heads = group(inputs, kv)
        acc = [0.0] * t
        for head in heads:
            for i in range(w):
                for j, p in enumerate(query_probs(inputs, head, i)):
                    acc[j] += p / len(heads)
        rest = {j: acc[j] for j in range(t) if j not in tail}
        kept.append(sorted(best(rest, keep - len(tail)) + tail))
    return gathered(inputs, kept)


def ref_similarity_merge(inputs: PressInputs, keep: int, threshold: float = 0.0) -> Compressed:
    t = inputs.num_tokens
    kept, keys, values = [], [], []
    for h in range(KV_HEADS):
        k = inputs.keys[:, h]
        cos = {j: dot(k[j], k[j - 1]) / math.sqrt(dot(k[j], k[j]) * dot(k[j - 1], k[j - 1]))
               for j in range(1, t)}
        leaders = sorted([0] + best({j: 1.0 - c for j, c in cos.items()}, keep - 1))
        head_keys, head_values = [], []
        for n, leader in enumerate(leaders):
            end = leaders[n + 1] if n + 1 < len(leaders) else t
            members = [leader] + [j for j in range(leader + 1, end) if threshold <= 0 or cos[j] >= threshold]
            head_keys.append(torch.stack([inputs.keys[j, h].double() for j in members]).mean(dim=0))
            head_values.append(torch.stack([inputs.values[j, h].double() for j in members]).mean(dim=0))
        kept.append(leaders)
        keys.append(torch.stack(head_keys))
        values.append(torch.stack(head_values))
    return Compressed(torch.stack(keys, dim=1).float(), torch.stack(values, dim=1).float(), torch.tensor(kept))


REFERENCES = {
    "streaming_llm": ref_streaming, "knorm": ref_knorm, "snapkv": ref_snapkv, "tova": ref_tova, "h2o": ref_h2o,
    "similarity_merge": ref_similarity_merge,
}


def assert_matches(out: Compressed, ref: Compressed) -> None:
    assert out.kept.tolist() == ref.kept.tolist()
    torch.testing.assert_close(out.keys, ref.keys)
    torch.testing.assert_close(out.values, ref.values)


def assert_contract(out: Compressed, inputs: PressInputs, keep: int) -> None:
    assert out.kept.dtype == torch.int64
    assert tuple(out.kept.shape) == (KV_HEADS, keep)
    assert tuple(out.keys.shape) == tuple(out.values.shape) == (keep, KV_HEADS, HEAD_DIM)
    assert out.keys.dtype == out.values.dtype == torch.float32
    assert bool((out.kept[:, 1:] > out.kept[:, :-1]).all()), "kept indices must increase per head"
    assert 0 <= int(out.kept.min()) and int(out.kept.max()) < inputs.num_tokens


# --- against the references -------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("shape", SHAPES, ids=case_id)
def test_press_matches_its_reference(name, shape):
    t, heads, w = shape
    press = make_press(name)
    inputs = make_inputs(t, heads, w, seed=100 * t + 10 * heads + w, runs=name == "similarity_merge")
    if not press.needs_queries:
        inputs = PressInputs(inputs.keys, inputs.values, None, inputs.scale)     # it must not need them
    for keep in sorted({1, t // 2, t}):
        out = press.compress(inputs, keep)
        assert_contract(out, inputs, keep)
        assert_matches(out, REFERENCES[name](inputs, keep))


@pytest.mark.parametrize("kernel_size", [1, 3, 7])
def test_snapkv_kernel_sizes(kernel_size):
    inputs = make_inputs(40, 4, 4, seed=kernel_size)
    for keep in (2, 6, 20):
        out = SnapKVPress(kernel_size=kernel_size).compress(inputs, keep)
        assert_matches(out, ref_snapkv(inputs, keep, kernel_size))


@pytest.mark.parametrize("recent", [1, 3, 10])
def test_h2o_recent(recent):
    inputs = make_inputs(33, 4, 4, seed=recent)
    for keep in (2, 5, 16):
        assert_matches(H2OPress(recent=recent).compress(inputs, keep), ref_h2o(inputs, keep, recent))


def test_streaming_sinks():
    inputs = make_inputs(20, 2, 1, seed=3)
    for sinks in (0, 1, 6, 25):
        for keep in (1, 4, 10, 20):
            assert_matches(StreamingLLMPress(sinks=sinks).compress(inputs, keep), ref_streaming(inputs, keep, sinks))


@pytest.mark.parametrize("threshold", [0.5, 0.9])
def test_similarity_merge_threshold_drops_unlike_tokens(threshold):
    inputs = make_inputs(33, 2, 1, seed=11, runs=True)
    for keep in (1, 8, 16, 33):
        out = SimilarityMergePress(threshold=threshold).compress(inputs, keep)
        assert_contract(out, inputs, keep)
        assert_matches(out, ref_similarity_merge(inputs, keep, threshold))
        # The threshold decides merge against drop, never which tokens stay.
        assert out.kept.tolist() == SimilarityMergePress().compress(inputs, keep).kept.tolist()


def test_similarity_merge_averages_groups():
    """Two runs of identical keys per head: keep 2 keeps each run's first token, and each becomes
    its run's mean (values differ within a run, so the means are not any one token's)."""
    t = 6
    keys = torch.zeros(t, KV_HEADS, HEAD_DIM)
    keys[:3, :, 0], keys[3:, :, 1] = 1.0, 1.0
    values = torch.arange(t * KV_HEADS * HEAD_DIM, dtype=torch.float32).reshape(t, KV_HEADS, HEAD_DIM)
    out = SimilarityMergePress().compress(PressInputs(keys, values, None, 1.0), 2)
    assert out.kept.tolist() == [[0, 3]] * KV_HEADS
    torch.testing.assert_close(out.values, torch.stack([values[:3].mean(0), values[3:].mean(0)]))
    torch.testing.assert_close(out.keys, torch.stack([keys[0], keys[3]]))


# --- the shared contract ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", press_names())
def test_keep_all_is_the_identity(name):
    inputs = make_inputs(33, 4, 4, seed=5)
    out = make_press(name).compress(inputs, 33)
    assert out.kept.tolist() == [list(range(33))] * KV_HEADS
    assert torch.equal(out.keys, inputs.keys) and torch.equal(out.values, inputs.values)


@pytest.mark.parametrize("name", press_names())
def test_scores_are_float32_per_kv_head(name):
    inputs = make_inputs(17, 4, 4, seed=6)
    scores = make_press(name).score(inputs)
    assert scores.dtype == torch.float32 and tuple(scores.shape) == (KV_HEADS, 17)


@pytest.mark.parametrize("name", [n for n in press_names() if PRESSES[n].needs_queries])
def test_press_needing_queries_refuses_none(name):
    inputs = make_inputs(9, 4, 1, seed=0)
    with pytest.raises(ValueError, match=name):
        make_press(name).compress(PressInputs(inputs.keys, inputs.values, None, inputs.scale), 4)


def test_registry():
    assert press_names() == sorted(["streaming_llm", "knorm", "snapkv", "tova", "h2o", "similarity_merge"])
    classes = {StreamingLLMPress, KnormPress, SnapKVPress, TOVAPress, H2OPress, SimilarityMergePress}
    assert set(PRESSES.values()) == classes
    for name in press_names():
        press = make_press(name)
        assert press.name == name and isinstance(press.needs_queries, bool)
    assert {n for n in press_names() if PRESSES[n].needs_queries} == {"snapkv", "tova", "h2o"}
    with pytest.raises(ValueError, match="kv_press 'nope'.*one of: h2o, knorm"):
        make_press("nope")


def test_bad_tunables_are_refused():
    for bad in (lambda: SnapKVPress(kernel_size=4), lambda: SnapKVPress(kernel_size=0),
                lambda: StreamingLLMPress(sinks=-1), lambda: H2OPress(recent=-1),
                lambda: SimilarityMergePress(threshold=1.5)):
        with pytest.raises(ValueError):
            bad()


def test_window_longer_than_region_is_refused():
    inputs = make_inputs(3, 4, 4, seed=0)
    for name in ("snapkv", "h2o", "tova"):
        with pytest.raises(ValueError, match=name):
            make_press(name).score(inputs)


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova"])
def test_long_region_memory_is_linear_in_tokens(name):
    """T = 32k, W = 64: no tensor larger than the window's attention [W, heads, T] (nothing T x T)."""
    t, heads, w = 32768, 4, 64
    inputs = make_inputs(t, heads, w, seed=0)
    with LargestTensor() as mode:
        out = make_press(name).compress(inputs, t // 8)
    assert mode.largest <= w * heads * t
    protected = 1 if name == "tova" else w        # the last token, or the window
    assert out.kept[:, -protected:].tolist() == [list(range(t - protected, t))] * KV_HEADS


def test_press_package_imports_only_itself():
    """kvserve.press is pure tensor code: the engine imports it, never the reverse."""
    root = Path(__file__).resolve().parents[2] / "kvserve" / "press"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for module in names:
                assert module.split(".")[0] != "kvserve" or module.startswith("kvserve.press"), (path.name, module)


def test_keep_top_ties_go_to_the_earlier_token():
    """Equal scores keep the same tokens on every run: the earliest ones."""
    t = 300
    inputs = make_inputs(t, 2, 1, seed=0)
    scores = torch.zeros(KV_HEADS, t)
    scores[1, 100:] = 1.0
    out = keep_top(inputs, scores, 50)
    assert out.kept.tolist() == [list(range(50)), list(range(100, 150))]
    torch.testing.assert_close(out.keys[:, 1], inputs.keys[100:150, 1])
