"""Tiny random-weight MoE checkpoints (Qwen2-MoE, Mixtral, Qwen3-MoE, OLMoE, GLM-4.5, DeepSeek-V2, Gemma-4) for tests
and smoke runs.

`make_tiny_moe` writes a complete Hugging Face model directory that SGLang 0.5.17 can serve:
config.json + generation_config.json, model.safetensors with the classic per-expert tensor names
(`...mlp.experts.E.gate_proj.weight`, Mixtral's `...block_sparse_moe.experts.E.w1.weight`), and a small
byte-level BPE tokenizer trained on built-in English text, saved as a fast tokenizer with a chat template.

Transformers 5 keeps experts fused in memory (`experts.gate_up_proj` [E, 2I, H]) and un-fuses them on
save; `_ensure_per_expert_names` checks the file and splits any fused tensor itself, so the output does not
depend on that behaviour of the installed transformers version. Gemma-4 is the exception: its released checkpoints
store the experts fused, and so does its tiny one (tools/tiny_gemma4.py).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

TINY_ARCHS: tuple[str, ...] = ("qwen2_moe", "mixtral", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2", "gemma4")
# families whose checkpoints keep the fused 3-D expert tensors (the converter splits them)
FUSED_EXPERT_ARCHS: tuple[str, ...] = ("gemma4",)

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)

# ChatML-like; the tokenizer's post-processor adds BOS, so the template does not.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Built-in training text for the tokenizer (also handy as calibration text in tests). Plain, original
# prose so the tokenizer learns ordinary English merges; nothing is downloaded.
TINY_CORPUS = """\
The river ran quietly past the old mill, and the miller counted the sacks of grain before the sun went down.
A mixture of experts routes every token to a few small networks, and each network learns a different skill.
When the memory of the server runs short, the weights of the rarely used experts are stored with fewer bits.
The cache holds the keys and values of every token that the model has already read in the conversation.
She opened the window, looked at the grey sky, and decided that the walk to the market could wait until noon.
Numbers such as 3, 14, 159 and 2653 appear in tables, prices, dates and the pages of long reports.
The quick brown fox jumps over the lazy dog while the farmer repairs the fence near the northern field.
Every morning the children walked to school along the canal, talking about games, books and the weather.
A good engineer writes small functions, names them clearly, and tests the parts that are easy to get wrong.
The library kept maps of the coast, letters from sailors, and a diary that described a storm in great detail.
Questions and answers: what is the capital of France? Paris is the capital of France. How many days are in a week? Seven.
The orchestra tuned their instruments, the hall grew silent, and the first notes of the symphony filled the room.
Rain fell on the roofs of the city for three days, and the streets shone under the yellow light of the lamps.
To bake bread, mix flour, water, salt and yeast, knead the dough, let it rise, and bake it in a hot oven.
The planets move around the sun in nearly circular orbits, and the moon moves around the earth once a month.
He wrote the report in the evening, checked every number twice, and sent it to the office before midnight.
"""


@dataclass(frozen=True)
class TinyMoESizes:
    """Shapes of the tiny model. Expert linear in_features (hidden, moe_intermediate) must be multiples of 8."""

    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 128  # qwen2_moe's shared expert; glm4_moe's dense first layer; gemma4's MLP
    vocab_size: int = 512
    max_position_embeddings: int = 4096

    def validate(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if value <= 0 or value % 8:
                raise ValueError(f"{name}={value}: expert linear in_features must be positive multiples of 8")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}: "
                "hidden_size must divide by num_heads and num_heads by num_kv_heads"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size={self.vocab_size} is too small for a byte-level tokenizer; use >= {256 + len(SPECIAL_TOKENS)}"
            )


def _hf_config(arch: str, sizes: TinyMoESizes, dtype: str):
    """Build the transformers config object of `arch` with the tiny sizes."""
    import transformers

    common = dict(
        vocab_size=sizes.vocab_size,
        hidden_size=sizes.hidden_size,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_kv_heads,
        num_experts_per_tok=sizes.top_k,
        max_position_embeddings=sizes.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=0,  # token ids of SPECIAL_TOKENS, which the tokenizer trainer places first
        eos_token_id=1,
        pad_token_id=2,
    )
    if arch == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **common,
            num_experts=sizes.num_experts,
            moe_intermediate_size=sizes.moe_intermediate_size,
            shared_expert_intermediate_size=sizes.shared_expert_intermediate_size,
            intermediate_size=sizes.shared_expert_intermediate_size,
            decoder_sparse_step=1,
            norm_topk_prob=False,
        )
    elif arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common,
            num_experts=sizes.num_experts,
            moe_intermediate_size=sizes.moe_intermediate_size,
            intermediate_size=sizes.moe_intermediate_size * 2,
            head_dim=sizes.hidden_size // sizes.num_heads,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
    elif arch == "olmoe":
        # OLMoE is multi-head (SGLang's olmoe.py sizes its key norm by hidden_size): as many KV heads as heads
        config = transformers.OlmoeConfig(
            **{**common, "num_key_value_heads": sizes.num_heads},
            num_experts=sizes.num_experts,
            intermediate_size=sizes.moe_intermediate_size,
            norm_topk_prob=False,
        )
    elif arch == "glm4_moe":
        # GLM-4.5 MoE: sigmoid routing with a score-correction bias, one shared expert, the first layer dense
        config = transformers.Glm4MoeConfig(
            **common,
            n_routed_experts=sizes.num_experts,
            n_shared_experts=1,
            moe_intermediate_size=sizes.moe_intermediate_size,
            intermediate_size=sizes.shared_expert_intermediate_size,
            head_dim=sizes.hidden_size // sizes.num_heads,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            partial_rotary_factor=0.5,
        )
    elif arch == "deepseek_v2":
        # DeepSeek-V2: multi-head latent attention (compressed KV), two shared experts, the first layer dense
        head = sizes.hidden_size // sizes.num_heads
        config = transformers.DeepseekV2Config(
            **{**common, "num_key_value_heads": sizes.num_heads},
            n_routed_experts=sizes.num_experts,
            n_shared_experts=2,
            moe_intermediate_size=sizes.moe_intermediate_size,
            intermediate_size=sizes.shared_expert_intermediate_size,
            first_k_dense_replace=1,
            kv_lora_rank=2 * head,
            q_lora_rank=None,
            qk_nope_head_dim=head,
            qk_rope_head_dim=head // 2,
            v_head_dim=head,
            topk_method="greedy",
            # YaRN as in the released checkpoints (SGLang's CPU rotary embedding takes only deepseek_yarn)
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                             "original_max_position_embeddings": sizes.max_position_embeddings // 2,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
        )
        config.moe_layer_freq = 1  # keys of the released config.json that SGLang's deepseek_v2.py reads
        config.scoring_func = "softmax"
    elif arch == "gemma4":
        from pagedweight.tools.tiny_gemma4 import gemma4_config

        return gemma4_config(sizes, dtype)
    elif arch == "mixtral":
        config = transformers.MixtralConfig(
            **common,
            num_local_experts=sizes.num_experts,
            intermediate_size=sizes.moe_intermediate_size,
        )
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {TINY_ARCHS}")
    config.dtype = dtype
    return config


def train_tiny_tokenizer(vocab_size: int, corpus: str = TINY_CORPUS):
    """Byte-level BPE trained on `corpus`; special tokens get ids 0..4 in SPECIAL_TOKENS order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return tokenizer


