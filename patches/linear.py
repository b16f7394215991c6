"""LinearBase and ParallelLMHead integration (--paged-weight-scope all): linears with AP blocks get the
dense AP method.

LinearBase.__init__ picks the layer's quant method before the subclass calls create_weights, so replacing
`quant_method` right after it returns is enough: no model file is touched, and linears without AP blocks
(routers, gates of shared experts, any linear the checkpoint did not quantize) keep SGLang's own method.
ParallelLMHead creates its weight inside the same __init__ that picks the method, so it is handed a
quant_config whose only answer is the AP method (no bf16 lm_head is ever allocated).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.layers.linear.LinearBase.__init__"
# LinearBase.__init__(input_size, output_size, skip_bias_add, params_dtype, quant_config, prefix)
_QUANT_CONFIG_POS, _PREFIX_POS = 4, 5

_SOURCES: dict[tuple[str, str], Any] = {}  # per process: (load_format, ap_dir) -> dense source


def dense_source_for(server_args: Any, cfg: Any):
    from pagedweight.serving.dense_linear import CheckpointDenseSource, DummyDenseSource
    from pagedweight.serving.layer_sources import layer_source_for

    load_format = str(getattr(server_args, "load_format", "auto"))
    key = (load_format, cfg.resolve_ap_dir(server_args.model_path))
    if key not in _SOURCES:
        # the MoE layers' source holds the opened checkpoint: one reader per process
        _SOURCES[key] = DummyDenseSource() if load_format == "dummy" else CheckpointDenseSource(
            layer_source_for(server_args, cfg).ckpt, k_eq_v=_attention_k_eq_v(server_args.model_path))
    return _SOURCES[key]


def _attention_k_eq_v(model_path: str) -> bool:
    """The model's `attention_k_eq_v` (Gemma-4; under text_config for the multimodal checkpoint), as SGLang reads it."""
    import json
    from pathlib import Path

    from pagedweight.format.arch import flat_config

    config = Path(model_path) / "config.json"
    if not config.is_file():
        return False
    return bool(flat_config(json.loads(config.read_text())).get("attention_k_eq_v", False))


def dense_bits(cfg: Any, source: Any) -> int:
    if cfg.dense_bits is not None:
        return cfg.dense_bits
    if cfg.bits is not None:
        return cfg.bits
    from pagedweight.serving.layer_sources import DUMMY_BITS_MAX

    return source.ckpt.bits_max if hasattr(source, "ckpt") else DUMMY_BITS_MAX


def linear_init_around(original, self, *args, **kwargs):
    from sglang.srt.runtime_context import get_server_args

    from pagedweight.patches.server_args import get_config

    original(self, *args, **kwargs)
    server_args = get_server_args()
    cfg = get_config(server_args)
    if not (cfg.enable and cfg.scope == "all"):
        return
    prefix = args[_PREFIX_POS] if len(args) > _PREFIX_POS else kwargs.get("prefix", "")
    quant_config = args[_QUANT_CONFIG_POS] if len(args) > _QUANT_CONFIG_POS else kwargs.get("quant_config")
    if not prefix or quant_config is not None:
        return  # a quantized model is refused by the FusedMoE hook
    from pagedweight.serving.dense_linear import DenseAPLinearMethod, ap_names_for

    source = dense_source_for(server_args, cfg)
    names = ap_names_for(prefix)
    if source.has_blocks(names):
        self.quant_method = DenseAPLinearMethod(source, prefix, names, dense_bits(cfg, source))


LM_HEAD_TARGET = "sglang.srt.layers.vocab_parallel_embedding.ParallelLMHead.__init__"


def lm_head_init_around(original, self, *args, **kwargs):
    from sglang.srt.runtime_context import get_server_args

    from pagedweight.patches.server_args import get_config

    server_args = get_server_args()
    cfg = get_config(server_args)
    prefix = kwargs.get("prefix", "")
    if not (cfg.enable and cfg.scope == "all") or kwargs.get("quant_config") is not None:
        return original(self, *args, **kwargs)
    from pagedweight.serving.dense_linear import LMHeadAPMethod
    from pagedweight.patches.quant_config import PagedWeightQuantConfig

    source = dense_source_for(server_args, cfg)
    names = (prefix,)
    if not prefix or not source.has_blocks(names):
        return original(self, *args, **kwargs)
    method = LMHeadAPMethod(source, prefix, names, dense_bits(cfg, source))
    result = original(self, *args, **{**kwargs, "quant_config": PagedWeightQuantConfig(lambda layer, p: method)})
    self.quant_method = method  # SGLang's CPU AMX path swaps in a packing method for any bf16 weight
    return result


def register(registry, hook_type) -> None:
    registry.register(TARGET, linear_init_around, hook_type.AROUND)
    registry.register(LM_HEAD_TARGET, lm_head_init_around, hook_type.AROUND)
