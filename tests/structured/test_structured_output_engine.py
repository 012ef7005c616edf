"""Structured output through the engine with the default model: every json_schema output parses
and validates (jsonschema) over schemas with nested objects, enums, arrays and bounded numbers;
regex and choice outputs match; constrained and unconstrained requests share a batch without
changing the unconstrained ones' greedy tokens; overlapped scheduling and preemption give the same
tokens; a grammar cut at max_tokens ends with `length` and a prefix its grammar accepts."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conftest import requires_default_model
from kvserve.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, requires_default_model]

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                   "required": ["name", "age"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["person", "active"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"type": "string", "enum": ["S", "M", "L"]}},
              "required": ["color", "size"], "additionalProperties": False},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                                        "items": {"type": "string", "maxLength": 10}}},
              "required": ["tags"], "additionalProperties": False},
    "bounded": {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 50},
                                                 "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["celsius", "count"], "additionalProperties": False},
}
PROMPTS = {"nested": "Describe a person called Ann as JSON.", "enums": "Pick a color and a shirt size, as JSON.",
           "array": "Give three tags for a blog post about cooking, as JSON.",
           "bounded": "Today's weather in Oslo as JSON."}


@pytest.fixture(scope="module")
def llm():
    from kvserve.llm import LLM
    return LLM(kv_cache_memory=64 << 20, max_model_len=512)


def _greedy(max_tokens: int = 96, **structured) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          structured_output=structured or None)


def _chat_prompt(llm, text: str) -> dict:
    return {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": text}])}


def test_every_json_schema_output_validates(llm):
    names = list(SCHEMAS)
    outputs = llm.generate([_chat_prompt(llm, PROMPTS[n]) for n in names],
                           [_greedy(json=SCHEMAS[n]) for n in names], use_tqdm=False)
    for name, output in zip(names, outputs):
        sample = output.outputs[0]
        assert sample.finish_reason == "stop", (name, sample.text)
        jsonschema.validate(json.loads(sample.text), SCHEMAS[name])


def test_sampled_json_validates_too(llm):
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=96,
                            structured_output={"json": SCHEMAS["nested"]})
    output = llm.generate([_chat_prompt(llm, PROMPTS["nested"])], params, use_tqdm=False)[0]
    for sample in output.outputs:
        jsonschema.validate(json.loads(sample.text), SCHEMAS["nested"])


def test_json_object_regex_and_choice(llm):
    # A prompt the 135M model answers with a short object: asked for a free description it loops on
    # nested keys past any max_tokens, and json_object (unlike a schema) does not bound its length.
    prompts = [_chat_prompt(llm, 'Write {"name": ...} for a dog as JSON.'), "My phone number is", "Is the sky blue? Answer:",
               _chat_prompt(llm, "Write a greeting.")]
    params = [_greedy(json_object=True), _greedy(regex=r"\(\d{3}\) \d{3}-\d{4}"),
              _greedy(choice=["yes", "no", "it depends"]),
              _greedy(grammar='root ::= greeting " " name\ngreeting ::= "Hello" | "Hi"\nname ::= [A-Z][a-z]{1,8}')]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    obj, phone, choice, greeting = (o.text for o in outputs)
    assert outputs[0].finish_reason == "stop", obj
    assert isinstance(json.loads(obj), dict)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone), phone
    assert choice in ("yes", "no", "it depends")
    assert re.fullmatch(r"(Hello|Hi) [A-Z][a-z]{1,8}", greeting), greeting


def test_a_shared_batch_leaves_unconstrained_requests_alone(llm):
    plain = ["The capital of France is", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(plain, _greedy(24), use_tqdm=False)]
    constrained = [_chat_prompt(llm, PROMPTS[n]) for n in SCHEMAS]
    mixed = llm.generate(plain + constrained, [_greedy(24)] * 2 + [_greedy(json=SCHEMAS[n]) for n in SCHEMAS],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    # and the constraint did act: the unconstrained model does not write this JSON by itself
    free = llm.generate(constrained[:1], _greedy(), use_tqdm=False)[0].outputs[0].text
    assert mixed[2].outputs[0].text != free


def test_a_grammar_cut_at_max_tokens_ends_with_length_and_a_valid_prefix(llm):
    from kvserve.structured.grammar import GrammarCompiler, GrammarMatcher
    from kvserve.structured.params import StructuredOutputParams

    output = llm.generate([_chat_prompt(llm, PROMPTS["nested"])], _greedy(6, json=SCHEMAS["nested"]),
                          use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 6
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size, sorted(engine.eos_token_ids))
    matcher = GrammarMatcher(compiler.compile(StructuredOutputParams(json=SCHEMAS["nested"])))
    assert all(matcher.accept(t) for t in output.token_ids) and not matcher.is_terminated


@pytest.mark.parametrize("options", [dict(async_scheduling="on", max_num_batched_tokens=256),
                                     dict(max_model_len=256)],
                         ids=["overlapped", "preempted"])
def test_overlapped_scheduling_and_preemption_keep_the_tokens(llm, options):
    from kvserve.llm import LLM
    if "async_scheduling" not in options:      # room for about 256 tokens (of any dtype): requests preempt
        options = {**options, "kv_cache_memory": 256 * llm.engine.kv_bytes_per_token}
    names = list(SCHEMAS)
    prompts = [_chat_prompt(llm, PROMPTS[n]) for n in names] + ["The capital of France is"]
    params = [_greedy(json=SCHEMAS[n]) for n in names] + [_greedy(24)]
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    other = LLM(**{"kv_cache_memory": 64 << 20, "max_model_len": 512, **options})
    launch, launched = other.engine.runner.launch, []

    def counted_launch(sched_out, *args):      # the real launch, counted: did steps overlap?
        launched.append(len(sched_out.scheduled))
        return launch(sched_out, *args)
    other.engine.runner.launch = counted_launch
    outputs = other.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    if "async_scheduling" in options:
        assert sum(n > 1 for n in launched) > 20, launched
    if "kv_cache_memory" in options:
        assert other.engine.make_stats().scheduler.num_preemptions_total > 0


def test_bad_constraints_are_rejected_naming_the_field(llm):
    from kvserve.sched.scheduler import RequestRejected
    for bad, words in (({"regex": "[a-"}, "regular expression"), ({"json": {"type": "nope"}}, "JSON schema"),
                       ({"grammar": "root ::= missing"}, "EBNF grammar")):
        with pytest.raises(RequestRejected, match=f"^structured_output is not a valid {words}"):
            llm.engine.add_request(None, "hi", SamplingParams(structured_output=bad))
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_output={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="^structured_output"):
        SamplingParams(structured_output={"jsn": {}})
    assert not llm.engine.has_unfinished_requests()
