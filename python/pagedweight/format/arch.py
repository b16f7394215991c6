"""Architecture adapters: Hugging Face expert tensor names <-> (layer, expert, proj) block keys.

The runtime addresses blocks as "layer 3, expert 5, gate" and never needs HF names; the converter and the
checkpoint reader translate through the adapter of the model's `model_type`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Union

Proj = Literal["gate", "up", "down"]
PROJS: tuple[str, ...] = ("gate", "up", "down")
SHARED = "shared"
ExpertId = Union[int, str]  # routed expert index, or SHARED


@dataclass(frozen=True, order=True)
class BlockKey:
    """One linear block: a routed expert (expert = index) or the shared expert (expert = "shared")."""

    layer: int
    expert: ExpertId
    proj: str

    def __post_init__(self) -> None:
        if self.proj not in PROJS:
            raise ValueError(f"proj must be one of {PROJS}, got {self.proj!r}")
        if not (isinstance(self.expert, int) or self.expert == SHARED):
            raise ValueError(f"expert must be an index or {SHARED!r}, got {self.expert!r}")

    def sort_key(self) -> tuple[int, int, int]:
        # Shared expert after the routed ones.
        expert = self.expert if isinstance(self.expert, int) else 1 << 30
        return (self.layer, expert, PROJS.index(self.proj))


@dataclass(frozen=True)
class ArchAdapter:
    """Name patterns of one model family's expert linears (each pattern matches the HF weight name)."""

    model_type: str
    routed: re.Pattern  # groups: layer, expert, proj name
    shared: re.Pattern | None  # groups: layer, proj name
    proj_names: dict[str, str]  # HF proj name -> gate/up/down
    num_experts_keys: tuple[str, ...]  # config keys that hold the routed expert count
    # 3-D tensors holding every routed expert of a layer (groups: layer, "gate_up_proj" | "down_proj"), as Gemma-4
    # checkpoints store them; the converter splits them into the per-expert names `routed` matches (format/fused_experts.py)
    fused: re.Pattern | None = None

    def classify(self, hf_name: str) -> BlockKey | None:
        """BlockKey of an expert linear weight name, None for every other tensor."""
        m = self.routed.fullmatch(hf_name)
        if m:
            return BlockKey(int(m[1]), int(m[2]), self.proj_names[m[3]])
        if self.shared is not None:
            m = self.shared.fullmatch(hf_name)
            if m:
                return BlockKey(int(m[1]), SHARED, self.proj_names[m[2]])
        return None

    def num_experts(self, config: dict) -> int:
        config = flat_config(config)
        for key in self.num_experts_keys:
            if isinstance(config.get(key), int):
                return config[key]
        raise ValueError(f"config.json of this {self.model_type} model has none of {self.num_experts_keys}")


