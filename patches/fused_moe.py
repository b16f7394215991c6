"""FusedMoE integration: every FusedMoE layer gets the paged-weight MoE method when PagedWeight is on.

FusedMoE asks its quant_config for a method; we wrap only the argument given to FusedMoE.__init__
(quant_config.py), so dense layers keep SGLang's own methods and no model file is touched.
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang.srt.layers.quantization.base_config import QuantizationConfig

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.__init__"
# FusedMoE.__init__(num_experts, hidden_size, intermediate_size, layer_id, top_k, num_fused_shared_experts,
#                   params_dtype, reduce_results, quant_config, ...): index of quant_config after self.
_QUANT_CONFIG_POS = 8


def fused_moe_init_around(original, self, *args, **kwargs):
    from sglang.srt.runtime_context import get_server_args

    from pagedweight.serving.layer_sources import layer_source_for
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
    from pagedweight.serving.moe_method import PagedWeightMoEMethod
    from pagedweight.patches.quant_config import PagedWeightQuantConfig

    source = layer_source_for(server_args, cfg)
    proxy = PagedWeightQuantConfig(lambda layer, prefix: PagedWeightMoEMethod(cfg, source))
    if positional:
        args[_QUANT_CONFIG_POS] = proxy
    else:
        kwargs["quant_config"] = proxy
    return original(self, *args, **kwargs)


def register(registry, hook_type) -> None:
    registry.register(TARGET, fused_moe_init_around, hook_type.AROUND)
