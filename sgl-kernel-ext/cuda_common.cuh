// Device helpers shared by the tensor-core kernels over ubcq bit-planes (cuda_fold_gemv.cu, cuda_grouped_gemm.cu).
// NVRTC has no include path here: nvrtc.source_text pastes this file where a kernel source includes it. Needs CT
// (0 bf16, 1 fp16: the 16-bit type of activations and MMA operands) defined before the include.

#ifndef CT
#error "CT must be defined before cuda_common.cuh"
#endif
#ifndef XT
#define XT 0  // dtype of the activations the prep kernels read: 0 bf16, 1 fp16, 2 fp32
#endif

#if CT == 0
#define MAGIC 0x43004300u  // the 16-bit pattern MAGIC | c is the value 128 + c
#define MMA_TYPE "bf16"
#else
#define MAGIC 0x64006400u  // 1024 + c
#define MMA_TYPE "f16"
#endif

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {  // (a & b) | c
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2ct(float f) {  // float -> the compute type, round to nearest even
    u16 h;
#if CT == 0
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}

__device__ __forceinline__ float ct2f(u16 h) {
#if CT == 0
    return __uint_as_float(((u32)h) << 16);
#else
    return h2f(h);
#endif
}

// Programmatic dependent launch (PDL, sm_90; cuda_fold.py launches with the attribute when FoldConfig.pdl): a kernel
// may start once every block of the one before it in the stream has called pdl_launch_dependents() (or exited).
// pdl_wait() holds each thread until that kernel has completed and its writes are visible, and since that kernel
// completes only after its own wait, everything earlier in the stream is complete then too. Every read of a kernel
// output and every global write come after pdl_wait(). Before it a kernel reads only what no kernel of the call writes
// (planes, tables, the page table) and what was written before the call's first programmatic launch (the routing and
// the alignment: prep waits for them before it lets w13 launch).
__device__ __forceinline__ void pdl_wait() {
#if defined(PDL) && PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(PDL) && PDL && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint4 lds128(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}

__device__ __forceinline__ void ldsm_x2(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r0), "=r"(r1) : "r"(addr) : "memory");
}

// 4 x 4 bit transposition inside every nibble of four words (two delta-swap stages, 4 shifts and 4 lop3 each):
// on return nibble i of w[j] holds bit j of nibble i of the old w[0..3] in its bits 0..3 (old w[r] -> bit r).
// Fed with the planes in reverse (w[r] = plane 3 - r), w[j] then holds in nibble i the 4-bit code (plane p at
// bit 3 - p) of input 4 i + j.
__device__ __forceinline__ u32 lop3_sel(u32 a, u32 b, u32 m) {  // (a & m) | (b & ~m)
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(m));
    return d;
}

// The two stages swap independent index bits (row bit 1 <-> column bit 1, row bit 0 <-> column bit 0), so either
// order transposes; BIT0_FIRST where rows 0 and 1 are both zero: the first stage then skips that pair.
template <bool BIT0_FIRST = false>
__device__ __forceinline__ void transpose4(u32* w) {
#pragma unroll
    for (int st = 0; st < 2; ++st) {
        if ((st == 0) != BIT0_FIRST) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {  // rows r, r + 2: bits 2-3 of row r <-> bits 0-1 of row r + 2
                const u32 a = w[r], b = w[r + 2];
                w[r] = lop3_sel(a, b << 2, 0x33333333u);
                w[r + 2] = lop3_sel(b, a >> 2, 0xCCCCCCCCu);
            }
        } else {
#pragma unroll
            for (int r = 0; r < 4; r += 2) {  // rows r, r + 1: bits 1, 3 of row r <-> bits 0, 2 of row r + 1
                const u32 a = w[r], b = w[r + 1];
                w[r] = lop3_sel(a, b << 1, 0x55555555u);
                w[r + 1] = lop3_sel(b, a >> 1, 0xAAAAAAAAu);
            }
        }
    }
}

