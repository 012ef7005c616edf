"""/v1/prefix/pin, /v1/prefix/unpin, /v1/prefix/pins: a tenant's pins in the prefix cache
(docs/prefix_caching.md). Each runs on the engine side, between steps."""

from __future__ import annotations

from typing import Any, Optional

from kvserve.server.errors import APIError, bad_request, echo, from_value_error
from kvserve.server.protocol import PrefixPinRequest, PrefixUnpinRequest
from kvserve.server.serving_base import OpenAIServing


class OpenAIServingPins(OpenAIServing):
    # --- /v1/prefix/pin, /v1/prefix/unpin, /v1/prefix/pins ----------------------------------------
    async def pin_prefix(self, req: PrefixPinRequest, tenant: Optional[str]) -> dict[str, Any]:
        self.check_model(req.model)
        tenant = self.resolve_tenant(tenant, req.tenant)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must contain at least one message", "messages", "empty_messages")
            ids = await self.apply_chat_template(req.messages, False, False, None)
        elif isinstance(req.prompt, str):
            ids = await self.tokenize_text(req.prompt, req.add_special_tokens, "prompt")
        else:
            self._check_token_ids(req.prompt, "prompt token ids", "prompt")
            ids = list(req.prompt)

        try:
            return await self._call_engine(self.async_engine.pin_prefix(ids, req.ttl, tenant, req.cache_salt,
                                                                        req.num_tokens))
        except ValueError as exc:
            raise from_value_error(exc, "prompt") from None

    async def unpin_prefix(self, req: PrefixUnpinRequest, tenant: Optional[str]) -> dict[str, Any]:
        tenant = self.resolve_tenant(tenant, req.tenant)
        removed = await self._call_engine(self.async_engine.unpin_prefix(req.id, tenant))
        if not removed:
            raise APIError(404, f"no pin {echo(req.id)} of this tenant", param="id", code="pin_not_found")
        return {"id": req.id, "object": "prefix_pin", "deleted": True}

    async def list_pins(self, tenant: Optional[str], requested: Optional[str]) -> dict[str, Any]:
        tenant = self.resolve_tenant(tenant, requested)
        pins = await self._call_engine(self.async_engine.list_pins(tenant))
        return {"object": "list", "data": pins}
