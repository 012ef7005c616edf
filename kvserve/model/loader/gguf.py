"""llama.cpp GGUF files: the config rebuilt from the GGUF metadata, tensors dequantized one at a time with
`gguf.quants.dequantize`, renamed to Hugging Face names and reshaped (ggml lists dimensions innermost
first); for the ``llama`` architecture the rotary row permutation that llama.cpp's converter applies to the
Q and K projections is undone. The tokenizer is built by transformers from the GGUF metadata (slow, ~10 s)
and cached with ``save_pretrained`` under ``$KVSERVE_CACHE_DIR/tokenizers`` (default ``~/.cache/kvserve``).

(``import gguf`` below is the PyPI package, not this module: imports are absolute.)
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import re
import shutil
import tempfile
from typing import Any, Iterator, Optional

import numpy as np
import torch
import transformers

from kvserve.model.loader.common import ModelLoadError, ModelSource, QuantizedWeight, kvserve_cache_dir

logger = logging.getLogger(__name__)

# GGUF "general.architecture" -> Hugging Face architecture.
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _make_gguf_reader(path: str):
    """A `gguf.GGUFReader` whose byte buffer is a plain ndarray view of the memory map.

    GGUFReader slices its buffer once per metadata item (~250k slices for a 49k-token vocabulary); slicing an
    `np.memmap` runs `memmap.__array_finalize__` every time, which makes parsing several times slower. The data stay
    memory-mapped (the view keeps the map alive).
    """
    import gguf

    class _FastGGUFReader(gguf.GGUFReader):
        @property
        def data(self):  # type: ignore[override]
            return self._kvserve_data

        @data.setter
        def data(self, value):
            self._kvserve_mmap = value
            self._kvserve_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    gc_was_enabled = gc.isenabled()
    gc.disable()  # parsing creates ~10^6 small objects; collections during it only cost time
    try:
        return _FastGGUFReader(path, "r")
    finally:
        if gc_was_enabled:
            gc.enable()


# GGUF tensor name -> HF name. Per-block names are "blk.{N}.{key}.{weight|bias}".
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([A-Za-z0-9_]+)\.(weight|bias)$")
_GGUF_GLOBAL_RE = re.compile(r"^([A-Za-z0-9_]+)\.(weight|bias)$")
# Tensors that llama.cpp stores but that are no HF parameter.
_GGUF_SKIPPED = ("rope_freqs.weight",)


def _gguf_to_hf_name(name: str) -> Optional[str]:
    m = _GGUF_BLOCK_RE.match(name)
    if m:
        layer, key, kind = m.groups()
        hf = _GGUF_BLOCK_NAMES.get(key)
        return f"model.layers.{int(layer)}.{hf}.{kind}" if hf else None
    m = _GGUF_GLOBAL_RE.match(name)
    if m:
        key, kind = m.groups()
        hf = _GGUF_GLOBAL_NAMES.get(key)
        return f"{hf}.{kind}" if hf else None
    return None


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation.

    HF rotates the two halves of each head (rows [0, d/2) pair with [d/2, d)); llama.cpp's converter reorders
    every head's rows to interleaved pairs (row 2i <- HF row i, row 2i+1 <- HF row i + d/2). Here row i of
    the result is row 2i of the input and row i + d/2 is row 2i + 1.
    """
    rows = w.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ModelLoadError(f"cannot un-permute a rotary projection of {rows} rows over {n_heads} heads")
    half = rows // n_heads // 2
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


