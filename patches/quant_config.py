"""The quant_config PagedWeight hands to one SGLang layer's constructor: it answers with PagedWeight's method.

Models pass one quant_config to every layer, so instead of registering a global quantization method the
hooks (fused_moe.py, linear.py) wrap only the argument given to the layers PagedWeight serves; every other
layer keeps SGLang's own method.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from sglang.srt.layers.quantization.base_config import QuantizationConfig


class PagedWeightQuantConfig(QuantizationConfig):
    """`get_quant_method(layer, prefix)` returns `make_method(layer, prefix)`."""

    def __init__(self, make_method: Callable[[torch.nn.Module, str], Any]):
        super().__init__()
        self.make_method = make_method

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
    def from_config(cls, config: dict[str, Any]) -> "PagedWeightQuantConfig":
        raise TypeError("PagedWeightQuantConfig is built by the PagedWeight plugin, not from a model config")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        return self.make_method(layer, prefix)

    def get_scaled_act_names(self) -> list[str]:
        return []
