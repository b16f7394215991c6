// Small-batch AP GEMV/GEMM over ubcq bit-planes on tensor cores: planes -> fp16 weights in registers -> mma.
//
// Compiled at first use with NVRTC (cuda_mma.py), one cubin per (MODE, NT, PMAX, G, DIRECT); no CUDA headers.
//
// ubcq weight (docs/format.md): W[n, k] = 2 s * c + (o - s * (2^q - 1)), c = the q-bit code whose bit q-1-p
// is plane p, (s, o) = table[0 / 1][n, k / G]. The LUT kernel (cuda_lut_gemv.cu) pays one shared-memory
// lookup per plane nibble and (token, slot) pair, so its cost grows with the pairs of a block; here the
// pairs ride in the N dimension of mma.sync.m16n8k16 and cost nothing until a block holds more than 8.
// Per weight the work is a few integer ops, all SWAR on 32-bit plane words:
//   1. bit transposition: for q <= 4, out_j (j = 0..3) holds in nibble i the code of weight 4 i + j
//      (out_j = sum_p ((P_p >> j) & 0x11111111) << (q-1-p), a shift and a lop3 per plane); for q > 4 the
//      same with bytes (out_j, j = 0..7, byte i = weight 8 i + j);
//   2. code -> fp16 with the exponent trick: (out >> s) & 0x000F000F | 0x64006400 is the half2
//      (1024 + c_a, 1024 + c_b), exact; minus 1024, then one fma.f16x2 with (2 s, o - s (2^q - 1));
//   3. mma.sync with the activations as B.
// The weights of one mma land in the fragment slots in the order the transposition leaves them, so the
// activations are stored permuted the same way (ap_mma_prep: within each 32-input word, position
// pos = 8 j + 4 m + 2 r + h holds input k = j + 8 m + 4 r + 16 h), as fp16 scaled by a power of two per row
// so that no activation overflows fp16 (the scale is undone on the output; bf16 inputs convert exactly).
//
// Layout of one warp's work: 16 output rows (n0 + g and n0 + g + 8, g = lane / 4) x the block's K slice in
// steps of 512 inputs; lane t = lane % 4 owns the 128-input chunk 4 s + t of step s (one 16-byte load per
// plane and row). mma kk = 2 j + m of a 32-input word takes half2 (j, 2m) and (j, 2m + 1) of the nibble
// path, (j, m) and (j + 4, m) of the byte path, and activation words 2 m, 2 m + 1 of the 16-byte load at
// pos 8 j. NT n-tiles of 8 (token, slot) pairs share every dequantized A fragment.
//
// MODE 0: MoE gate/up, out h [num_pairs, N] float32, row = pair. MODE 1: MoE down, out [M, N] float32, row =
// pair / topk, times the routing weight (unless it was applied on the input). MODE 2: dense linear.
// K slices (blockIdx.z) and pairs are summed with float32 atomics into a zeroed output.

#ifndef MODE
#error "MODE must be defined"
#endif
#ifndef NT
#define NT 1  // n-tiles of 8 (token, slot) pairs per block
#endif
#ifndef PMAX
#define PMAX 8
#endif
#ifndef G
#define G 128
#endif
#ifndef XT
#define XT 0
#endif
#ifndef MINB
#define MINB 1  // blocks per SM the register allocation must allow (__launch_bounds__)
#endif
#ifndef KH
#define KH 0  // K is a multiple of 64, not of 128: plane rows (K / 8 bytes) are 8-byte aligned, so the planes load in
              // 8-byte halves, and the last chunk of K holds 64 inputs (its second half is never read)
#endif
#ifndef DIRECT
#define DIRECT 0  // MODE 0/1, NT 1: block b is pair b, its expert is topk_ids[b] (no sorted layout)
#endif
#if DIRECT && (NT != 1 || MODE == 2)
#error "DIRECT needs NT 1 and an MoE mode"
#endif

#define NWARPS 4
#define CHUNK 128
#define SLOTS (DIRECT ? 1 : 8 * NT)

typedef unsigned int u32;

