"""The batched sampler: one step's logits for a whole batch -> one token per row.

Everything after the per-row parameter gathering runs as whole-batch tensor ops on the logits'
device: per-row Python loops only touch small things (parameter lists, token-id lists), never the
vocabulary. The per-request parameters are `kvserve.sampling_params.SamplingParams`.

Processing order (the one vLLM and HF use, so outputs are comparable):

1. raw logprobs (log_softmax of the untouched logits) for rows that asked for logprobs;
2. min_tokens: EOS and stop_token_ids are masked until the request has min_tokens outputs;
   structured output: tokens its grammar does not allow next are masked (a bitmask per row);
3. repetition penalty (HF style, over prompt + output tokens);
4. frequency / presence penalties (OpenAI style, over output tokens only);
5. greedy rows take the argmax of the penalised logits;
6. other rows: temperature, top-k, top-p, min-p, then an exponential-race draw;
7. rows with a forced token (teacher forcing, internal) take it instead; their logprobs are its.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from kvserve.sampling_params import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str) -> Optional[torch.Generator]:
    """The per-request generator a seeded request needs, created once and reused every step,
    so its draws do not depend on which other requests share the batch."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


# --------------------------------------------------------------------------------------------
# Sampler inputs / outputs
# --------------------------------------------------------------------------------------------


@dataclass
class SamplingRow:
    """One row of the logits: a request about to receive its next token."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Set when params.seed is; created once per request on the logits' device (make_generator).
    generator: Optional[torch.Generator] = None
    # Teacher forcing (an internal request option, kvserve/eval/forced_decoding.py): the row takes
    # this token instead of sampling, and its logprobs are those of this token.
    forced_token_id: Optional[int] = None


@dataclass
class GrammarBitmask:
    """The tokens each row may take next (structured output, kvserve/structured): bit t % 32 of word
    t // 32 of a row set means token t is allowed. Rows without a grammar are all ones, so the mask
    covers the whole batch and needs no row index (a host index list copied to the device would wait
    for the forward queued before it, which a launched-ahead step must not)."""
    bitmask: torch.Tensor       # [rows, ceil(V / 32)] int32, on the host (pinned for CUDA)


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row, when params.logprobs is set: {sampled id: lp, then the top-N ids: lp}, taken from
    # the raw model distribution (before penalties and temperature), as vLLM does by default.
    logprobs: list[Optional[dict[int, float]]]
    # Rank of the sampled token in that raw distribution (1 = most likely), when logprobs is set.
    ranks: list[Optional[int]]


@dataclass
class LogprobTensors:
    """What the rows that asked for logprobs need, still on the device (or copied to pinned host
    memory without a wait): a launched-ahead step reads them when it reads its tokens."""
    row_ids: list[int]          # the rows these belong to
    chosen: torch.Tensor        # [n] the sampled ids
    chosen_logprobs: torch.Tensor   # [n]
    ranks: torch.Tensor         # [n] 1 + the number of ids more likely than the sampled one
    top_logprobs: torch.Tensor  # [n, top]
    top_ids: torch.Tensor       # [n, top]

    def to_host(self) -> "LogprobTensors":
        """Copies that start now and land with the stream's next event (pinned on CUDA)."""
        def copy(tensor: torch.Tensor) -> torch.Tensor:
            if not tensor.is_cuda:
                return tensor
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor, non_blocking=True)
        return LogprobTensors(self.row_ids, copy(self.chosen), copy(self.chosen_logprobs), copy(self.ranks),
                              copy(self.top_logprobs), copy(self.top_ids))

    def entries(self, rows: list["SamplingRow"]) -> tuple[list[Optional[dict[int, float]]], list[Optional[int]]]:
        """Per row of the batch: {sampled id: lp, then each row's top-N ids: lp} and the rank
        (None for rows that did not ask); reads the tensors on the host."""
        logprobs: list[Optional[dict[int, float]]] = [None] * len(rows)
        ranks: list[Optional[int]] = [None] * len(rows)
        chosen, chosen_lp, rank, top_lp, top_ids = (t.tolist() for t in (
            self.chosen, self.chosen_logprobs, self.ranks, self.top_logprobs, self.top_ids))
        for j, i in enumerate(self.row_ids):
            n = rows[i].params.logprobs
            entry = {chosen[j]: chosen_lp[j]}
            for token, lp in zip(top_ids[j][:n], top_lp[j][:n]):
                entry.setdefault(token, lp)
            logprobs[i], ranks[i] = entry, rank[j]
        return logprobs, ranks


