"""/v1/tokenize and /v1/detokenize (also served at /tokenize and /detokenize, as vLLM does)."""

from __future__ import annotations

from typing import Any

from kvserve.server.errors import bad_request
from kvserve.server.protocol import DetokenizeRequest, TokenizeRequest
from kvserve.server.serving_base import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    # --- /v1/tokenize, /v1/detokenize ----------------------------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must contain at least one message", "messages", "empty_messages")
            ids = await self.apply_chat_template(req.messages, req.add_generation_prompt, False,
                                                 req.chat_template_kwargs)
        else:
            ids = await self.tokenize_text(req.prompt, req.add_special_tokens, "prompt")
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        self._check_token_ids(req.tokens, "tokens", "tokens")
        tokenizer = self._require_tokenizer("detokenize")
        text = await self._run_in_tokenizer(lambda: tokenizer.decode(req.tokens))
        return {"prompt": text}