def flat_config(config: dict) -> dict:
    """A config dict with its `text_config` keys lifted to the top (top-level keys win), so that the decoder's
    sizes of a multimodal checkpoint (Gemma-4's `gemma4`: the text model under `text_config`) read like a text
    model's. A config without `text_config` comes back as it is."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    return {**text, **{k: v for k, v in config.items() if k != "text_config"}}


_QWEN_PROJS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

_QWEN_EXPERTS = r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"


def _mlp_experts(model_type: str, shared: str | None, num_experts_keys: tuple[str, ...]) -> ArchAdapter:
    """An adapter for Qwen-style names: experts under `mlp.experts.E`, the shared expert (if any) under `mlp.<shared>`."""
    shared_re = None
    if shared is not None:
        shared_re = re.compile(rf"model\.layers\.(\d+)\.mlp\.{shared}\.(gate_proj|up_proj|down_proj)\.weight")
    return ArchAdapter(model_type, re.compile(_QWEN_EXPERTS), shared_re, _QWEN_PROJS, num_experts_keys)


def _gemma4(model_type: str, layers: str) -> ArchAdapter:
    """Gemma-4 MoE (`layers`: the decoder layers' name prefix): each layer runs a dense GELU MLP (`mlp.*`, kept as
    the shared expert) beside the routed experts, which the checkpoint stores fused as `experts.gate_up_proj`
    [E, 2I, H] (gate rows first) and `experts.down_proj` [E, H, I]; the router (`router.proj`, `router.scale`,
    `router.per_expert_scale`) stays dense. Per-expert names (`experts.E.gate_proj.weight`) are read too."""
    projs = r"(gate_proj|up_proj|down_proj)"
    return ArchAdapter(
        model_type,
        re.compile(rf"{layers}\.(\d+)\.experts\.(\d+)\.{projs}\.weight"),
        re.compile(rf"{layers}\.(\d+)\.mlp\.{projs}\.weight"),
        _QWEN_PROJS,
        ("num_experts",),
        fused=re.compile(rf"{layers}\.(\d+)\.experts\.(gate_up_proj|down_proj)"),
    )


ADAPTERS: dict[str, ArchAdapter] = {
    "qwen2_moe": _mlp_experts("qwen2_moe", "shared_expert", ("num_experts",)),
    "qwen3_moe": _mlp_experts("qwen3_moe", None, ("num_experts", "num_local_experts")),
    # OLMoE: Qwen3-MoE's expert names (no shared expert), query / key norms in attention (dense, untouched)
    "olmoe": _mlp_experts("olmoe", None, ("num_experts",)),
    # GLM-4.5 MoE: Qwen's expert names, one shared expert as `shared_experts` (plural); the first
    # `first_k_dense_replace` layers have a dense MLP (model.layers.N.mlp.gate_proj, untouched)
    "glm4_moe": _mlp_experts("glm4_moe", "shared_experts", ("n_routed_experts",)),
    # DeepSeek-V2: the same names (shared experts fused into one `shared_experts` MLP); attention is MLA, whose
    # latent projections stay dense and untouched
    "deepseek_v2": _mlp_experts("deepseek_v2", "shared_experts", ("n_routed_experts",)),
    # DeepSeek-V3: V2's names (its router's e_score_correction_bias is dense); the multi-token-prediction layers past
    # num_hidden_layers (num_nextn_predict_layers) are SGLang's NextN draft, not the served model: kept as they are
    "deepseek_v3": _mlp_experts("deepseek_v3", "shared_experts", ("n_routed_experts",)),
    # Gemma-4 MoE (e.g. Gemma-4-26B-A4B): the multimodal checkpoint (`gemma4`, decoder under model.language_model),
    # and a text-only one (`gemma4_text`, Gemma4ForCausalLM); vision / audio towers are dense and copied as they are
    "gemma4": _gemma4("gemma4", r"model\.language_model\.layers"),
    "gemma4_text": _gemma4("gemma4_text", r"model\.layers"),
    "mixtral": ArchAdapter(
        "mixtral",
        re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight"),
        None,
        {"w1": "gate", "w3": "up", "w2": "down"},
        ("num_local_experts",),
    ),
}

# Dense linears that `pagedweight convert --dense-linears` quantizes too (served under --paged-weight-scope
# all): the attention projections and an untied lm_head, named alike by every supported family, the decoder
# layers under `model.layers` or, in Gemma-4's multimodal checkpoint, `model.language_model.layers` (SGLang's
# Gemma4ForConditionalGeneration builds its text layers under that prefix too; its vision tower's attention is
# not matched). Routers stay bf16 (tiny, and their logits pick the experts), and so do the embeddings (a lookup,
# not a GEMM).
DENSE_LINEAR = re.compile(
    r"(?:model\.(?:language_model\.)?layers\.\d+\.self_attn\.(?:q_proj|k_proj|v_proj|o_proj)|lm_head)\.weight")

# Tensors under these name fragments are expert weights; one that no adapter pattern matches (e.g. the
# fused 3-D `experts.gate_up_proj` of some exporters) must not be silently copied as a dense tensor.
EXPERT_NAME_HINTS: tuple[str, ...] = (".experts.", ".shared_expert.", ".shared_experts.")


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def draft_layer_of(name: str, config: dict) -> int | None:
    """The layer of a multi-token-prediction tensor (DeepSeek-V3's `num_nextn_predict_layers` layers after the
    last decoder layer, which SGLang's NextN draft model loads), else None."""
    extra = config.get("num_nextn_predict_layers") or 0
    m = _LAYER_INDEX.match(name)
    if not extra or m is None:
        return None
    layer, first = int(m.group(1)), int(flat_config(config).get("num_hidden_layers", 0))
    return layer if first <= layer < first + int(extra) else None


def adapter_for(config: dict) -> ArchAdapter:
    """The adapter for a HF config dict; ValueError naming the supported types otherwise."""
    model_type = config.get("model_type")
    if model_type not in ADAPTERS:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the AP converter; supported MoE types: "
            f"{', '.join(sorted(ADAPTERS))}"
        )
    return ADAPTERS[model_type]


def block_name(hf_weight_name: str) -> str:
    """AP tensor name of a block: the HF weight name without '.weight' (docs/format.md)."""
    return hf_weight_name.removesuffix(".weight")
