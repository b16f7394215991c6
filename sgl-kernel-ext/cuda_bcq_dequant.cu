// Prefill dequantization of binary-coded (bcq) bit-planes into a dense bf16/fp16 scratch.
//
// Compiled at first use with NVRTC (cuda_dequant.py), one cubin per (CD, PMAX, UNIFORM); no CUDA headers.
//
// bcq weight (docs/format.md): W[n, k] = t[q][n, g] + sum_{p<q} t[p][n, g] * (2 * bit_p[n, k] - 1), g = k / G.
// UNIFORM (table kind ubcq): the table is [2, N, K / G], t[0] the scale and t[1] the offset, and plane p's
// coefficient is t[0][n, g] * 2^(q-1-p) (exact in float32; rounded to the scratch dtype like a bcq scale).
// The scratch holds W in the tile column order of triton_tiles.py (input 32c + 16h + s -> column 32c + 2s + h),
// so the prefill GEMMs read the permuted activations contiguously, and the values are bit-identical to the
// Triton dequantization (same packed adds in the same plane order).
//
// Why a CUDA kernel: the prefill path is "dequantize every expert once + dense GEMM", and the Triton
// dequantization (64 x 128 tiles, 16-byte plane reads per row) reaches ~1.4 TB/s on the H200. Here the
// kernel is a flat stream: consecutive threads own consecutive 32-bit plane words (a warp reads 128
// contiguous bytes of every plane), and each warp's 2 KB of output goes through shared memory so every
// store instruction writes 512 contiguous bytes (64-byte strided stores straight from registers ran at
// 1.9 TB/s). Per pair of weights and plane the work is one shift, one LOP3 (flip the packed scale's signs
// where the bit is 0) and one packed add; index math is 32-bit (64-bit division was a measurable cost).
//
// One thread: the 32 weights of one plane word of one row of one expert of the chunk.
// grid.x: ceil(N * K / 32 / NTHREADS), grid.y: experts of the chunk (e = e0 + blockIdx.y).
// CD: 0 bf16, 1 fp16 (scratch dtype; the fp16 tables are converted with round-to-nearest).

#ifndef CD
#error "CD must be defined"
#endif
#ifndef PMAX
#error "PMAX must be defined"
#endif
#ifndef UNIFORM
#define UNIFORM 0
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

// fp16 scale times 2^e as a packed pair of the scratch dtype (the product is exact in float32)
__device__ __forceinline__ u32 pack2_scaled(u16 h, int e) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    f *= (float)(1u << e);
    u16 b;
#if CD == 0
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(f));
#endif
    return (u32)b | ((u32)b << 16);
}

extern "C" __global__ void __launch_bounds__(NTHREADS) ap_bcq_dequant(
    const long long* __restrict__ page_table, u32* __restrict__ scratch, int e0, int num_experts, int N, int K,
    int G, int pt_stride) {  // ints: torch's launcher passes Python ints as C int
    __shared__ uint4 stage[NTHREADS * 4];  // each warp's 32 x 64 output bytes, transposed for the stores
    const int e = e0 + (int)blockIdx.y;
    if (e >= num_experts) return;  // uniform over the block
    const unsigned words_per_row = (unsigned)K >> 5;
    const unsigned words = (unsigned)N * words_per_row;  // < 2^31 (the launcher checks)
    const unsigned lane = threadIdx.x & 31;
    const unsigned warp_first = blockIdx.x * NTHREADS + (threadIdx.x & ~31u);
    const unsigned word = warp_first + lane;
    const bool valid = word < words;  // no early exit: the whole warp takes part in the transposed stores

    const long long* row = page_table + (long long)e * pt_stride;
    const int q = (int)row[0];
    const u16* table = (const u16*)row[1];  // fp16 [q + 1, N, K / G] (UNIFORM: [2, N, K / G])
    const unsigned groups = (unsigned)K / (unsigned)G;
    const unsigned n = word / words_per_row;
    const unsigned gi = n * groups + (word - n * words_per_row) / ((unsigned)G >> 5);
    const unsigned plane_stride = (unsigned)N * groups;

    u32 w[PMAX];
    u32 a[PMAX];
    u32 off = 0;
#pragma unroll
    for (int p = 0; p < PMAX; ++p) {
        w[p] = 0;
        a[p] = 0;
        if (valid && p < q) {
            w[p] = __ldg((const u32*)row[2 + p] + word);
#if UNIFORM
            a[p] = pack2_scaled(__ldg(table + gi), q - 1 - p);
#else
            a[p] = pack2(__ldg(table + p * plane_stride + gi));
#endif
        }
    }
    if (valid) off = pack2(__ldg(table + (UNIFORM ? 1u : (unsigned)q) * plane_stride + gi));
    u32 out[16];
#pragma unroll
    for (int s = 0; s < 16; ++s) {
        // bits s and s + 16 of each word -> the sign positions 15 and 31 of the packed pair
        u32 acc = off;
#pragma unroll
        for (int p = 0; p < PMAX; ++p) {
            if (p < q) acc = add2(acc, a[p] ^ (~(w[p] << (15 - s)) & 0x80008000u));
        }
        out[s] = acc;
    }
    // Stage the lane's four 16-byte quarters (slot rotated by lane / 2: conflict-free in both directions),
    // then each store instruction writes 512 contiguous bytes of the warp's 2 KB run.
    uint4* mine = stage + (threadIdx.x & ~31u) * 4;
#pragma unroll
    for (int j = 0; j < 4; ++j)
        mine[lane * 4 + ((j + (lane >> 1)) & 3)] = make_uint4(out[4 * j], out[4 * j + 1], out[4 * j + 2], out[4 * j + 3]);
    __syncwarp();
    uint4* dst = (uint4*)(scratch + ((long long)blockIdx.y * words + warp_first) * 16);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const unsigned m = r * 32 + lane;  // quarter m of the run: word m / 4, quarter m % 4
        const unsigned src = m >> 2;
        if (warp_first + src < words) dst[m] = mine[src * 4 + (((m & 3) + (src >> 1)) & 3)];
    }
}