__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {  // (a & b) | c
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u32 pack2(unsigned short lo, unsigned short hi) { return (u32)lo | ((u32)hi << 16); }

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// code of weight 4 i + j (q <= 4) in nibble i, or of weight 8 i + j (q > 4) in byte i, from the q plane words
// (j is a constant wherever it is called: the loops around are unrolled, so the shifts fold)
template <int Q>
__device__ __forceinline__ u32 transpose_codes(const u32* w, int J) {
    constexpr u32 ONES = Q <= 4 ? 0x11111111u : 0x01010101u;
    u32 v = 0;
#pragma unroll
    for (int p = 0; p < Q; ++p) {
        const int sh = Q - 1 - p;  // the bit's place in the code (plane 0 is the top bit)
        const u32 moved = J >= sh ? (w[p] >> (J - sh)) : (w[p] << (sh - J));
        v = lop3_and_or(moved, ONES << sh, v);
    }
    return v;
}

// half2 (1024 + c_lo, 1024 + c_hi) -> (2 s c + z) for both halves
__device__ __forceinline__ u32 dequant2(u32 field, u32 mask, u32 s2, u32 z) {
    const u32 magic = lop3_and_or(field, mask, 0x64006400u);
    return hfma2(hsub2(magic, 0x64006400u), s2, z);
}

// pair index of slot i of this block, -1 for padding
__device__ __forceinline__ int pair_of(int i, int num_pairs, const int* sorted_ids) {
#if DIRECT
    const int p = i == 0 ? (int)blockIdx.x : num_pairs;
#elif MODE == 2
    const int p = blockIdx.x * SLOTS + i;
#else
    const int p = sorted_ids[blockIdx.x * SLOTS + i];
#endif
    return p < num_pairs ? p : -1;
}

struct RowScales {  // per 32-input word: (2 s, 2 s) and (z, z) as half2, z = o - s (2^q - 1)
    u32 s2, z;
};

__device__ __forceinline__ RowScales row_scales(unsigned short s16, unsigned short o16, int q) {
    const float s = h2f(s16);
    const unsigned short s2 = f2h(2.f * s);
    const unsigned short z = f2h(h2f(o16) - s * (float)((1 << q) - 1));
    return RowScales{pack2(s2, s2), pack2(z, z)};
}

// One lane's loads for one chunk: the plane words of its two rows and, when G >= CHUNK, their (scale, offset)
template <int Q>
struct ChunkRegs {
    uint4 pa[Q], pb[Q];
    unsigned short sa, oa, sb, ob;
};

// ldg_plane: the plane loads, with the L2 prefetch size L2PF
#include "plane_load.cuh"
#include "gate_act.cuh"

#if KH
// the plane bytes of inputs k .. k + 127 of one row in two 8-byte halves; a half at or past k_end reads as 0
__device__ __forceinline__ uint4 ldg_plane_halves(const unsigned char* p, int k, int k_end) {
    const uint2 lo = ldg_plane8(p);
    const uint2 hi = k + CHUNK / 2 < k_end ? ldg_plane8(p + 8) : make_uint2(0u, 0u);
    return make_uint4(lo.x, lo.y, hi.x, hi.y);
}
#endif

template <int Q>
__device__ __forceinline__ void load_chunk(ChunkRegs<Q>& r, const unsigned char* const* planes,
                                           const unsigned short* table, int N, int groups, long long row_bytes,
                                           int ra, int rb, int k, int k_end) {
#pragma unroll
    for (int p = 0; p < Q; ++p) {
#if KH
        r.pa[p] = ldg_plane_halves(planes[p] + ra * row_bytes + k / 8, k, k_end);
        r.pb[p] = ldg_plane_halves(planes[p] + rb * row_bytes + k / 8, k, k_end);
#else
        r.pa[p] = ldg_plane(planes[p] + ra * row_bytes + k / 8);
        r.pb[p] = ldg_plane(planes[p] + rb * row_bytes + k / 8);
#endif
    }
    if (G >= CHUNK) {
        const int grp = k / G;
        r.sa = __ldg(table + (long long)ra * groups + grp);
        r.oa = __ldg(table + ((long long)N + ra) * groups + grp);
        r.sb = __ldg(table + (long long)rb * groups + grp);
        r.ob = __ldg(table + ((long long)N + rb) * groups + grp);
    } else {
        r.sa = r.oa = r.sb = r.ob = 0;  // per word, read in run()
    }
}

template <int Q>
__device__ __forceinline__ void zero_chunk(ChunkRegs<Q>& r) {
#pragma unroll
    for (int p = 0; p < Q; ++p) r.pa[p] = r.pb[p] = make_uint4(0u, 0u, 0u, 0u);
    r.sa = r.oa = r.sb = r.ob = 0;
}

// the 32-input word wi of one chunk times every n-tile's activations, into acc
template <int Q>
__device__ __forceinline__ void mma_word(const ChunkRegs<Q>& r, int wi, RowScales sa, RowScales sb,
                                         const unsigned short* xp, const int* xrow, int K, int kw, bool have,
                                         float (*acc)[4]) {
    u32 wa[Q], wb[Q];
#pragma unroll
    for (int p = 0; p < Q; ++p) {
        wa[p] = wi == 0 ? r.pa[p].x : wi == 1 ? r.pa[p].y : wi == 2 ? r.pa[p].z : r.pa[p].w;
        wb[p] = wi == 0 ? r.pb[p].x : wi == 1 ? r.pb[p].y : wi == 2 ? r.pb[p].z : r.pb[p].w;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        // activations: positions 8 j .. 8 j + 7 of this word, per n-tile
        uint4 bx[NT];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            bx[nt] = make_uint4(0u, 0u, 0u, 0u);
            if (have && xrow[nt] >= 0) bx[nt] = __ldg((const uint4*)(xp + (long long)xrow[nt] * K + kw + 8 * j));
        }
        u32 a_lo[2][2], a_hi[2][2];  // [m][row a / b]: k slots 2t..2t+1 (lo) and 2t+8..2t+9 (hi)
        // nibbles: the hi slots are the same word's odd nibble pairs; bytes: the word of weights j + 4 + 8 i
        constexpr u32 MASK = Q <= 4 ? 0x000F000Fu : 0x00FF00FFu;
        const u32 la = transpose_codes<Q>(wa, j), lb = transpose_codes<Q>(wb, j);
        const u32 ha = Q <= 4 ? la >> 4 : transpose_codes<Q>(wa, j + 4);
        const u32 hb = Q <= 4 ? lb >> 4 : transpose_codes<Q>(wb, j + 4);
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            a_lo[m][0] = dequant2(la >> (8 * m), MASK, sa.s2, sa.z);
            a_hi[m][0] = dequant2(ha >> (8 * m), MASK, sa.s2, sa.z);
            a_lo[m][1] = dequant2(lb >> (8 * m), MASK, sb.s2, sb.z);
            a_hi[m][1] = dequant2(hb >> (8 * m), MASK, sb.s2, sb.z);
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const u32 b0 = m == 0 ? bx[nt].x : bx[nt].z;
                const u32 b1 = m == 0 ? bx[nt].y : bx[nt].w;
                mma16816(acc[nt], a_lo[m][0], a_lo[m][1], a_hi[m][0], a_hi[m][1], b0, b1);
            }
        }
    }
}