# --------------------------------------------------------------------------------------------
# Batched logit processors (each returns a new tensor; callers' logits are never modified)
# --------------------------------------------------------------------------------------------


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device) -> torch.Tensor:
    """[N, V] float counts of each token id per row, built with one index_add.

    Rows are flattened into a single id list (one host->device copy) rather than padded, so a
    long prompt in one row does not pad every other row. Ids outside [0, V) are ignored: they
    cannot be penalised because they have no logit.
    """
    num_rows = len(token_lists)
    counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    lengths = [len(tokens) for tokens in token_lists]
    if sum(lengths) == 0:
        return counts.view(num_rows, vocab_size)
    flat = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    row_of = torch.repeat_interleave(torch.arange(num_rows), torch.tensor(lengths))
    valid = (flat >= 0) & (flat < vocab_size)
    index = (row_of[valid] * vocab_size + flat[valid]).to(device, non_blocking=True)
    counts.index_add_(0, index, torch.ones(index.numel(), dtype=torch.float32, device=device))
    return counts.view(num_rows, vocab_size)


def apply_token_mask(logits: torch.Tensor, banned: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set logits[i, t] = -inf for every t in banned[i] (out-of-range ids are ignored)."""
    vocab_size = logits.shape[-1]
    pairs = [(i, t) for i, ids in enumerate(banned) for t in ids if 0 <= t < vocab_size]
    if not pairs:
        return logits
    index = torch.tensor(pairs, dtype=torch.long).to(logits.device)
    return logits.index_put((index[:, 0], index[:, 1]),
                            torch.tensor(float("-inf"), device=logits.device))


def min_tokens_bans(rows: Sequence[SamplingRow], eos_token_ids: set[int]) -> list[list[int]]:
    """Token ids each row may not produce yet: EOS and stop_token_ids while the request has
    fewer than min_tokens outputs. EOS is masked even with ignore_eos: ignore_eos only means an
    EOS does not stop the request, and min_tokens promises no EOS before the minimum."""
    bans: list[list[int]] = []
    for row in rows:
        params = row.params
        if len(row.output_token_ids) < params.min_tokens:
            bans.append(sorted(set(eos_token_ids) | set(params.stop_token_ids)))
        else:
            bans.append([])
    return bans


_BIT_POSITIONS: dict[torch.device, torch.Tensor] = {}


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask) -> torch.Tensor:
    """-inf for every token a row's grammar forbids. The bits are unpacked on the logits' device
    (a [rows, V] bool mask from [rows, V / 32] words), so the host sends 1/32 of a byte mask."""
    device, vocab_size = logits.device, logits.shape[-1]
    bits = _BIT_POSITIONS.get(device)
    if bits is None:
        bits = _BIT_POSITIONS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = grammar.bitmask.to(device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().view(words.shape[0], -1)[:, :vocab_size]
    return logits.masked_fill(~allowed, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor,
                             penalties: torch.Tensor) -> torch.Tensor:
    """HF/CTRL repetition penalty on tokens already seen (prompt + output).

    Positive logits are divided and negative ones multiplied, so a penalty > 1 always makes a
    seen token less likely whatever the sign of its logit. `seen` is a bool [N, V] mask,
    `penalties` a [N] tensor (1.0 = no-op).
    """
    penalty = penalties.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_frequency_presence_penalties(logits: torch.Tensor, output_counts: torch.Tensor,
                                       frequency: torch.Tensor,
                                       presence: torch.Tensor) -> torch.Tensor:
    """OpenAI penalties: logit -= frequency * count + presence * (count > 0), counting only
    generated tokens (the prompt is the user's text, not the model's repetition)."""
    present = (output_counts > 0).to(logits.dtype)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * present


def apply_top_k_top_p(logits: torch.Tensor, top_k: Optional[torch.Tensor],
                      top_p: Optional[torch.Tensor]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus, with one sort.

    top_k is [N] long (values >= V mean disabled); top_p is [N] float (values >= 1 mean
    disabled). The nucleus is the smallest prefix of the sorted distribution whose cumulative
    probability reaches top_p: a token is kept when the probability mass strictly above it is
    still < top_p, which always keeps the most likely token. Masking is by sorted position, so
    ties at the k-th logit cannot let more than k tokens through.
    """
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        positions = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(positions >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_above = probs.cumsum(dim=-1) - probs
        remove = (mass_above >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_index, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability
    (min_p = 0 keeps everything)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax; on CPU through the native kernel (torch's CPU argmax is scalar)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1]:
        from kvserve.kernels import cpu as cpu_kernels
        if cpu_kernels.available():
            return cpu_kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


def exponential_race(probs: torch.Tensor,
                     generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
    """Draw one token per row: argmax(p / q) with q ~ Exp(1) picks token i with probability p_i.

    This avoids torch.multinomial's per-row sync-heavy path and lets each seeded row take its
    noise from its own generator: the row's draw then depends only on its generator's state
    and its probabilities, not on the batch around it. Unseeded rows share one draw from the
    default generator.
    """
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    elif unseeded:
        index = torch.tensor(unseeded, device=probs.device)
        noise[index] = torch.empty(len(unseeded), probs.shape[-1], dtype=probs.dtype,
                                   device=probs.device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            _check_generator_device(generator, probs.device)
            noise[i].exponential_(generator=generator)
    # Exp(1) can return exactly 0 on some backends; 0/0 would be NaN for masked tokens.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def _check_generator_device(generator: torch.Generator, device: torch.device) -> None:
    if generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device} but logits are on {device}; "
                         "create seeded generators on the logits' device")


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


def _index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def _float_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


class Sampler:
    """Picks one token per row of a batch's logits, according to each row's SamplingParams.

    Stages nobody in the batch needs are skipped (no sort without top-k/top-p, no count
    tensors without penalties, no softmax when every row is greedy).
    """

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 eos_token_ids: set[int], grammar: Optional[GrammarBitmask] = None) -> SampleResult:
        """`select`, then the tokens and logprobs read on the host."""
        if not rows and logits.dim() == 2 and logits.shape[0] == 0:
            return SampleResult(token_ids=[], logprobs=[], ranks=[])
        token_ids, logprobs = self.select(logits, rows, eos_token_ids, grammar)
        entries, ranks = logprobs.entries(rows) if logprobs is not None else ([None] * len(rows), [None] * len(rows))
        return SampleResult(token_ids=token_ids.tolist(), logprobs=entries, ranks=ranks)

    def select(self, logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: set[int],
               grammar: Optional[GrammarBitmask] = None) -> tuple[torch.Tensor, Optional[LogprobTensors]]:
        """Token ids [rows] and the logprobs asked for, left on the device. Penalties read the
        rows' token history on the host; a batch without them needs nothing from the host, so the
        overlapped scheduler launches it before the previous step's tokens are known (logprobs
        come from this step's logits alone, so they may be read later)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], "
                             f"got {tuple(logits.shape)}")
        logits = logits.float()
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        raw_logprobs = self._raw_logprobs(logits, logprob_rows)
        logits = apply_token_mask(logits, min_tokens_bans(rows, eos_token_ids))
        if grammar is not None:
            logits = apply_grammar_bitmask(logits, grammar)
        token_ids = self._force(self._select_tokens(self._apply_penalties(logits, rows), rows), rows)
        if raw_logprobs is None:
            return token_ids, None
        return token_ids, self._logprob_tensors(raw_logprobs, logprob_rows, token_ids, rows)

    # -- stages ---------------------------------------------------------------------------

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, row_ids: list[int]) -> Optional[torch.Tensor]:
        """log_softmax of the untouched logits, only for the rows that asked for logprobs."""
        if not row_ids:
            return None
        if len(row_ids) == logits.shape[0]:
            return torch.log_softmax(logits, dim=-1)
        return torch.log_softmax(logits[_index_tensor(row_ids, logits.device)], dim=-1)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab_size, device = logits.shape[-1], logits.device
        params = [row.params for row in rows]
        if any(p.repetition_penalty != 1.0 for p in params):
            # Only rows with a penalty contribute ids: the others' all-False mask is a no-op.
            seen_lists = [row.prompt_token_ids + row.output_token_ids
                          if row.params.repetition_penalty != 1.0 else [] for row in rows]
            seen = token_counts(seen_lists, vocab_size, device) > 0
            penalties = _float_tensor([p.repetition_penalty for p in params], device)
            logits = apply_repetition_penalty(logits, seen, penalties)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            output_lists = [row.output_token_ids
                            if (row.params.frequency_penalty or row.params.presence_penalty)
                            else [] for row in rows]
            counts = token_counts(output_lists, vocab_size, device)
            logits = apply_frequency_presence_penalties(
                logits, counts,
                _float_tensor([p.frequency_penalty for p in params], device),
                _float_tensor([p.presence_penalty for p in params], device))
        return logits

    def _select_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Argmax for greedy rows, a random draw for the others."""
        sampled_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not sampled_rows:
            return _argmax(logits)
        if len(sampled_rows) == len(rows):
            return self._sample(logits, rows)
        token_ids = _argmax(logits)
        index = torch.tensor(sampled_rows, device=logits.device)
        token_ids[index] = self._sample(logits[index], [rows[i] for i in sampled_rows])
        return token_ids

    @staticmethod
    def _force(token_ids: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Forced rows take their given token. After selection, so the other rows' draws and
        generators advance exactly as they would without the forced rows; the logprobs below are
        gathered at the returned ids, so a forced row reports its forced token's logprob."""
        forced = [(i, row.forced_token_id) for i, row in enumerate(rows) if row.forced_token_id is not None]
        if not forced:
            return token_ids
        index = _index_tensor([i for i, _ in forced], token_ids.device)
        values = _index_tensor([token for _, token in forced], token_ids.device).to(token_ids.dtype)
        return token_ids.index_put((index,), values)

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and a draw, for non-greedy rows only."""
        vocab_size, device = logits.shape[-1], logits.device
        params = [row.params for row in rows]
        if any(p.temperature != 1.0 for p in params):
            logits = logits / _float_tensor([p.temperature for p in params], device).unsqueeze(1)
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        need_top_k = any(k < vocab_size for k in top_k)
        need_top_p = any(p.top_p < 1.0 for p in params)
        if need_top_k or need_top_p:
            logits = apply_top_k_top_p(
                logits,
                torch.tensor(top_k, dtype=torch.long).to(device) if need_top_k else None,
                _float_tensor([p.top_p for p in params], device) if need_top_p else None)
        if any(p.min_p > 0.0 for p in params):
            logits = apply_min_p(logits, _float_tensor([p.min_p for p in params], device))
        return exponential_race(logits.softmax(dim=-1), [row.generator for row in rows])

    @staticmethod
    def _logprob_tensors(raw_logprobs: torch.Tensor, row_ids: list[int], token_ids: torch.Tensor,
                         rows: list[SamplingRow]) -> LogprobTensors:
        """Sampled-token logprob, top-N alternatives and rank of the rows `row_ids`, on the device."""
        # All rows (the usual case) need no index: a host list copied to the device would wait
        # for the work queued before it, which a launched-ahead step must not.
        chosen = token_ids if len(row_ids) == len(rows) else token_ids[_index_tensor(row_ids, token_ids.device)]
        chosen_lp = raw_logprobs.gather(1, chosen.unsqueeze(1))
        # Rank = 1 + number of tokens strictly more likely than the sampled one.
        rank = (raw_logprobs > chosen_lp).sum(dim=-1) + 1
        num_top = min(max(rows[i].params.logprobs for i in row_ids), raw_logprobs.shape[-1])
        top_lp, top_ids = raw_logprobs.topk(num_top, dim=-1)
        return LogprobTensors(row_ids, chosen, chosen_lp.squeeze(1), rank, top_lp, top_ids)


# --------------------------------------------------------------------------------------------
# Prompt logprobs
# --------------------------------------------------------------------------------------------


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor | Sequence[int],
                            num_top: int, *, chunk_size: int = 1024) -> list[dict[int, float]]:
    """For each position t: {next_token_ids[t]: logprob, plus the top-num_top entries}.

    logits[t] is the model's prediction for the token after position t, so next_token_ids[t]
    is the prompt token at t + 1 (OpenAI `echo` + logprobs). Positions are processed in chunks
    so a long prompt does not materialise a full [T, V] float32 log_softmax at once.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got {tuple(logits.shape)}")
    if num_top < 0:
        raise ValueError(f"num_top must be non-negative, got {num_top}")
    ids = torch.as_tensor(next_token_ids, dtype=torch.long, device=logits.device)
    if ids.shape != (logits.shape[0],):
        raise ValueError(f"next_token_ids must have shape ({logits.shape[0]},), "
                         f"got {tuple(ids.shape)}")
    num_top = min(num_top, logits.shape[-1])
    result: list[dict[int, float]] = []
    for start in range(0, logits.shape[0], chunk_size):
        result.extend(_prompt_logprobs_chunk(logits[start:start + chunk_size],
                                             ids[start:start + chunk_size], num_top))
    return result


def _prompt_logprobs_chunk(logits: torch.Tensor, ids: torch.Tensor,
                           num_top: int) -> list[dict[int, float]]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    top_lp, top_ids = logprobs.topk(num_top, dim=-1)
    entries: list[dict[int, float]] = []
    for token, lp, alt_ids, alt_lps in zip(ids.tolist(), chosen, top_ids.tolist(),
                                           top_lp.tolist()):
        entry = {token: lp}
        for alt, alt_lp in zip(alt_ids, alt_lps):
            entry.setdefault(alt, alt_lp)
        entries.append(entry)
    return entries
