"""Run one offline sglang.Engine and print the full next-token distributions over a prompt as JSON.

Used as a subprocess by the quality test (the Engine needs the CPU-engine environment at process start):
    python -m tests.support.logprob_probe MODEL_DIR '{"enable_paged_weight": true, ...}' "prompt text"
Prints {"logprobs": [[...vocab...] per prompt position]} on the last line.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    model_dir, engine_kwargs, prompt = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    import sglang as sgl
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    engine = sgl.Engine(
        model_path=model_dir,
        device="cpu",
        attention_backend="torch_native",
        sampling_backend="pytorch",
        disable_cuda_graph=True,
        page_size=1,
        max_total_tokens=2048,
        mem_fraction_static=0.5,
        skip_server_warmup=True,
        **engine_kwargs,
    )
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
