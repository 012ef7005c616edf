"""Request schemas of the OpenAI-compatible API (pydantic, strict types).

Strict mode: a string where a number belongs, or 1.0 where an integer belongs, is a 400 naming the
field, not a silent coercion. Range checks live in SamplingParams (one owner); what only the server
can know (served model name, n limit, context length) lives in serving_base.py.

Fields this server does not know are ignored, as vLLM does, so clients sending newer fields keep
working; but a field it recognises from OpenAI or vLLM and does not implement (logit_bias,
beam search, ...) is a 400 naming it (each model's UNSUPPORTED table), because
ignoring it would answer 200 with output the client did not ask for. Each entry lists the values
that leave the output unchanged (null always), which pass: SDKs send `tool_choice: "none"`,
`logit_bias: {}` and the like by default.

Extension fields beyond OpenAI's: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens, include_stop_str_in_output (vLLM names), priority / tenant,
and the prefix-cache fields cache_salt (vLLM's name), pin_ttl and pin_prefix_tokens, and the KV
compression fields kv_press, kv_keep_ratio, kv_keep_tokens and kv_press_mode (docs/kv_compression.md),
qos_class (docs/qos.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

UNSUPPORTED_ERROR = "unsupported_field"   # the pydantic error type errors.format_validation_errors names


@dataclass(frozen=True)
class Unsupported:
    """A field other servers take and this one does not: any value but null and `inert` is a 400."""
    why: str
    inert: tuple = ()

    def accepts(self, value: Any) -> bool:
        return value is None or any(type(value) is type(ok) and value == ok for ok in self.inert)


def _unsupported(why: str, names: str, inert: tuple = ()) -> dict[str, Unsupported]:
    return {name: Unsupported(why, inert) for name in names.split()}


_TEMPLATE_KWARGS_HELP = ("variables for the chat template (e.g. enable_thinking); never tokenizer arguments, "
                         "and not the names the template binds itself (messages, add_generation_prompt, ...)")
_TENANT_HELP = ("tenant (extension): only with --trust-request-tenant, for a gateway that authenticates users; "
                "otherwise tenants come from API keys and a different value is a 403")


def _range(minimum: float, maximum: Optional[float] = None) -> dict[str, float]:
    """Documents a field's range in the OpenAPI schema; SamplingParams enforces it (one owner)."""
    return {"minimum": minimum} if maximum is None else {"minimum": minimum, "maximum": maximum}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, rule in cls.UNSUPPORTED.items():
                if name in data and not rule.accepts(data[name]):
                    raise PydanticCustomError(UNSUPPORTED_ERROR, "{why}", {"field": name, "why": rule.why})
        return data


# Both generation endpoints: constraints and vLLM sampling options the engine does not have.
_SAMPLING_UNSUPPORTED = {
    "guided_whitespace_pattern": Unsupported("not supported: JSON output is compact (docs/structured_output.md)"),
    "guided_decoding_backend": Unsupported("the grammar engine is xgrammar", ("xgrammar", "auto")),
    "logit_bias": Unsupported("not supported by this server", ({},)),
    **_unsupported("not supported by this server", "logits_processors allowed_token_ids vllm_xargs"),
    "bad_words": Unsupported("not supported by this server", ([],)),
    "use_beam_search": Unsupported("beam search is not supported by this server", (False,)),
    "prompt_logprobs": Unsupported("not supported: use /v1/completions with echo and logprobs"),
    "truncate_prompt_tokens": Unsupported("prompt truncation is not supported: shorten the prompt"),
    "spaces_between_special_tokens": Unsupported("only true is supported", (True,)),
    **_unsupported("token-id output is not supported by this server",
                   "return_tokens_as_token_ids return_token_ids", (False,)),
}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage in every chunk (extension)")


