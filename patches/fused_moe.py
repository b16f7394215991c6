"""FusedMoE integration: every FusedMoE layer gets the paged-weight MoE method when PagedWeight is on.

FusedMoE asks its quant_config for a method. Models pass one quant_config to every layer, so instead of
registering a global quantization method we wrap only the argument given to FusedMoE.__init__: dense
layers keep SGLang's own methods, and no model file is touched.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang.srt.layers.quantization.base_config import QuantizationConfig

from pagedweight.config import PagedWeightConfig

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.__init__"
# FusedMoE.__init__(num_experts, hidden_size, intermediate_size, layer_id, top_k, num_fused_shared_experts,
#                   params_dtype, reduce_results, quant_config, ...): index of quant_config after self.
_QUANT_CONFIG_POS = 8


class PagedWeightMoEQuantConfig(QuantizationConfig):
    """The quant_config handed to FusedMoE: it answers with the paged-weight MoE method."""

    def __init__(self, cfg: PagedWeightConfig, source: Any):
        super().__init__()
        self.cfg = cfg
        self.source = source

    def get_name(self) -> str:
        return "pagedweight"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "PagedWeightMoEQuantConfig":
        raise TypeError("PagedWeightMoEQuantConfig is built by the PagedWeight plugin, not from a model config")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from pagedweight.moe_method import PagedWeightMoEMethod

        return PagedWeightMoEMethod(self.cfg, self.source)

    def get_scaled_act_names(self) -> list[str]:
        return []


def fused_moe_init_around(original, self, *args, **kwargs):
    from sglang.srt.runtime_context import get_server_args

    from pagedweight.layer_sources import layer_source_for
    from pagedweight.patches.server_args import get_config

    server_args = get_server_args()
    cfg = get_config(server_args)
    if not cfg.enable:
        return original(self, *args, **kwargs)
    args = list(args)
    positional = len(args) > _QUANT_CONFIG_POS
    quant_config: Optional[QuantizationConfig] = args[_QUANT_CONFIG_POS] if positional else kwargs.get("quant_config")
    if quant_config is not None:
        raise ValueError(
            f"--enable-paged-weight needs an unquantized (bf16/fp16) model, but this model's MoE layers use "
            f"the {quant_config.get_name()!r} quantization. Convert the original bf16 checkpoint with "
            f"`pagedweight convert` instead."
        )
    proxy = PagedWeightMoEQuantConfig(cfg, layer_source_for(server_args, cfg))
    if positional:
        args[_QUANT_CONFIG_POS] = proxy
    else:
        kwargs["quant_config"] = proxy
    return original(self, *args, **kwargs)


def register(registry, hook_type) -> None:
    registry.register(TARGET, fused_moe_init_around, hook_type.AROUND)
