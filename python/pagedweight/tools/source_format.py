"""What a source checkpoint's weights are stored as, and how the converter reads them back in float32.

Plain sources (bf16 / fp16 / fp32) are read as they are. FP8 block-quantized sources (DeepSeek-V3, Kimi-K2 and
the other `quantization_config = {"quant_method": "fp8", "weight_block_size": [bn, bk]}` checkpoints) store each
linear as float8 values plus a `<name>_scale_inv` tensor of one float32 per bn x bk block (the last blocks of a
row or column may be partial); the weight is value * scale_inv of its block. Other quantized sources are refused.
`load_source_model` gives calibration the source as a float32 transformers model, whichever the format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pagedweight.format.arch import draft_layer_of

SCALE_SUFFIX = "_scale_inv"  # "model.layers.0.mlp.experts.0.up_proj.weight" + SCALE_SUFFIX
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class SourceFormatError(ValueError):
    """A source whose storage the converter cannot read; the message names it and the fix."""


@dataclass(frozen=True)
class SourceFormat:
    """`kind` "plain" or "fp8_block"; `block` (rows, columns) of one scale for fp8_block."""

    kind: str = "plain"
    block: tuple[int, int] = (0, 0)

    @property
    def label(self) -> str:
        """The manifest's `source_format`: "plain" or e.g. "fp8_block128x128"."""
        return "plain" if self.kind == "plain" else f"fp8_block{self.block[0]}x{self.block[1]}"

    @classmethod
    def of_config(cls, config: dict) -> SourceFormat:
        quant = config.get("quantization_config")
        if not quant:
            return cls()
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        block = quant.get("weight_block_size") if isinstance(quant, dict) else None
        if method == "fp8" and isinstance(block, (list, tuple)) and len(block) == 2 and all(
                isinstance(b, int) and b > 0 for b in block):
            return cls("fp8_block", (int(block[0]), int(block[1])))
        what = f"quant_method {method!r}" + ("" if method != "fp8" else " without a 2-entry weight_block_size")
        raise SourceFormatError(
            f"config.json's quantization_config ({what}) is not a source the AP converter reads; it reads "
            "bf16 / fp16 / fp32 weights and FP8 block-quantized ones (quant_method fp8 with weight_block_size); "
            "convert from the unquantized checkpoint"
        )


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         name: str = "weight") -> torch.Tensor:
    """float32 [N, K] = weight * scale_inv of each (block[0] x block[1]) block; partial last blocks allowed."""
    if weight.dtype not in _FP8_DTYPES:
        raise SourceFormatError(f"{name}: dtype {weight.dtype}, expected float8 in an FP8 block-quantized source")
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise SourceFormatError(f"{name}: weight {tuple(weight.shape)} and scale {tuple(scale_inv.shape)} must be 2-D")
    n, k = weight.shape
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise SourceFormatError(
            f"{name}{SCALE_SUFFIX}: shape {tuple(scale_inv.shape)}, expected {want} for a [{n}, {k}] weight in "
            f"{bn} x {bk} blocks; the checkpoint does not match its config.json"
        )
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * scale


def float32_state_dict(model_dir: Path, config: dict, fmt: SourceFormat) -> dict[str, torch.Tensor]:
    """Every tensor of the source's safetensors shards in float32 (integer tensors as stored), FP8 weights
    dequantized with their block scales (which are left out), read shard by shard; the tensors of
    multi-token-prediction layers (DeepSeek-V3's `num_nextn_predict_layers`, not part of the causal LM) are skipped."""
    shard_of = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            shard_of.update(dict.fromkeys(f.keys(), shard))
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(shard_of.values())):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if name.endswith(SCALE_SUFFIX) or draft_layer_of(name, config) is not None:
                    continue
                tensor = f.get_tensor(name)
                scale = name + SCALE_SUFFIX
                if scale in shard_of:
                    with safe_open(str(shard_of[scale]), framework="pt") as g:
                        tensor = dequantize_fp8_block(tensor, g.get_tensor(scale), fmt.block, name)
                elif tensor.dtype in _FP8_DTYPES:
                    raise SourceFormatError(f"{name}: float8 weights without a {name}{SCALE_SUFFIX} block scale")
                state[name] = tensor.float() if tensor.is_floating_point() else tensor
    return state


def load_source_model(model_dir: str | Path):
    """(transformers causal LM in float32 on the CPU, its loading info), for calibration. A plain source
    (bf16 / fp16 / fp32) loads as it is; an FP8 block-quantized one is dequantized here (float32_state_dict) and
    handed to transformers as a state dict, its config without quantization_config (transformers' own FP8 path
    needs accelerate and gives bf16 at best). Either way the float32 model is held in host memory. Any other
    quantized source is refused in one line (SourceFormat.of_config)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    fmt = SourceFormat.of_config(config)
    if fmt.kind == "plain":
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    state = float32_state_dict(model_dir, config, fmt)
    hf_config = AutoConfig.from_pretrained(model_dir)
    del hf_config.quantization_config
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]  # the Auto class wants a path beside a state dict
    return model_class.from_pretrained(None, config=hf_config, state_dict=state, dtype=torch.float32,
                                       output_loading_info=True)