def write_tokenizer(out_dir: Path, vocab_size: int, max_length: int) -> None:
    tokenizer = train_tiny_tokenizer(vocab_size)
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"tokenizer trainer placed special tokens at {ids}, expected 0..{len(ids) - 1}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    special_map = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


_FUSED_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def _per_expert_names(arch: str) -> tuple[str, str, str, str]:
    """(module under the layer, gate name, up name, down name) in the classic HF per-expert layout."""
    if arch == "mixtral":
        return "block_sparse_moe", "w1", "w3", "w2"
    return "mlp", "gate_proj", "up_proj", "down_proj"


def _ensure_per_expert_names(weights_path: Path, arch: str) -> None:
    """Rewrite fused 3-D expert tensors (transformers 5 in-memory layout) as per-expert 2-D tensors."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(weights_path))
    if not any(_FUSED_EXPERT.match(k) for k in state):
        return
    module, gate, up, down = _per_expert_names(arch)
    out = {}
    for key, tensor in state.items():
        match = _FUSED_EXPERT.match(key)
        if match is None:
            out[key] = tensor
            continue
        # "model.layers.L.mlp.experts" -> "model.layers.L.<module>.experts"
        prefix = re.sub(r"\.mlp\.experts$", f".{module}.experts", match["prefix"])
        for e in range(tensor.shape[0]):
            if match["kind"] == "gate_up_proj":
                # transformers computes gate, up = (x @ gate_up_proj[e].T).chunk(2): gate rows come first.
                g, u = tensor[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.{gate}.weight"] = g.contiguous()
                out[f"{prefix}.{e}.{up}.weight"] = u.contiguous()
            else:
                out[f"{prefix}.{e}.{down}.weight"] = tensor[e].contiguous()
    save_file(out, str(weights_path), metadata={"format": "pt"})


def make_tiny_moe(
    out_dir: str | Path,
    arch: str = "qwen2_moe",
    seed: int = 0,
    *,
    sizes: TinyMoESizes | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
) -> Path:
    """Write a tiny random MoE model of `arch` to `out_dir` and return the directory.

    Deterministic for a given (arch, seed, sizes, dtype): two calls produce byte-identical files.
    """
    import torch
    import transformers

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {TINY_ARCHS}")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype!r}")
    sizes = sizes or TinyMoESizes()
    sizes.validate()
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True (CLI: --force) to replace it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    config = _hf_config(arch, sizes, dtype)
    model_cls = {
        "qwen2_moe": transformers.Qwen2MoeForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
        "olmoe": transformers.OlmoeForCausalLM,
        "glm4_moe": transformers.Glm4MoeForCausalLM,
        "deepseek_v2": transformers.DeepseekV2ForCausalLM,
        "gemma4": transformers.Gemma4ForConditionalGeneration,
    }[arch]
    # Seed the global RNG only inside a fork so the caller's RNG state is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    weights = sorted(out.glob("*.safetensors"))
    if len(weights) != 1:
        raise RuntimeError(f"expected one model.safetensors in {out}, found {[p.name for p in weights]}")
    if arch not in FUSED_EXPERT_ARCHS:
        _ensure_per_expert_names(weights[0], arch)
    if arch == "gemma4":  # the processor files of the multimodal checkpoint, so sglang.launch_server can load it
        from pagedweight.tools.tiny_gemma4 import GEMMA4_PROCESSOR_TOKENS, write_gemma4_processor

        write_tokenizer(out, sizes.vocab_size - GEMMA4_PROCESSOR_TOKENS, sizes.max_position_embeddings)
        write_gemma4_processor(out, sizes.vocab_size)
    else:
        write_tokenizer(out, sizes.vocab_size, sizes.max_position_embeddings)
    # Chat turns end with <|im_end|>, plain completions with </s>: both stop generation.
    generation_config_path = out / "generation_config.json"
    generation_config = json.loads(generation_config_path.read_text())
    generation_config["eos_token_id"] = [SPECIAL_TOKENS.index(EOS_TOKEN), SPECIAL_TOKENS.index(IM_END)]
    generation_config_path.write_text(json.dumps(generation_config, indent=2, sort_keys=True) + "\n")
    return out


def _positive_multiple_of_8(text: str) -> int:
    value = int(text)
    if value <= 0 or value % 8:
        raise argparse.ArgumentTypeError(f"{value} is not a positive multiple of 8")
    return value


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-tiny", help="write a tiny random-weight MoE model (with tokenizer) for tests and smoke runs"
    )
    parser.add_argument("--arch", choices=TINY_ARCHS, default="qwen2_moe")
    parser.add_argument("--out", required=True, type=Path, help="output model directory")
    parser.add_argument("--seed", type=int, default=0)
    defaults = TinyMoESizes()
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--hidden-size", type=_positive_multiple_of_8, default=defaults.hidden_size)
    parser.add_argument("--num-experts", type=int, default=defaults.num_experts)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    parser.add_argument("--moe-intermediate-size", type=_positive_multiple_of_8, default=defaults.moe_intermediate_size)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    parser.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    sizes = TinyMoESizes(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_experts=args.num_experts,
        top_k=args.top_k,
        moe_intermediate_size=args.moe_intermediate_size,
        vocab_size=args.vocab_size,
    )
    path = make_tiny_moe(args.out, args.arch, args.seed, sizes=sizes, dtype=args.dtype, overwrite=args.force)
    print(f"wrote tiny {args.arch} model to {path}")
    return 0