template <int Q>
__device__ __forceinline__ void run(const unsigned char* const* planes, const unsigned short* table, const unsigned short* xp,
                                    const int* xrow, int N, int K, int k_begin, int k_end, int ra, int rb,
                                    int t, float (*acc)[4]) {
    const long long row_bytes = K / 8;
    const int groups = K / G;
    const int chunks = (k_end - k_begin + CHUNK - 1) / CHUNK;  // KH: the last one holds 64 inputs
    // q <= 4: registers double-buffer the chunks, the lane's next chunk is in flight while this one is
    // multiplied; wider codes hold twice the plane words and load each chunk when they reach it (registers)
    constexpr bool PREFETCH = Q <= 4;
    ChunkRegs<Q> cur;
    if (PREFETCH && t < chunks) load_chunk<Q>(cur, planes, table, N, groups, row_bytes, ra, rb, k_begin + t * CHUNK, k_end);
    for (int c0 = 0; c0 < chunks; c0 += 4) {
        const int c = c0 + t;
        const bool have = c < chunks;
        const int k = k_begin + c * CHUNK;
        if (!have) zero_chunk<Q>(cur);
        else if (!PREFETCH) load_chunk<Q>(cur, planes, table, N, groups, row_bytes, ra, rb, k, k_end);
        ChunkRegs<Q> nxt;
        if (PREFETCH && c + 4 < chunks) load_chunk<Q>(nxt, planes, table, N, groups, row_bytes, ra, rb, k + 4 * CHUNK, k_end);
        const RowScales ca = row_scales(cur.sa, cur.oa, Q), cb = row_scales(cur.sb, cur.ob, Q);
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) {
            const int kw = k + 32 * wi;
            const bool have_w = have && (!KH || kw < k_end);  // KH: the last chunk's words 2, 3 lie past K
            RowScales sa = ca, sb = cb;
            if (G < CHUNK && have_w) {  // one (scale, offset) per word
                sa = row_scales(__ldg(table + (long long)ra * groups + kw / G),
                                __ldg(table + ((long long)N + ra) * groups + kw / G), Q);
                sb = row_scales(__ldg(table + (long long)rb * groups + kw / G),
                                __ldg(table + ((long long)N + rb) * groups + kw / G), Q);
            }
            mma_word<Q>(cur, wi, sa, sb, xp, xrow, K, kw, have_w, acc);
        }
        if (PREFETCH) cur = nxt;
    }
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MINB) ap_mma_gemv(
    const unsigned short* xp, const float* xscale, float* out, const long long* page_table,
    const float* topk_weights, const int* sorted_ids, const int* expert_ids, const int* post_pad,
    int num_pairs, int topk, int N, int K, int ld_out, int pt_stride, int k_per_split, int row_index,
    int apply_w_in, int xp_per_pair, int num_experts) {
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n0 = (blockIdx.y * NWARPS + warp) * 16;
    if (n0 >= N) return;  // the whole warp: no block-level synchronisation below
    const int k_begin = blockIdx.z * k_per_split;
    if (k_begin >= K) return;
    const int k_end = min(K, k_begin + k_per_split);

#if MODE == 2
    const int expert = row_index;
#elif DIRECT
    if ((int)blockIdx.x >= num_pairs) return;
    const int expert = expert_ids[blockIdx.x];
    if (expert < 0 || expert >= num_experts) return;  // -1: a non-local expert under expert parallelism
#else
    if ((int)blockIdx.x * SLOTS >= post_pad[0]) return;
    const int expert = expert_ids[blockIdx.x];
    if (expert < 0) return;
#endif

    const long long* row = page_table + (long long)expert * pt_stride;
    const int q = (int)row[0];
    const unsigned short* table = (const unsigned short*)row[1];  // fp16 [2, N, K / G]
    const unsigned char* planes[PMAX];
#pragma unroll
    for (int p = 0; p < PMAX; ++p) planes[p] = p < q ? (const unsigned char*)row[2 + p] : (const unsigned char*)0;

    // rows past N read row N - 1 (valid memory) and are not written
    const int ra = min(n0 + g, N - 1);
    const int rb = min(n0 + g + 8, N - 1);

    // the activation row of this lane's B column (slot nt * 8 + g) per n-tile, -1 for padding
    int xrow[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int p = nt * 8 + g < SLOTS ? pair_of(nt * 8 + g, num_pairs, sorted_ids) : -1;
        xrow[nt] = p < 0 ? -1 : (xp_per_pair ? p : p / topk);
    }

    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

#define CASE(Q) case Q: run<Q>(planes, table, xp, xrow, N, K, k_begin, k_end, ra, rb, t, acc); break;
    switch (q) {
        CASE(1)
#if PMAX >= 2
        CASE(2)
#endif
#if PMAX >= 3
        CASE(3)
#endif
#if PMAX >= 4
        CASE(4)
#endif
#if PMAX >= 5
        CASE(5)
#endif
#if PMAX >= 6
        CASE(6)
#endif
#if PMAX >= 7
        CASE(7)
#endif
#if PMAX >= 8
        CASE(8)
#endif
        default: return;  // a row the runtime never writes (q is 1..bits_max)
    }
#undef CASE

    // accumulator c of n-tile nt: (row n0 + g + 8 (c / 2), slot nt * 8 + 2 t + c % 2)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int n = n0 + g + 8 * (c >> 1);
            const int slot = nt * 8 + 2 * t + (c & 1);
            if (n >= N || slot >= SLOTS) continue;
            const int p = pair_of(slot, num_pairs, sorted_ids);
            if (p < 0) continue;
            const int xr = xp_per_pair ? p : p / topk;
            float v = acc[nt][c] * xscale[xr];
#if MODE == 1
            if (!apply_w_in) v *= topk_weights[p];
            atomicAdd(out + (long long)(p / topk) * ld_out + n, v);
#else
            atomicAdd(out + (long long)p * ld_out + n, v);
#endif
        }
    }
}