class GGUFFile:
    """An open GGUF file (the `CheckpointReader` of a GGUF): metadata, tensor directory and tokenizer cache."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.reader = _make_gguf_reader(path)
        except Exception as e:
            raise ModelLoadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e
        self.arch = str(self.get("general.architecture") or "")
        self.tensor_names = [t.name for t in self.reader.tensors]

    # ---- metadata ----
    def get(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            return default
        try:
            v = f.contents()
        except Exception as e:
            raise ModelLoadError(f"{self.path}: cannot read GGUF metadata {key!r} ({type(e).__name__}: {e})") from e
        return default if v is None else v

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def field_length(self, key: str) -> Optional[int]:
        f = self.reader.fields.get(key)
        return None if f is None else len(f.data)

    def _require(self, key: str) -> Any:
        v = self.arch_get(key)
        if v is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks required key '{self.arch}.{key}'")
        return v

    # ---- config ----
    def build_config(self) -> tuple[str, transformers.PretrainedConfig]:
        if not self.arch:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks 'general.architecture'")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"{self.path}: unsupported GGUF architecture {self.arch!r}; supported GGUF architectures: "
                f"{', '.join(GGUF_ARCHITECTURES)} ({', '.join(GGUF_ARCHITECTURES.values())})")
        architecture = GGUF_ARCHITECTURES[self.arch]
        self._check_tensor_names()

        hidden = int(self._require("embedding_length"))
        heads = int(self._require("attention.head_count"))
        kv_heads = int(self.arch_get("attention.head_count_kv", heads))
        head_dim = int(self.arch_get("attention.key_length") or hidden // heads)
        vocab = self.field_length("tokenizer.ggml.tokens") or self.arch_get("vocab_size")
        if vocab is None:
            embd = self._tensor("token_embd.weight")
            vocab = int(embd.shape[-1]) if embd is not None else None
        if vocab is None:
            raise ModelLoadError(f"{self.path}: cannot tell the vocabulary size (no tokenizer.ggml.tokens, "
                                 f"'{self.arch}.vocab_size' or token_embd.weight)")
        names = set(self.tensor_names)
        rope: dict[str, Any] = {"rope_type": "default",
                                "rope_theta": float(self.arch_get("rope.freq_base", 10000.0))}
        rope.update(self._rope_scaling())

        kwargs: dict[str, Any] = dict(
            architectures=[architecture],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._require("feed_forward_length")),
            num_hidden_layers=int(self._require("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=int(self.arch_get("context_length", 2048)),
            rms_norm_eps=float(self.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_parameters=rope,
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=self._token_id("bos"),
            eos_token_id=self._token_id("eos"),
            pad_token_id=self._token_id("padding"),
        )
        if architecture == "LlamaForCausalLM":
            kwargs["head_dim"] = head_dim
            kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
            kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in names
            config: transformers.PretrainedConfig = transformers.LlamaConfig(**kwargs)
        else:
            config = transformers.Qwen2Config(**kwargs)
            if head_dim != hidden // heads:
                config.head_dim = head_dim
        dtype = self._checkpoint_dtype()
        if dtype is not None:
            config.dtype = dtype
        return architecture, config

    def _token_id(self, kind: str) -> Optional[int]:
        v = self.get(f"tokenizer.ggml.{kind}_token_id")
        return None if v is None else int(v)

    def _rope_scaling(self) -> dict[str, Any]:
        kind = self.arch_get("rope.scaling.type")
        factor = self.arch_get("rope.scaling.factor")
        if kind is None and self.arch_get("rope.scale_linear") is not None:
            kind, factor = "linear", self.arch_get("rope.scale_linear")
        if kind is None or str(kind) == "none" or factor is None:
            if "rope_freqs.weight" in self.tensor_names:
                logger.warning("%s: ignoring the rope_freqs tensor (llama3-style rope scaling cannot be rebuilt "
                               "from GGUF); positions beyond the original context may degrade", self.path)
            return {}
        kind = str(kind)
        out: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn":
            orig = self.arch_get("rope.scaling.original_context_length")
            if orig is not None:
                out["original_max_position_embeddings"] = int(orig)
            for src, dst in (("rope.scaling.yarn_beta_fast", "beta_fast"),
                             ("rope.scaling.yarn_beta_slow", "beta_slow")):
                v = self.arch_get(src)
                if v is not None:
                    out[dst] = float(v)
        elif kind != "linear":
            raise ModelLoadError(f"{self.path}: unsupported GGUF rope scaling type {kind!r} (supported: linear, yarn)")
        return out

    def _checkpoint_dtype(self) -> Optional[str]:
        import gguf
        types = {t.tensor_type for t in self.reader.tensors if len(t.shape) >= 2}
        if types == {gguf.GGMLQuantizationType.F16}:
            return "float16"
        if types == {gguf.GGMLQuantizationType.BF16}:
            return "bfloat16"
        return "float32"

    def _check_tensor_names(self) -> None:
        unknown = [n for n in self.tensor_names if n not in _GGUF_SKIPPED and _gguf_to_hf_name(n) is None]
        if unknown:
            raise ModelLoadError(
                f"{self.path}: GGUF tensors with no known mapping for architecture {self.arch!r}: "
                f"{', '.join(unknown[:5])}{'...' if len(unknown) > 5 else ''}")
        if "token_embd.weight" not in self.tensor_names:
            raise ModelLoadError(f"{self.path}: GGUF file has no token_embd.weight tensor")

    def _tensor(self, name: str):
        for t in self.reader.tensors:
            if t.name == name:
                return t
        return None

    # ---- weights ----
    def quantized_tensor_types(self) -> dict[str, int]:
        float_types = ("F32", "F16", "BF16", "F64")
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            if len(t.shape) == 2 and t.tensor_type.name not in float_types and t.name not in _GGUF_SKIPPED:
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def iter_weights(self, config: transformers.PretrainedConfig, keep_quantized: frozenset[str] = frozenset()
                     ) -> Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]:
        """Tensors under HF names; a 2-D tensor whose GGML type is in `keep_quantized` stays in its
        blocks (a QuantizedWeight: its rows are the HF weight's rows, so the rotary un-permutation
        below moves whole rows of blocks just as it moves rows of values)."""
        import gguf
        permute = self.arch == "llama"
        for t in self.reader.tensors:
            if t.name in _GGUF_SKIPPED:
                continue
            name = _gguf_to_hf_name(t.name)
            if name is None:  # checked at resolve time
                raise ModelLoadError(f"{self.path}: unknown GGUF tensor {t.name!r}")
            shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
            try:
                if t.tensor_type.name in keep_quantized and len(shape) == 2:
                    rows = np.asarray(t.data).view(np.uint8).reshape(shape[0], -1)
                    tensor = QuantizedWeight(t.tensor_type.name, torch.from_numpy(rows.copy()), shape)
                elif t.tensor_type == gguf.GGMLQuantizationType.F16:
                    arr = np.asarray(t.data).view(np.float16)
                    tensor = torch.from_numpy(arr.reshape(shape).copy())
                elif t.tensor_type == gguf.GGMLQuantizationType.BF16:
                    arr = np.asarray(t.data).view(np.uint16)
                    tensor = torch.from_numpy(arr.reshape(shape).copy()).view(torch.bfloat16)
                else:
                    arr = gguf.quants.dequantize(t.data, t.tensor_type)
                    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
                    if not arr.flags.writeable or not arr.flags.owndata:
                        arr = arr.copy()
                    tensor = torch.from_numpy(arr)
            except ModelLoadError:
                raise
            except Exception as e:
                raise ModelLoadError(
                    f"{self.path}: cannot read GGUF tensor {t.name!r} ({t.tensor_type.name}, ggml shape "
                    f"{list(int(x) for x in t.shape)}): {type(e).__name__}: {e}") from e
            if permute:
                heads = (config.num_attention_heads if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias"))
                         else config.num_key_value_heads if name.endswith(("self_attn.k_proj.weight",
                                                                           "self_attn.k_proj.bias"))
                         else None)
                if heads is not None and isinstance(tensor, QuantizedWeight):
                    tensor.blocks = _unpermute_rotary(tensor.blocks, heads)
                elif heads is not None:
                    tensor = _unpermute_rotary(tensor, heads)
            yield name, tensor

    # ---- tokenizer ----
    def _tokenizer_cache_path(self) -> str:
        st = os.stat(self.path)
        key = f"{self.path}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:20]
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.splitext(os.path.basename(self.path))[0])[:60]
        return os.path.join(kvserve_cache_dir(), "tokenizers", f"{stem}-{digest}")

    def load_tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        cache = self._tokenizer_cache_path()
        if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
            try:
                tok = transformers.AutoTokenizer.from_pretrained(cache, local_files_only=True)
                self._fix_tokenizer(tok)
                return tok
            except Exception as e:  # a broken cache entry: rebuild it
                logger.warning("ignoring unreadable tokenizer cache %s (%s: %s)", cache, type(e).__name__, e)
                shutil.rmtree(cache, ignore_errors=True)
        if self.field_length("tokenizer.ggml.tokens") is None:
            raise ModelLoadError(f"{self.path}: GGUF file has no tokenizer (no tokenizer.ggml.tokens metadata)")
        try:
            tok = transformers.AutoTokenizer.from_pretrained(
                os.path.dirname(self.path), gguf_file=os.path.basename(self.path), local_files_only=True)
        except Exception as e:
            raise ModelLoadError(
                f"{self.path}: transformers cannot build a tokenizer from the GGUF metadata "
                f"({type(e).__name__}: {e})") from e
        self._fix_tokenizer(tok)
        self._save_tokenizer(tok, cache)
        return tok

    def _fix_tokenizer(self, tok: transformers.PreTrainedTokenizerBase) -> None:
        template = self.get("tokenizer.chat_template")
        if template and not getattr(tok, "chat_template", None):
            tok.chat_template = str(template)
        for kind, attr in (("bos", "bos_token"), ("eos", "eos_token")):
            want = self._token_id(kind)
            if want is None or not 0 <= want < len(tok):
                continue
            if getattr(tok, f"{attr}_id", None) != want:
                setattr(tok, attr, tok.convert_ids_to_tokens(want))

    @staticmethod
    def _save_tokenizer(tok: transformers.PreTrainedTokenizerBase, cache: str) -> None:
        parent = os.path.dirname(cache)
        tmp = None
        try:
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
            tok.save_pretrained(tmp)
            try:
                os.rename(tmp, cache)   # atomic: the entry appears complete or not at all
                tmp = None
            except OSError:             # another process saved it first
                pass
        except Exception as e:
            logger.warning("could not cache the tokenizer under %s (%s: %s)", cache, type(e).__name__, e)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def resolve_gguf(path: str, load_format: str) -> ModelSource:
    g = GGUFFile(path)
    architecture, config = g.build_config()
    return ModelSource(path=path, hf_config=config, architecture=architecture, load_format=load_format,
                       checkpoint_format="gguf", weight_files=(path,), _reader=g)
