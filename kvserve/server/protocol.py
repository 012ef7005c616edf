"""Request schemas of the OpenAI-compatible API (pydantic, strict types).

Strict mode: a string where a number belongs, or 1.0 where an integer belongs, is a 400 naming the
field, not a silent coercion. Unknown fields are ignored, as OpenAI's own API and most servers do,
so clients sending newer fields keep working. Range checks live in SamplingParams (one owner);
what only the server can know (served model name, n limit, context length) lives in serving.py.

Extension fields beyond OpenAI's: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens, include_stop_str_in_output (vLLM names), priority / tenant,
and the prefix-cache fields cache_salt (vLLM's name), pin_ttl and pin_prefix_tokens.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


def _range(minimum: float, maximum: Optional[float] = None) -> dict[str, float]:
    """Documents a field's range in the OpenAPI schema; SamplingParams enforces it (one owner)."""
    return {"minimum": minimum} if maximum is None else {"minimum": minimum, "maximum": maximum}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage in every chunk (extension)")


class _SamplingFields(_Strict):
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
    logit_bias: Optional[dict[str, float]] = Field(None, description="not supported: must be empty")
    user: Optional[str] = None
    min_tokens: int = Field(0, json_schema_extra=_range(0))
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, description="scheduling priority (extension; recorded, used by later issues)")
    tenant: Optional[str] = Field(None, description="tenant name (extension); an API key's tenant wins")
    cache_salt: Optional[str] = Field(None, description="prefix-cache salt (extension): cached prefixes are shared "
                                                        "only between requests with the same salt", max_length=256)
    pin_ttl: Optional[float] = Field(None, description="pin this prompt's cached prefix for this many seconds "
                                                       "(extension; evicted after unpinned blocks)",
                                     json_schema_extra={"exclusiveMinimum": 0})
    pin_prefix_tokens: Optional[int] = Field(None, description="with pin_ttl: pin only the first N prompt tokens",
                                             json_schema_extra=_range(1))


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="a string, a list of strings, a list of token ids or a list of token-id lists")
    max_tokens: Optional[int] = Field(16, description="tokens to generate per sample (default 16)",
                                      json_schema_extra=_range(1))
    echo: bool = Field(False, description="prepend the prompt to the text (and its logprobs, with logprobs)")
    logprobs: Optional[int] = Field(None, description="top-N logprobs per token (0 = the chosen token only)",
                                    json_schema_extra=_range(0, 20))
    suffix: Optional[str] = Field(None, description="not supported: must be null")
    best_of: Optional[int] = Field(None, description="only best_of == n is supported")
    add_special_tokens: bool = Field(True, description="tokenize string prompts with the BOS token etc.")


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., description="the conversation; at least one message",
                                        json_schema_extra={"minItems": 1})
    max_tokens: Optional[int] = Field(None, description="deprecated alias of max_completion_tokens",
                                      json_schema_extra=_range(1))
    max_completion_tokens: Optional[int] = Field(None, description="default: what max_model_len leaves",
                                                 json_schema_extra=_range(1))
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, description="needs logprobs: true", json_schema_extra=_range(0, 20))
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict[str, Any]]] = Field(None, description="not supported: must be empty")
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeRequest(_Strict):
    model: Optional[str] = None
    prompt: Optional[str] = Field(None, description="text to tokenize (or give messages)")
    messages: Optional[list[ChatMessage]] = Field(None, description="a conversation, via the chat template")
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


class PrefixPinRequest(_Strict):
    """POST /v1/prefix/pin: keep a prefix (e.g. a system prompt) cached for `ttl` seconds."""
    model: Optional[str] = None
    prompt: Union[str, list[int], None] = Field(None, description="text or token ids of the prefix (or give messages)")
    messages: Optional[list[ChatMessage]] = Field(None, description="a conversation prefix, rendered by the chat "
                                                                    "template without a generation prompt")
    ttl: float = Field(600.0, description="seconds the pin lasts", json_schema_extra={"exclusiveMinimum": 0})
    num_tokens: Optional[int] = Field(None, description="pin only the first N tokens", json_schema_extra=_range(1))
    cache_salt: Optional[str] = Field(None, max_length=256)
    tenant: Optional[str] = Field(None, description="tenant whose cache holds it; an API key's tenant wins")
    add_special_tokens: bool = True


class PrefixUnpinRequest(_Strict):
    """POST /v1/prefix/unpin: remove one of your pins."""
    id: int
    tenant: Optional[str] = Field(None, description="an API key's tenant wins")


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, PrefixPinRequest,
                  PrefixUnpinRequest)

# Messages for fields whose type is a union, where pydantic would report one error per member.
UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string, a list of strings or null",
    "content": "must be a string, a list of {\"type\": \"text\", \"text\": ...} parts or null",
    "tool_choice": "must be a string, an object or null",
}