// ---- activations -> fp16 in the fragment order, one block per row, times a power of two per row ----
// MODE 0: row = token (or pair when the routing weight is applied on the input: x[pair / topk] * w[pair]);
// MODE 1: row = pair, value gate_act(h[pair, k]) * h[pair, K + k] from the float32 h; MODE 2: row of x.
// XT: 0 bf16, 1 fp16, 2 fp32 (MODE 0 and 2).

__device__ __forceinline__ float load_x(const void* x, long long r, long long ld, int k) {
#if XT == 0
    return __uint_as_float(((u32)((const unsigned short*)x)[r * ld + k]) << 16);
#elif XT == 1
    return h2f(((const unsigned short*)x)[r * ld + k]);
#else
    return ((const float*)x)[r * ld + k];
#endif
}

__device__ __forceinline__ float act_value(const void* x, const float* topk_weights, int r, int ld, int K, int topk,
                                           int per_pair, int k) {
#if MODE == 1
    const float* h = (const float*)x + (long long)r * ld;
    const float gte = h[k];
    return gate_act(gte) * h[K + k];
#elif MODE == 0
    if (per_pair) return load_x(x, r / topk, ld, k) * topk_weights[r];
    return load_x(x, r, ld, k);
#else
    return load_x(x, r, ld, k);
#endif
}

