"""Test-only: lets stock SGLang's CPU engine run GELU-gated MoE layers (Gemma-4), for the reference server.

SGLang 0.5.17's UnquantizedFusedMoEMethod.forward_cpu asserts activation == "silu", although its own torch MoE
(`fused_moe_native.moe_forward_native`, the CPU path it takes for SiLU without AMX) computes GELU experts too.
With PW_TEST_CPU_GELU_MOE=1 and this folder on PYTHONPATH (every SGLang process imports sitecustomize at start),
a non-SiLU layer goes to that function; SiLU layers and every other op stay as stock SGLang runs them. The
PagedWeight servers under test never get this folder.
"""

import os

if os.environ.get("PW_TEST_CPU_GELU_MOE") == "1":
    from sglang.srt.layers.quantization import unquant

    _stock_apply = unquant.UnquantizedFusedMoEMethod.apply

    def _apply(self, layer, dispatch_output):
        if self.moe_runner_config.activation == "silu":
            return _stock_apply(self, layer, dispatch_output)
        from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

        out = moe_forward_native(layer, dispatch_output.hidden_states, dispatch_output.topk_output, self.moe_runner_config)
        return StandardCombineInput(hidden_states=out)

    unquant.UnquantizedFusedMoEMethod.apply = _apply
