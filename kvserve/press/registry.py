"""The presses by name (the `kv_press` a request or the engine asks for). Adding a press: its own
module, one import here, and its class in the tuple below."""

from __future__ import annotations

from kvserve.press.base import Press
from kvserve.press.h2o import H2OPress
from kvserve.press.knorm import KnormPress
from kvserve.press.similarity_merge import SimilarityMergePress
from kvserve.press.snapkv import SnapKVPress
from kvserve.press.streaming import StreamingLLMPress
from kvserve.press.tova import TOVAPress

PRESSES: dict[str, type] = {cls.name: cls for cls in (
    StreamingLLMPress, KnormPress, SnapKVPress, TOVAPress, H2OPress, SimilarityMergePress)}


def press_names() -> list[str]:
    """Every press's name, sorted."""
    return sorted(PRESSES)


def make_press(name: str) -> Press:
    """The press called `name`, with its default tunables."""
    cls = PRESSES.get(name)
    if cls is None:
        raise ValueError(f"unknown kv_press {name!r}; one of: {', '.join(press_names())}")
    return cls()