// nibble codes of inputs 4 i + j (j = 0..3) from NP plane words (plane p -> bit TOP - p, NP <= TOP + 1 <= 4; the
// bits of missing planes 0); BIT0_FIRST: transpose4's stage order (the same codes)
template <int NP, int TOP = 3, bool BIT0_FIRST = false>
__device__ __forceinline__ void codes_of(const u32* planes, u32* out) {
    static_assert(NP >= 1 && NP <= TOP + 1 && TOP <= 3, "codes_of: NP planes at bits TOP .. TOP - NP + 1 of a nibble");
#pragma unroll
    for (int r = 0; r < 4; ++r) out[r] = r <= TOP && TOP - r < NP ? planes[TOP - r] : 0u;
    transpose4<BIT0_FIRST>(out);
}

// the mma operand (BIAS + c_e, BIAS + c_{e+4}) of nibbles e and e + 4 of v
__device__ __forceinline__ u32 code_pair(u32 v, int e) { return lop3_and_or(v >> (4 * e), 0x000F000Fu, MAGIC); }

template <int SEL>
__device__ __forceinline__ u32 prmt(u32 a, u32 b) {  // byte i of the result: byte (SEL >> 4 i) & 7 of {b, a}
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "n"(SEL));
    return d;
}

// Codes of up to 7 bits as bytes: hi holds bits 6..4 of each input's code c7 in its nibble (bit 3 clear), lo bits
// 3..0 (the nibbles of codes_of, the same inputs). Byte b of even is c7 of nibble 2 b, of odd c7 of nibble 2 b + 1,
// bit 7 of every byte 0: a code pair is then a byte permutation with no mask, and MAGIC | c7 is BIAS + c7 exactly
// (7 mantissa bits in bf16, 10 in fp16).
__device__ __forceinline__ void byte_codes(u32 hi, u32 lo, u32& even, u32& odd) {
    even = lop3_sel(hi << 4, lo, 0xF0F0F0F0u);
    odd = lop3_sel(hi, lo >> 4, 0xF0F0F0F0u);
}

// the mma operand (BIAS + c7_e, BIAS + c7_{e+4}) of nibbles e and e + 4 (the slots of code_pair): bytes e / 2 and
// e / 2 + 2 of even (e even) or odd (e odd) under MAGIC's exponent bytes 1 and 3
template <int E>
__device__ __forceinline__ u32 byte_pair(u32 even, u32 odd) {
    return prmt<E < 2 ? 0x7250 : 0x7351>(E & 1 ? odd : even, MAGIC);
}

// Q_SWITCH(q, CALL): CALL(Q) for the runtime bitwidth q, each Q <= PMAX a compiled body (ONLY_Q: one bitwidth
// only, for the instruction count of one body; tests and benchmarks never set it)
#ifdef ONLY_Q
#define CASE_Q(Q, CALL) \
    case Q:             \
        if (Q == ONLY_Q) CALL(Q); break;
#else
#define CASE_Q(Q, CALL) \
    case Q:             \
        if (Q <= PMAX) CALL(Q); break;
#endif
#define Q_SWITCH(q, CALL) \
    switch (q) {          \
        CASE_Q(1, CALL)   \
        CASE_Q(2, CALL)   \
        CASE_Q(3, CALL)   \
        CASE_Q(4, CALL)   \
        CASE_Q(5, CALL)   \
        CASE_Q(6, CALL)   \
        CASE_Q(7, CALL)   \
        CASE_Q(8, CALL)   \
        default: break;   \
    }

// element k of row r of a [rows, ld] activation matrix in the XT dtype, as float
__device__ __forceinline__ float load_x(const void* x, long long r, long long ld, int k) {
#if XT == 0
    return __uint_as_float(((u32)((const u16*)x)[r * ld + k]) << 16);
#elif XT == 1
    return h2f(((const u16*)x)[r * ld + k]);
#else
    return ((const float*)x)[r * ld + k];
#endif
}
