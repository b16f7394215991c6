// Prefill dequantization of binary-coded (bcq) bit-planes into a dense bf16/fp16 scratch.
//
// Compiled at first use with NVRTC (cuda_dequant.py), one cubin per (CD, PMAX); no CUDA headers.
//
// bcq weight (docs/format.md): W[n, k] = t[q][n, g] + sum_{p<q} t[p][n, g] * (2 * bit_p[n, k] - 1), g = k / G.
// The scratch holds W in the tile column order of triton_tiles.py (input 32c + 16h + s -> column 32c + 2s + h),
// so the prefill GEMMs read the permuted activations contiguously, and the values are bit-identical to the
// Triton dequantization (same packed adds in the same plane order).
//
// Why a CUDA kernel: the prefill path is "dequantize every expert once + dense GEMM", and the Triton
// dequantization (64 x 128 tiles, 16-byte plane reads per row) reaches ~1.4 TB/s on the H200. Here the
// kernel is a flat stream: consecutive threads own consecutive quarters of consecutive 32-bit plane words,
// so each warp reads whole sectors of every plane and writes 512 contiguous bytes per store instruction
// (one word per thread, with 64-byte strided stores, ran at 1.9 TB/s). Per pair of weights and plane the
// work is one shift, one LOP3 (flip the packed scale's signs where the bit is 0) and one packed add.
//
// One thread: 8 weights (4 packed pairs) of one 32-bit word of one row of one expert of the chunk.
// grid.x: ceil(4 * N * K / 32 / NTHREADS), grid.y: experts of the chunk (e = e0 + blockIdx.y).
// CD: 0 bf16, 1 fp16 (scratch dtype; the fp16 tables are converted with round-to-nearest).

#ifndef CD
#error "CD must be defined"
#endif
#ifndef PMAX
#error "PMAX must be defined"
#endif

#define NTHREADS 256

typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ u32 add2(u32 a, u32 b) {
    u32 r;
#if CD == 0
    asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#endif
    return r;
}

// an fp16 table entry as a packed pair (v, v) of the scratch dtype
__device__ __forceinline__ u32 pack2(u16 h) {
#if CD == 0
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    u16 b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return (u32)b | ((u32)b << 16);
#else
    return (u32)h | ((u32)h << 16);
#endif
}

extern "C" __global__ void __launch_bounds__(NTHREADS) ap_bcq_dequant(
    const long long* __restrict__ page_table, u32* __restrict__ scratch, int e0, int num_experts, int N, int K,
    int G, int pt_stride) {  // ints: torch's launcher passes Python ints as C int
    const int e = e0 + (int)blockIdx.y;
    if (e >= num_experts) return;
    const int words_per_row = K >> 5;
    const long long words = (long long)N * words_per_row;
    const long long t = (long long)blockIdx.x * NTHREADS + threadIdx.x;
    const long long word = t >> 2;  // four threads per plane word, one 16-byte quarter of its output each
    if (word >= words) return;
    const int s0 = ((int)t & 3) * 4;  // the thread's pairs: inputs (s, s + 16) for s in s0 .. s0 + 3

    const long long* row = page_table + (long long)e * pt_stride;
    const int q = (int)row[0];
    const u16* table = (const u16*)row[1];  // fp16 [q + 1, N, K / G]
    const long long groups = K / G;
    const long long plane_stride = (long long)N * groups;
    const long long n = word / words_per_row;
    const long long gi = n * groups + ((word - n * words_per_row) * 32) / G;

    // the four threads of a word load the same addresses (one transaction); a warp covers 8 words = one
    // 32-byte sector per plane and stores 512 contiguous bytes
    u32 w[PMAX];
    u32 a[PMAX];
#pragma unroll
    for (int p = 0; p < PMAX; ++p) {
        if (p < q) {
            w[p] = __ldg((const u32*)row[2 + p] + word) >> s0;
            a[p] = pack2(__ldg(table + p * plane_stride + gi));
        }
    }
    const u32 off = pack2(__ldg(table + (long long)q * plane_stride + gi));
    u32 out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        // bits s0 + i and s0 + i + 16 of each word -> the sign positions 15 and 31 of the packed pair
        u32 acc = off;
#pragma unroll
        for (int p = 0; p < PMAX; ++p) {
            if (p < q) acc = add2(acc, a[p] ^ (~(w[p] << (15 - i)) & 0x80008000u));
        }
        out[i] = acc;
    }
    *(uint4*)(scratch + ((long long)blockIdx.y * words + word) * 16 + s0) = make_uint4(out[0], out[1], out[2], out[3]);
}
