"""The computation behind `pagedweight calibrate` (the CLI and checkpoint reading are in pagedweight.tools.calibrate).

Runs the Hugging Face model (transformers, CPU, float32) on the text cut into prompts, captures the routed
inputs of every MoE layer, and computes per runtime block (layer, expert, w13|w2):
- the diagonal Hessians of gate, up and down in loss-weighted expert-output units over the tokens routed
  to the expert (planner.sensitivity.expert_output_hessians: w2's input second moments; gate/up errors
  carried through the SiLU-gate Jacobian and the down projection; each token's output error weighted by
  r^2 (dL/dy)^2 from a backward pass of the summed next-token loss), and the sensitivity
  s^b = sum h (W - W^b)^2 at every stored bitwidth, with W^b decoded from the AP checkpoint
  (docs/planner.md, eq. 2);
- routing masses m_{l,e} (eq. 1), bucket thresholds on m*E and the bucket multipliers mu;
- prompt-residual heads per (proj, b -> b-1): for every (prompt, expert) with enough routed tokens, the
  target log(d_p / g) where d_p is the increase of the mean loss-weighted squared error of the expert's output on that
  prompt's routed tokens (only this block quantized, measured exactly, nonlinearity included) and g the
  global damage, regressed on the prompt's normalised routed-input features.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from pagedweight.format.layout import BlockSpec
from pagedweight.planner.calibration import APIdentity, CalibrationData
from pagedweight.planner.moe_capture import MoELayerRef, OutputGradCapture, RoutedCapture, find_moe_layers
from pagedweight.planner.prompt_residual import (
    NUM_FEATURES,
    PromptResidualModel,
    features_from_sums,
    fit_head,
    transition_key,
)
from pagedweight.planner.routing_stats import (
    BucketConfig,
    bucket_multipliers,
    bucket_thresholds,
    default_floor_stages,
    routing_weight_sums,
)
from pagedweight.planner.sensitivity import SensitivityTable, expert_output_hessians, hessian_sensitivity

logger = logging.getLogger(__name__)


@runtime_checkable
class APBlocks(Protocol):
    """The AP checkpoint as calibration reads it: identity, names of routed expert blocks, decoded weights."""

    identity: APIdentity

    def block_name(self, layer: int, expert: int, proj: str) -> str:
        """AP tensor name of a routed expert's gate / up / down block."""
        ...

    def spec(self, name: str) -> BlockSpec: ...

    def weight_at(self, name: str, bits: int) -> torch.Tensor:
        """W^b [N, K] float32."""
        ...


@dataclass(frozen=True)
class CalibrateOptions:
    tokens: int = 8192  # calibration tokens in total
    prompt_tokens: int = 128  # tokens per prompt (the unit of the prompt residual)
    hot_fraction: float = 0.25
    cold_fraction: float = 0.25
    min_prompt_tokens: int = 4  # routed tokens of one prompt to one expert for a residual sample

    def __post_init__(self) -> None:
        if self.prompt_tokens < 8:
            raise ValueError(f"--prompt-tokens must be >= 8, got {self.prompt_tokens}")
        if self.tokens < 2 * self.prompt_tokens:
            raise ValueError(f"--tokens ({self.tokens}) must cover at least two prompts of {self.prompt_tokens}")
        if self.min_prompt_tokens < 1:
            raise ValueError(f"min_prompt_tokens must be >= 1, got {self.min_prompt_tokens}")