class JsonSchemaFormat(_Strict):
    # "schema" and "json" would shadow pydantic's own attributes: aliases carry the wire names.
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: Optional[str] = Field(None, max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema", description="the JSON schema the output follows")
    strict: Optional[bool] = Field(None, description="always strict: the output always follows the schema")


class ResponseFormat(_Strict):
    UNSUPPORTED = {"structural_tag": Unsupported("structural tags are not supported by this server")}
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsField(_Strict):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    UNSUPPORTED = {**_unsupported("not supported by this server", "structural_tag whitespace_pattern")}
    json_schema: Union[dict[str, Any], str, None] = Field(None, alias="json", description="a JSON schema")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = Field(None, description="an EBNF grammar (GBNF style) with a rule named root")
    json_object: Optional[bool] = None


class _SamplingFields(_Strict):
    UNSUPPORTED = _SAMPLING_UNSUPPORTED
    model: Optional[str] = Field(None, description="a name from /v1/models; omitted means the served model")
    temperature: Optional[float] = Field(None, description="0 = greedy; default 1", json_schema_extra=_range(0))
    top_p: Optional[float] = Field(None, description="nucleus mass in (0, 1]; default 1",
                                   json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: Optional[int] = Field(None, description="keep the k most likely tokens; 0 or -1 disables",
                                 json_schema_extra=_range(-1))
    min_p: Optional[float] = Field(None, description="drop tokens below min_p x the top probability",
                                   json_schema_extra=_range(0, 1))
    n: int = Field(1, description="samples per prompt (the server's --max-n caps it)", json_schema_extra=_range(1))
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = Field(None, json_schema_extra=_range(-2, 2))
    frequency_penalty: Optional[float] = Field(None, json_schema_extra=_range(-2, 2))
    repetition_penalty: Optional[float] = Field(None, json_schema_extra={"exclusiveMinimum": 0})
    user: Optional[str] = None
    min_tokens: int = Field(0, json_schema_extra=_range(0))
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, description="scheduling priority (vLLM extension): with --scheduling-policy priority, "
                                         "lower goes first and may preempt a running request that ranks below")
    tenant: Optional[str] = Field(None, max_length=256, description=_TENANT_HELP)
    cache_salt: Optional[str] = Field(None, description="prefix-cache salt (extension): cached prefixes are shared "
                                                        "only between requests with the same salt", max_length=256)
    pin_ttl: Optional[float] = Field(None, description="pin this prompt's cached prefix for this many seconds "
                                                       "(extension; evicted after unpinned blocks)",
                                     json_schema_extra={"exclusiveMinimum": 0})
    pin_prefix_tokens: Optional[int] = Field(None, description="with pin_ttl: pin only the first N prompt tokens",
                                             json_schema_extra=_range(1))
    kv_press: Optional[str] = Field(None, max_length=64,
                                    description="KV press (extension) that prunes this request's KV once its prompt "
                                                "is computed: streaming_llm, snapkv, tova, h2o, knorm, "
                                                "similarity_merge, or none to turn the server's --kv-press off")
    kv_keep_ratio: Optional[float] = Field(None, description="share of the prunable KV the press keeps (extension)",
                                           json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    kv_keep_tokens: Optional[int] = Field(None, description="KV tokens the press keeps, kept as the output grows "
                                                            "(extension; instead of kv_keep_ratio)",
                                          json_schema_extra=_range(1))
    kv_press_mode: Optional[Literal["drop", "tier"]] = Field(
        None, description="what the press does with what it would not keep (extension): drop it, or tier it "
                          "(blocks demoted to the host KV tier and brought back when the decode needs them)")
    qos_class: Optional[str] = Field(None, max_length=64,
                                     description="request class (extension; --qos-config): its priority and p99 "
                                                 "latency targets; default: the tenant's class")
    # Structured output (docs/structured_output.md): at most one of these.
    response_format: Optional[ResponseFormat] = Field(None, description="text, json_object or json_schema")
    guided_json: Union[dict[str, Any], str, None] = Field(None, description="a JSON schema (vLLM)")
    guided_regex: Optional[str] = Field(None, description="a regular expression the output matches (vLLM)")
    guided_choice: Optional[list[str]] = Field(None, description="the output is one of these strings (vLLM)")
    guided_grammar: Optional[str] = Field(None, description="an EBNF grammar with a rule named root (vLLM)")
    structured_outputs: Optional[StructuredOutputsField] = None


class CompletionRequest(_SamplingFields):
    UNSUPPORTED = {**_SAMPLING_UNSUPPORTED, "suffix": Unsupported("not supported by this server")}
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="a string, a list of strings, a list of token ids or a list of token-id lists")
    max_tokens: Optional[int] = Field(16, description="tokens to generate per sample (default 16)",
                                      json_schema_extra=_range(1))
    echo: bool = Field(False, description="prepend the prompt to the text (and its logprobs, with logprobs)")
    logprobs: Optional[int] = Field(None, description="top-N logprobs per token (0 = the chosen token only)",
                                    json_schema_extra=_range(0, 20))
    best_of: Optional[int] = Field(None, description="only best_of == n is supported")
    add_special_tokens: bool = Field(True, description="tokenize string prompts with the BOS token etc.")


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(..., max_length=64)
    arguments: str = Field(..., description="the arguments as a JSON text")


class MessageToolCall(_Strict):
    id: str = Field(..., max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    # Fields a chat template may render (reasoning): they are not passed to it, so a message
    # carrying one is refused rather than rendered without it.
    UNSUPPORTED = {**_unsupported("not supported in messages by this server",
                                  "function_call audio reasoning_content reasoning thinking")}
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = Field(None, description="passed to the chat template")
    tool_calls: Optional[list[MessageToolCall]] = Field(None, description="an assistant's calls, rendered by the "
                                                                          "chat template")
    tool_call_id: Optional[str] = Field(None, max_length=256, description="a tool message: the call it answers")


class FunctionDefinition(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema of the arguments object")
    strict: Optional[bool] = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


_TEMPLATE = {"chat_template": Unsupported("a chat template from the request is not accepted (the model's own "
                                           "or --chat-template is used)")}
_TOOLS = {"tools": Unsupported("tools are only taken by /v1/chat/completions", ([],)), **_TEMPLATE}


class ChatCompletionRequest(_SamplingFields):
    UNSUPPORTED = {
        **_SAMPLING_UNSUPPORTED, **_TEMPLATE,
        "function_call": Unsupported("the legacy functions API is not supported: use tools", ("none", "auto")),
        "functions": Unsupported("the legacy functions API is not supported: use tools", ([],)),
        "documents": Unsupported("documents (RAG) are not supported by this server", ([],)),
        "audio": Unsupported("audio output is not supported by this server"),
        "modalities": Unsupported("only modalities [\"text\"] is supported", (["text"],)),
        **_unsupported("not supported by this server (a template variable goes in chat_template_kwargs)",
                       "reasoning_effort verbosity web_search_options"),
        "echo": Unsupported("not supported for chat: use /v1/completions", (False,)),
        "add_special_tokens": Unsupported("only false is supported for chat (the template writes the special "
                                          "tokens)", (False,)),
        "include_reasoning": Unsupported("only true is supported (reasoning is not separated from the answer)",
                                         (True,)),
    }
    messages: list[ChatMessage] = Field(..., description="the conversation; at least one message",
                                        json_schema_extra={"minItems": 1})
    max_tokens: Optional[int] = Field(None, description="deprecated alias of max_completion_tokens",
                                      json_schema_extra=_range(1))
    max_completion_tokens: Optional[int] = Field(None, description="default: what max_model_len leaves",
                                                 json_schema_extra=_range(1))
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, description="needs logprobs: true", json_schema_extra=_range(0, 20))
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description=_TEMPLATE_KWARGS_HELP)
    tools: Optional[list[ChatTool]] = Field(None, description="functions the model may call (docs/tool_calling.md)")
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="none, auto (the default with tools; needs --enable-auto-tool-choice), required, or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    parallel_tool_calls: Optional[bool] = Field(None, description="false: at most one call")


class TokenizeRequest(_Strict):
    UNSUPPORTED = {**_TOOLS, "return_token_strs": Unsupported("not supported by this server", (False,)),
                   "continue_final_message": Unsupported("not supported by /v1/tokenize", (False,))}
    model: Optional[str] = None
    prompt: Optional[str] = Field(None, description="text to tokenize (or give messages)")
    messages: Optional[list[ChatMessage]] = Field(None, description="a conversation, via the chat template")
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description=_TEMPLATE_KWARGS_HELP)


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


