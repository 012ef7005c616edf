"""Teacher-forced decoding through the engine's own loop (scheduler, presses, tiering).

`kv_fidelity.decode_perplexity` and `teacher_forced_logprobs` drive the model runner directly, on
block tables of their own: fast and exact, but no press runs there, since the presses run in the
engine after a request's prompt is computed and during its decode (engine/press_control.py). Here
each text is an ordinary engine request instead: its prompt is prefilled by the scheduler (and
pressed, or tiered, at its end as any request is), then every output token is forced to the given
continuation (`Engine.add_request(forced_token_ids=...)`: the sampler takes the forced id and
returns its logprob from the step's logits), so decode-time presses, budgets and tier recalls
act on the KV the later tokens read.

The first continuation token is scored from the prefill step's logits, which attend over the
prompt's full KV: a press runs after that step. Every later one is scored by a decode step over
the pressed KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.sampling_params import SamplingParams


@dataclass
class ForcedRun:
    """Per text, the logprob the model gave each forced continuation token, in order."""
    logprobs: list[list[float]]
    steps: int                       # engine steps the run took


def forced_logprobs(engine, prompts: list[list[int]], continuations: list[list[int]],
                    tag: str = "forced") -> ForcedRun:
    """Runs every (prompt, continuation) as one engine request, all side by side, to completion.
    Raises if a request's outputs are not its continuation: forcing did not hold."""
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
    if any(not c for c in continuations):
        raise ValueError("every continuation needs at least one token (the tokens scored)")
    ids = []
    for index, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        # Greedy and ignore_eos: nothing is drawn, and a forced EOS does not end the request early.
        params = SamplingParams(max_tokens=len(continuation), temperature=0.0, ignore_eos=True, logprobs=0,
                                output_kind="final_only")
        ids.append(engine.add_request(f"{tag}-{index}", {"prompt_token_ids": list(prompt)}, params,
                                      forced_token_ids=list(continuation)))
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs[0]
    logprobs = []
    for request_id, continuation in zip(ids, continuations):
        completion = done[request_id]
        if list(completion.token_ids) != list(continuation):
            raise RuntimeError(f"{request_id}: the outputs are not the forced tokens (teacher forcing did not hold): "
                               f"{list(completion.token_ids)[:8]}... against {list(continuation)[:8]}...")
        logprobs.append([entry[token] for entry, token in zip(completion.logprobs, continuation)])
    return ForcedRun(logprobs, steps)