# ---- text -> prompts ---------------------------------------------------------------------------------
def prompts_from_text(text: str, tokenizer, options: CalibrateOptions) -> list[list[int]]:
    """Disjoint consecutive chunks of `prompt_tokens` tokens (BOS prepended when the tokenizer has one)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: options.tokens]
    bos = getattr(tokenizer, "bos_token_id", None)
    body = options.prompt_tokens - (1 if bos is not None else 0)
    prompts = [ids[i : i + body] for i in range(0, len(ids), body)]
    prompts = [p for p in prompts if len(p) >= body // 2]
    if len(prompts) < 2:
        raise ValueError(
            f"calibration text gives {len(ids)} tokens, fewer than two prompts of {options.prompt_tokens}; "
            "pass a longer --text file or a smaller --prompt-tokens"
        )
    return [([bos] if bos is not None else []) + p for p in prompts]


# ---- one MoE layer ----------------------------------------------------------------------------------
def _weighted_sq(err: torch.Tensor, f: torch.Tensor | None) -> torch.Tensor:
    """Per-token sum_m f_tm err_tm^2 (f None: plain squared norm)."""
    sq = err.double().pow(2)
    return (sq if f is None else sq * f).sum(1)


@dataclass
class LayerStats:
    sensitivity: dict[tuple[int, int, str], SensitivityTable]
    weight_sums: np.ndarray  # [E] routing weight per expert (numerator of eq. 1)
    ref_features: np.ndarray  # [E, 3] phi over all calibration tokens (NaN: never routed)
    samples: dict[str, list[tuple[np.ndarray, float]]]  # transition key -> (phi_norm, rho)
    unrouted: list[int]


def _prompt_feature_sums(norms: torch.Tensor, weights: torch.Tensor, prompt: torch.Tensor, num_prompts: int) -> torch.Tensor:
    """[P, 4]: (sum r|x|, sum r|x|^2, sum r, max |x|) per prompt."""
    out = torch.zeros(num_prompts, 4, dtype=torch.float64)
    out[:, 0].index_add_(0, prompt, (weights * norms).double())
    out[:, 1].index_add_(0, prompt, (weights * norms * norms).double())
    out[:, 2].index_add_(0, prompt, weights.double())
    out[:, 3].scatter_reduce_(0, prompt, norms.double(), reduce="amax", include_self=True)
    return out


def _per_prompt_mean(values: torch.Tensor, prompt: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    s = torch.zeros(counts.shape[0], dtype=torch.float64).index_add_(0, prompt, values.double())
    return s / counts.clamp(min=1)


def layer_statistics(
    ref: MoELayerRef,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    prompt: torch.Tensor,
    num_prompts: int,
    blocks: APBlocks,
    options: CalibrateOptions,
    out_grad: torch.Tensor | None = None,
) -> LayerStats:
    """Per-block statistics of one MoE layer. `out_grad` [T, H]: d(loss)/d(layer's routed output) per token;
    given, every error is weighted by F_tm = r_t^2 out_grad_tm^2 (loss units, docs/planner.md)."""
    ident = blocks.identity
    bitwidths = list(range(ident.bits_min, ident.bits_max + 1))
    num_experts = ref.num_experts
    weight_sums = routing_weight_sums(topk_weights, topk_ids, num_experts).double().numpy()
    sens: dict[tuple[int, int, str], SensitivityTable] = {}
    ref_features = np.full((num_experts, NUM_FEATURES), np.nan)
    samples: dict[str, list[tuple[np.ndarray, float]]] = defaultdict(list)
    unrouted = []
    for e in range(num_experts):
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        x, r, p = hidden[tok], topk_weights[tok, slot], prompt[tok]
        routed = x.shape[0] > 0
        if not routed:
            # Never routed during calibration: take the layer's whole input distribution as its best prior
            # for h (so its sensitivity is not zero), and no residual samples.
            unrouted.append(e)
            tok = torch.arange(hidden.shape[0])
            x, r, p = hidden, torch.ones(hidden.shape[0]), prompt
        # loss weight of each token's output error: the expert's output enters y with its routing weight
        # (an unrouted expert: the layer's mean routing weight)
        f = None
        if out_grad is not None:
            r_out = r if routed else torch.full_like(r, float(topk_weights.mean()))
            f = r_out[:, None].double().pow(2) * out_grad[tok].double().pow(2)
        w_gate, w_up = ref.gate_up(e)
        w_down = ref.down(e)
        a = ref.act(x @ w_gate.T) * (x @ w_up.T)
        hess = expert_output_hessians(x, w_gate, w_up, w_down, ref.act, f)
        names = {pj: blocks.block_name(ref.layer, e, pj) for pj in ("gate", "up", "down")}
        for pj, w in (("gate", w_gate), ("up", w_up), ("down", w_down)):
            spec = blocks.spec(names[pj])
            if (spec.out_features, spec.in_features) != tuple(w.shape):
                raise ValueError(f"AP block {names[pj]} is {spec.out_features}x{spec.in_features}, the model's is "
                                 f"{tuple(w.shape)}: the AP checkpoint was made from another model")
        s13, s2 = {}, {}
        err13, err2 = {}, {}  # bits -> per-token squared error of the expert's output (measured, exact)
        for b in bitwidths:
            g_b, u_b, d_b = (blocks.weight_at(names[pj], b) for pj in ("gate", "up", "down"))
            s13[b] = hessian_sensitivity(w_gate, g_b, hess.gate) + hessian_sensitivity(w_up, u_b, hess.up)
            s2[b] = hessian_sensitivity(w_down, d_b, hess.down)
            if routed:
                a_b = ref.act(x @ g_b.T) * (x @ u_b.T)
                err13[b] = _weighted_sq(((a_b - a) @ w_down.T), f)
                err2[b] = _weighted_sq((a @ (w_down - d_b).T), f)
        sens[(ref.layer, e, "w13")] = SensitivityTable(s13)
        sens[(ref.layer, e, "w2")] = SensitivityTable(s2)
        if not routed:
            continue
        norms = x.norm(dim=-1)
        ref_features[e] = features_from_sums(_prompt_feature_sums(norms, r, torch.zeros_like(p), 1).numpy())[0]
        counts = torch.bincount(p, minlength=num_prompts)
        phi = features_from_sums(_prompt_feature_sums(norms, r, p, num_prompts).numpy())
        with np.errstate(divide="ignore", invalid="ignore"):
            phi_norm = phi / ref_features[e]
        ok = (counts >= options.min_prompt_tokens).numpy()
        for proj, s_tab, err in (("w13", s13, err13), ("w2", s2, err2)):
            mean_err = {b: _per_prompt_mean(err[b], p, counts).numpy() for b in bitwidths}
            for b in bitwidths[1:]:
                g = s_tab[b - 1] - s_tab[b]
                if not g > 0:
                    continue
                d_p = mean_err[b - 1] - mean_err[b]
                for q in np.nonzero(ok & (d_p > 0))[0]:
                    samples[transition_key(proj, b, b - 1)].append((phi_norm[q], math.log(d_p[q] / g)))
    return LayerStats(sens, weight_sums, ref_features, dict(samples), unrouted)


# ---- the whole model -------------------------------------------------------------------------------
def calibrate_model(model, tokenizer, blocks: APBlocks, text: str, options: CalibrateOptions,
                    source: dict | None = None, progress: bool = True) -> CalibrationData:
    from tqdm.auto import tqdm

    num_layers = int(model.config.get_text_config().num_hidden_layers)  # Gemma-4: the decoder's, under text_config
    layers = find_moe_layers(model)
    num_experts = layers[0].num_experts
    if any(ref.num_experts != num_experts for ref in layers):
        raise ValueError("MoE layers with different expert counts are not supported by calibration")
    prompts = prompts_from_text(text, tokenizer, options)
    model.eval()
    # Forward + backward of the next-token loss (sum over the prompt) per prompt: the routed inputs of every
    # MoE layer and d(loss)/d(its routed output), which weights the output errors (loss units).
    with RoutedCapture(layers) as cap, OutputGradCapture(model, layers) as grads, torch.enable_grad():
        for i, ids in enumerate(tqdm(prompts, desc="calibrate: forward + backward", disable=not progress)):
            cap.prompt_index = i
            x = torch.tensor([ids])
            logits = model(input_ids=x, use_cache=False).logits
            torch.nn.functional.cross_entropy(logits[0, :-1].float(), x[0, 1:], reduction="sum").backward()
            for layer, g in grads.grads().items():
                cap.captured[layer].out_grad.append(g)
    masses = np.full((num_layers, num_experts), 1.0 / num_experts)
    ref_norm = np.full((num_layers, num_experts, NUM_FEATURES), np.nan)
    sensitivity: dict = {}
    samples: dict[str, list] = defaultdict(list)
    unrouted: dict[int, list[int]] = {}
    with torch.inference_mode():
        for ref in tqdm(layers, desc="calibrate: sensitivity + residual", disable=not progress):
            hidden, ids, weights, prompt = cap.captured[ref.layer].cat()
            out_grad = cap.captured[ref.layer].out_grad_cat()
            if out_grad is None or out_grad.shape != hidden.shape:
                raise RuntimeError(f"layer {ref.layer}: no output gradient per routed input (got "
                                   f"{None if out_grad is None else tuple(out_grad.shape)}, inputs {tuple(hidden.shape)})")
            st = layer_statistics(ref, hidden, ids, weights, prompt, len(prompts), blocks, options, out_grad)
            sensitivity.update(st.sensitivity)
            total = st.weight_sums.sum()
            if total > 0:
                masses[ref.layer] = st.weight_sums / total
            ref_norm[ref.layer] = st.ref_features
            for k, v in st.samples.items():
                samples[k].extend(v)
            if st.unrouted:
                unrouted[ref.layer] = st.unrouted
            cap.captured[ref.layer] = None  # free the layer's activations as we go
    moe_rows = [ref.layer for ref in layers]
    normalized = masses[moe_rows] * num_experts
    hot, cold = bucket_thresholds(normalized, options.hot_fraction, options.cold_fraction)
    buckets = BucketConfig(
        hot_threshold=hot,
        cold_threshold=cold,
        mu=bucket_multipliers(normalized, hot, cold),
        floor_stages=default_floor_stages(blocks.identity.bits_min, blocks.identity.bits_max),
    )
    heads = {}
    for key in sorted(samples):
        pts = samples[key]
        if len(pts) < NUM_FEATURES + 2:
            logger.info("prompt residual %s: only %d samples, no head (eta = 1)", key, len(pts))
            continue
        heads[key] = fit_head(np.stack([p for p, _ in pts]), np.array([t for _, t in pts]))
    if unrouted:
        logger.warning("experts never routed during calibration (sensitivity from the layer's inputs): %s", unrouted)
    src = dict(source or {})
    src.update(num_tokens=int(sum(len(p) for p in prompts)), num_prompts=len(prompts),
               prompt_tokens=options.prompt_tokens, unrouted_experts={str(k): v for k, v in unrouted.items()},
               residual_samples={k: len(v) for k, v in sorted(samples.items())},
               # median of log(measured / predicted damage) per transition: ~0 when s^b predicts the measured
               # expert-output error (both projections on one scale)
               residual_target_median={k: float(np.median([t for _, t in v])) for k, v in sorted(samples.items())})
    return CalibrationData(
        ap=blocks.identity,
        num_layers=num_layers,
        num_experts=num_experts,
        sensitivity=sensitivity,
        routing_mass=masses,
        buckets=buckets,
        residual=PromptResidualModel(heads, ref_norm),
        source=src,
    )
