"""Run one offline sglang.Engine and print the full next-token distributions over a prompt as JSON.

Used as a subprocess by the quality test (the Engine needs the CPU-engine environment at process start):
    python -m tests.support.logprob_probe MODEL_DIR '{"enable_paged_weight": true, ...}' "prompt text"
Prints {"logprobs": [[...vocab...] per prompt position]} on the last line.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# PW_PROBE_DEVICE=cuda runs the probes on the GPU machine (real Triton kernels, CUDA graphs off) instead of the
# CPU engine; the tests that use `distributions` then check the GPU serving path with the same asserts.
PROBE_DEVICE = os.environ.get("PW_PROBE_DEVICE", "cpu")
_CPU_ENGINE_ENV = ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET", "LD_LIBRARY_PATH")


def distributions(model_dir, engine_kwargs: dict, env: dict[str, str], prompt: str, log_path=None) -> list[list[float]]:
    """Next-token log-distributions at every prompt position, from an Engine in a subprocess (its log, the
    engine's stderr, written to `log_path` when given)."""
    env = dict(env)
    if PROBE_DEVICE != "cpu":
        for key in _CPU_ENGINE_ENV:
            env.pop(key, None)
        for key in ("PW_PROBE_DEVICE", "LD_LIBRARY_PATH"):
            if key in os.environ:
                env[key] = os.environ[key]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    r = subprocess.run(
        [sys.executable, "-m", "tests.support.logprob_probe", str(model_dir), json.dumps(engine_kwargs), prompt],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if log_path is not None:
        Path(log_path).write_text(r.stderr)
    assert r.returncode == 0, f"engine probe failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])["logprobs"]


def mean_kl(ref: list[list[float]], got: list[list[float]]) -> float:
    """Mean over positions of KL(ref || got) in nats."""
    assert len(ref) == len(got) and ref
    total = 0.0
    for p_row, q_row in zip(ref, got):
        total += sum(math.exp(p) * (p - q) for p, q in zip(p_row, q_row) if p > -math.inf)
    return total / len(ref)


def main() -> None:
    model_dir, engine_kwargs, prompt = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    import sglang as sgl
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size  # multimodal configs nest it
    on_gpu = PROBE_DEVICE != "cpu"
    defaults = dict(
        model_path=model_dir,
        device=PROBE_DEVICE,
        attention_backend="triton" if on_gpu else "torch_native",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        page_size=1,
        max_total_tokens=2048,
        mem_fraction_static=0.2 if on_gpu else 0.5,
        skip_server_warmup=True,
    )
    engine = sgl.Engine(**{**defaults, **engine_kwargs})  # a test may override a default (Gemma-4: triton attention)
    try:
        out = engine.generate(
            prompt=prompt,
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=vocab,
        )
        rows = []
        for pos in out["meta_info"]["input_top_logprobs"][1:]:  # position 0 has no prediction
            dense = [float("-inf")] * vocab
            for lp, tok, _ in pos:
                dense[tok] = lp
            rows.append(dense)
        print(json.dumps({"logprobs": rows}))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
