"""KV-cache presses: per-layer token pruning (StreamingLLM, Knorm, SnapKV, TOVA, H2O) and merging
(similarity_merge) on one request's dense keys and values, each press in its own module and found by
name through the registry. Pure tensor code: this package imports nothing else from kvserve, so the
engine (which gathers the KV and writes the kept tokens back) depends on it, never the reverse."""

from kvserve.press.base import Compressed, Press, PressInputs, keep_top
from kvserve.press.registry import PRESSES, make_press, press_names

__all__ = ["PressInputs", "Compressed", "Press", "keep_top", "make_press", "press_names", "PRESSES"]
