"""kvserve: an LLM inference engine and OpenAI-compatible server built around the KV cache."""

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