class PrefixPinRequest(_Strict):
    """POST /v1/prefix/pin: keep a prefix (e.g. a system prompt) cached for `ttl` seconds."""
    UNSUPPORTED = {**_TOOLS, "chat_template_kwargs": Unsupported("not supported for pins", ({},))}
    model: Optional[str] = None
    prompt: Union[str, list[int], None] = Field(None, description="text or token ids of the prefix (or give messages)")
    messages: Optional[list[ChatMessage]] = Field(None, description="a conversation prefix, rendered by the chat "
                                                                    "template without a generation prompt")
    ttl: float = Field(600.0, description="seconds the pin lasts", json_schema_extra={"exclusiveMinimum": 0})
    num_tokens: Optional[int] = Field(None, description="pin only the first N tokens", json_schema_extra=_range(1))
    cache_salt: Optional[str] = Field(None, max_length=256)
    tenant: Optional[str] = Field(None, max_length=256, description=_TENANT_HELP)
    add_special_tokens: bool = True


class PrefixUnpinRequest(_Strict):
    """POST /v1/prefix/unpin: remove one of your pins."""
    id: int
    tenant: Optional[str] = Field(None, max_length=256, description=_TENANT_HELP)


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, PrefixPinRequest,
                  PrefixUnpinRequest)

# Messages for fields whose type is a union, where pydantic would report one error per member.
UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string, a list of strings or null",
    "guided_json": "must be a JSON schema (an object or its text) or null",
    "json": "must be a JSON schema (an object or its text) or null",
    "content": "must be a string, a list of {\"type\": \"text\", \"text\": ...} parts or null",
    "tool_choice": "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
}