#define PREP_THREADS 256
// activations whose magnitude stays at or below this are stored unscaled (fp16's largest finite is 65504)
#define FP16_SAFE 16384.f

extern "C" __global__ void __launch_bounds__(PREP_THREADS) ap_mma_prep(
    const void* x, const float* topk_weights, unsigned short* xp, float* xscale, int K, int ld, int topk,
    int per_pair) {
    __shared__ float warp_max[PREP_THREADS / 32];
    const int r = blockIdx.x;
    float mx = 0.f;
    for (int k = threadIdx.x; k < K; k += PREP_THREADS) mx = fmaxf(mx, fabsf(act_value(x, topk_weights, r, ld, K, topk, per_pair, k)));
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, d));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = 0.f;
#pragma unroll
    for (int w = 0; w < PREP_THREADS / 32; ++w) mx = fmaxf(mx, warp_max[w]);
    // a power of two: bf16 and fp16 inputs stay exact, and the output multiplies it back exactly
    float up = 1.f;  // the factor the output is multiplied by
    if (mx > FP16_SAFE) up = exp2f(ceilf(log2f(mx / FP16_SAFE)));
    if (!(up < 3.0e38f)) up = 1.f;  // inf / nan rows: let them propagate as the reference would
    const float down = 1.f / up;
    if (threadIdx.x == 0) xscale[r] = up;
    for (int pos = threadIdx.x; pos < K; pos += PREP_THREADS) {
        const int i = pos & 31;  // pos = 8 j + 4 m + 2 r + h inside the word -> k = j + 8 m + 4 r + 16 h
        const int k = (pos & ~31) + (i >> 3) + 8 * ((i >> 2) & 1) + 4 * ((i >> 1) & 1) + 16 * (i & 1);
        xp[(long long)r * K + pos] = f2h(act_value(x, topk_weights, r, ld, K, topk, per_pair, k) * down);
    }
}
