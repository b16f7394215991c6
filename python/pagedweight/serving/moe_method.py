"""The paged-weight FusedMoE method: SGLang's MoE layers serve their experts from AP bit-planes.

It replaces UnquantizedFusedMoEMethod on every FusedMoE layer (see patches/fused_moe.py). The bf16 expert
parameters SGLang would create are zero-size placeholders whose weight_loader drops streamed-in weights, so
no bf16 expert weight is ever resident; after loading, the layer's AP planes are committed at the configured
bitwidth into a MoELayerStore, whose device page tables the kernel reads. SiLU- and GELU-gated experts (Gemma-4)
both run in the fused AP MoE kernels (pagedweight.kernels.activation).
"""

from __future__ import annotations

import abc
import logging
from typing import Any, Optional

import torch

from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
from sglang.srt.utils import set_weight_attrs

from pagedweight.config import PagedWeightConfig
from pagedweight.kernels.activation import GATE_ACTIVATIONS
from pagedweight.runtime.expert_store import MoELayerStore

logger = logging.getLogger(__name__)


def _drop_expert_weight(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """weight_loader for the placeholder bf16 expert params: the AP checkpoint replaces them."""
    return None


class PagedWeightMoEMethod(FusedMoEMethodBase):
    def __init__(self, cfg: PagedWeightConfig, layer_source: "LayerSource"):
        super().__init__()
        self.cfg = cfg
        self.layer_source = layer_source
        self.moe_runner_config = None
        self.store: Optional[MoELayerStore] = None

    # --- SGLang FusedMoEMethodBase interface -------------------------------------------------------
    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        if getattr(layer, "with_bias", False):
            raise ValueError(f"{layer.layer_name}: PagedWeight does not support MoE layers with biases yet")
        for name in ("w13_weight", "w2_weight"):
            param = torch.nn.Parameter(torch.empty(0, dtype=params_dtype), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {"weight_loader": _drop_expert_weight})
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size_per_partition = intermediate_size_per_partition

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config: Any) -> None:
        self.moe_runner_config = moe_runner_config
        activation = moe_runner_config.activation
        if activation not in GATE_ACTIVATIONS or not getattr(moe_runner_config, "is_gated", True):
            raise ValueError(
                f"{layer.layer_name}: PagedWeight serves gated experts with the activations {list(GATE_ACTIVATIONS)}, "
                f"got activation {activation!r}"
            )
        if activation != "silu" and getattr(layer, "layer_id", 0) == 0:
            logger.info("PagedWeight: %s-gated experts on the fused AP MoE kernels", activation)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        device = next((p.device for p in layer.parameters()), torch.device("cpu"))
        self.store = self.layer_source.load_layer(layer, device)
        layer._paged_weight_store = self.store  # the runtime finds every layer's store through the model

    def apply(self, layer: torch.nn.Module, dispatch_output: Any):
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        from pagedweight.kernels import ap_fused_moe

        if self.store is None:
            raise RuntimeError(f"{layer.layer_name}: PagedWeight planes were not loaded")
        x = dispatch_output.hidden_states
        topk_weights, topk_ids, _ = dispatch_output.topk_output
        cfg = self.moe_runner_config
        # Routing-weight mass per expert (eq. 1), on the device; policies read it between iterations.
        self.store.routing_mass.index_add_(0, topk_ids.reshape(-1).long(), topk_weights.reshape(-1).float())
        if self.store.observer is not None:
            self.store.observer.record(layer.layer_id, x, topk_ids, topk_weights)
        out = ap_fused_moe(
            x,
            topk_weights,
            topk_ids,
            self.store.w13.kernel_weights(),
            self.store.w2.kernel_weights(),
            activation=cfg.activation,
            apply_router_weight_on_input=cfg.apply_router_weight_on_input,
        )
        rsf = cfg.routed_scaling_factor
        if rsf is not None and rsf != 1.0 and not getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False):
            out = out * rsf
        return StandardCombineInput(hidden_states=out)


def layer_geometry(layer: torch.nn.Module) -> tuple[int, int, int]:
    """(local experts, hidden size, intermediate size per partition) of a FusedMoE layer."""
    return layer.num_local_experts, layer.hidden_size, layer.intermediate_size_per_partition


class LayerSource(abc.ABC):
    """Where a layer's planes come from (an AP checkpoint, or random planes for --load-format dummy)."""

    @abc.abstractmethod
    def load_layer(self, layer: torch.nn.Module, device: torch.device) -> MoELayerStore:
        """Build the layer's store (host planes and tables, an empty device page table); the runtime loads
        the device planes once the whole model is built."""
