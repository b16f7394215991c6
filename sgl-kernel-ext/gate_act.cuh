// The gate activation of a gated MoE expert, act = gate_act(gate) * up, chosen at compile time:
// ACT 0: SiLU (SwiGLU experts: Mixtral, Qwen, DeepSeek, GLM, OLMoE); ACT 1: GELU, the erf form (Gemma-4, as SGLang's
// gelu_and_mul computes it). NVRTC has no include path: nvrtc.source_text pastes this file where a kernel includes it.
#ifndef ACT
#define ACT 0
#endif
#if ACT != 0 && ACT != 1
#error "ACT must be 0 (silu) or 1 (gelu)"
#endif

__device__ __forceinline__ float gate_act(float g) {
#if ACT == 1
    return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
#else
    return g / (1.f + __expf(-g));
#endif
}
