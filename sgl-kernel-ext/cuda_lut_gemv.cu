// Decode-size AP GEMV over binary-coded (bcq) bit-planes with activation-side tables (LUT-GEMM / T-MAC).
//
// Compiled at first use with NVRTC (cuda_lut.py), one cubin per (MODE, XT, BM, PMAX, G, DIRECT, UNIFORM); no
// CUDA headers.
//
// bcq weight (docs/format.md): W[n, k] = t[q][n, g] + sum_{p<q} t[p][n, g] * (2 * bit_p[n, k] - 1), g = k / G.
// UNIFORM (table kind ubcq): the table is [2, N, K / G] and plane p's scale is t[0][n, g] * 2^(q-1-p), offset t[1].
// So y[n] = sum_g ( t[q][n,g] * S_g + sum_p t[p][n,g] * sum_{k in g} x_k * (2 * bit_p[n,k] - 1) ).
// For every 4 inputs the block builds in shared memory the 16 signed sums +-x0 +-x1 +-x2 +-x3 (one table
// per nibble position); then each plane nibble is one shared-memory lookup and one add, instead of four
// bit extractions and four multiply-adds. All lanes of a warp work on different rows n at the same k, so
// they read the same 16-entry table: its 16 entries sit in 16 different banks and the lookups never
// conflict. One block: up to BM (token, slot) pairs of one expert x NB rows x one K slice; K slices are
// summed with float32 atomics into a zeroed output.
//
// MODE 0: MoE gate/up. x [M, K] indexed by token = pair / topk; out h [num_pairs, N] float32, row = pair.
// MODE 1: MoE down. x = gate_act(h[pair, :K]) * h[pair, K:2K] (float32 h from MODE 0); out [M, N] float32, row =
//         pair / topk, times the routing weight (unless it was applied on the input).
// MODE 2: dense linear. x [M, K], pair = row of x, one page-table row; out [M, N] float32.
// XT: 0 bf16, 1 fp16, 2 fp32 activations (MODE 0 and 2).

#ifndef MODE
#error "MODE must be defined"
#endif
#ifndef UNIFORM
#define UNIFORM 0  // ubcq tables: one scale per group times 2^(q-1-p), the offset in row 1
#endif
#ifndef DIRECT
#define DIRECT 0  // MODE 0/1 with BM 1: block b is pair b and its expert is topk_ids[b] (no sorted layout)
#endif
#if DIRECT && (BM != 1 || MODE == 2)
#error "DIRECT needs BM 1 and an MoE mode"
#endif

#define NTHREADS 256
#define CHUNK 128  // inputs per step: one 16-byte load per plane and row
#define TABLES_PER_CHUNK (CHUNK / 4)
#define TABLE_FLOATS_PER_CHUNK (TABLES_PER_CHUNK * 16)

typedef unsigned int u32;
typedef unsigned long long u64;

#include "gate_act.cuh"

__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf16_to_float(unsigned short h) { return __uint_as_float(((u32)h) << 16); }

// four consecutive activations of row `r` starting at input k (k % 4 == 0)
__device__ __forceinline__ void load4(const void* base, long long ld, long long r, int k, int K, float v[4]) {
#if MODE == 1
    const float* h = (const float*)base + r * ld;
    float4 g = *(const float4*)(h + k);
    float4 u = *(const float4*)(h + K + k);
    v[0] = gate_act(g.x) * u.x;
    v[1] = gate_act(g.y) * u.y;
    v[2] = gate_act(g.z) * u.z;
    v[3] = gate_act(g.w) * u.w;
#elif XT == 2
    float4 f = *(const float4*)((const float*)base + r * ld + k);
    v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
#else
    uint2 w = *(const uint2*)((const unsigned short*)base + r * ld + k);
    unsigned short s[4] = {(unsigned short)(w.x & 0xffff), (unsigned short)(w.x >> 16),
                           (unsigned short)(w.y & 0xffff), (unsigned short)(w.y >> 16)};
#pragma unroll
    for (int t = 0; t < 4; ++t) v[t] = XT == 0 ? bf16_to_float(s[t]) : half_to_float(s[t]);
#endif
}

// bytes of a plane word's even / odd nibbles, each times 4 (a float's byte offset in a 16-entry table)
__device__ __forceinline__ u32 even_nibbles_x4(u32 w) { return (w << 2) & 0x3C3C3C3Cu; }
__device__ __forceinline__ u32 odd_nibbles_x4(u32 w) { return (w >> 2) & 0x3C3C3C3Cu; }

__device__ __forceinline__ float lookup(const float* table, u32 byte_offset) {
    return *(const float*)((const char*)table + byte_offset);
}

// ldg_plane: the plane loads, with the L2 prefetch size L2PF
#include "plane_load.cuh"

// plane words (one 16-byte load per plane) and the bcq scales (planes 0..q-1, offset at index PMAX) of row n
// for the 128 inputs from k0; UNIFORM: the one scale at index 0, the offset at index PMAX
__device__ __forceinline__ void load_chunk(const unsigned char* const* planes, const unsigned short* alphas, int q, int N,
                                           int groups, int n, long long row_bytes, int k0, uint4* w,
                                           unsigned short* a16) {
    const int g = k0 / G;
#pragma unroll
    for (int p = 0; p < PMAX; ++p) {
        if (p < q) {
            w[p] = ldg_plane(planes[p] + n * row_bytes + k0 / 8);
#if !UNIFORM
            a16[p] = __ldg(alphas + ((long long)p * N + n) * groups + g);
#endif
        }
    }
#if UNIFORM
    a16[0] = __ldg(alphas + (long long)n * groups + g);
    a16[PMAX] = __ldg(alphas + ((long long)N + n) * groups + g);
#else
    a16[PMAX] = __ldg(alphas + ((long long)q * N + n) * groups + g);
#endif
}

// a pair's 32 tables of chunk c: chunks are CHUNK_STRIDE = 512 + 16 floats apart, so an odd chunk's tables sit
// 16 banks away from an even chunk's and the two lanes of a row, which look up an even and an odd chunk at
// the same time, never hit the same bank
#define CHUNK_STRIDE (TABLE_FLOATS_PER_CHUNK + 16)
__device__ __forceinline__ float* chunk_tables(float* pair_tables, int c) { return pair_tables + c * CHUNK_STRIDE; }
__device__ __forceinline__ const float* chunk_tables(const float* pair_tables, int c) {
    return pair_tables + c * CHUNK_STRIDE;
}

// pair index of slot i of this block, -1 for padding (read again rather than indexing a register array)
__device__ __forceinline__ int pair_of(int i, int num_pairs, const int* sorted_ids) {
#if MODE == 2 || DIRECT
    const int p = blockIdx.x * BM + i;
#else
    const int p = sorted_ids[blockIdx.x * BM + i];
#endif
    return p < num_pairs ? p : -1;
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 2) ap_lut_gemv(  // 2 blocks per SM: <= 128 registers
    const void* x, float* out, const long long* page_table, const float* topk_weights,
    const int* sorted_ids, const int* expert_ids, const int* post_pad,
    int num_pairs, int topk, int N, int K, int ld_x, int ld_out, int pt_stride,
    int k_per_split, int n_per_block, int row_index, int apply_w_in, int num_experts) {
    extern __shared__ float smem[];
    const int kc_max = k_per_split;
    const int chunks_max = kc_max / CHUNK;
    // tables [BM][chunks_max][CHUNK_STRIDE]: 32 tables of 16 floats per chunk, then 16 floats of padding
    const int pair_stride = chunks_max * CHUNK_STRIDE;
    float* tables = smem;
    float* sums = smem + BM * pair_stride;  // [BM][chunks_max]: sum of x per chunk

    const int tid = threadIdx.x;
    const int k_begin = blockIdx.z * k_per_split;
    if (k_begin >= K) return;
    const int kc = min(k_per_split, K - k_begin);
    const int chunks = kc / CHUNK;
    const int n_begin = blockIdx.y * n_per_block;
    const int n_end = min(N, n_begin + n_per_block);

#if MODE == 2
    const int expert = row_index;
#elif DIRECT
    // one pair per block, in routing order: expert_ids is topk_ids itself (no alignment launch)
    if (blockIdx.x >= num_pairs) return;
    const int expert = expert_ids[blockIdx.x];
    if (expert < 0 || expert >= num_experts) return;  // -1: a non-local expert under expert parallelism
#else
    if (blockIdx.x * BM >= post_pad[0]) return;
    const int expert = expert_ids[blockIdx.x];
    if (expert < 0) return;
#endif

    // ---- the expert's page-table row: committed bitwidth, table and plane addresses ----
    const long long* row = page_table + (long long)expert * pt_stride;
    const int q = (int)row[0];
    const unsigned short* alphas = (const unsigned short*)row[1];  // fp16 [q + 1, N, K / G] (UNIFORM [2, N, K / G])
    const unsigned char* planes[PMAX];
#pragma unroll
    for (int p = 0; p < PMAX; ++p) planes[p] = p < q ? (const unsigned char*)row[2 + p] : (const unsigned char*)0;
    const int groups = K / G;
    const long long row_bytes = K / 8;

    // Two lanes per row: lane h = tid & 1 takes the row's chunks h, h + 2, ... Each warp load then covers 16
    // rows x 32 contiguous bytes (full sectors) instead of 32 rows x 16 bytes: half the L1 wavefronts per
    // byte for the planes and the scales (ncu: the kernel is bound by L1/TEX throughput). The two lanes read
    // tables of an even and an odd chunk, which sit 16 banks apart, so the lookups stay conflict-free.
    const int h = tid & 1;
    const int rows_per_pass = NTHREADS / 2;

    // the first row's first chunk is requested before the tables are built: its latency hides behind them
    uint4 w[PMAX];
    unsigned short a16[PMAX + 1];
    {
        const int n = n_begin + (tid >> 1);
        if (n < n_end && h < chunks) load_chunk(planes, alphas, q, N, groups, n, row_bytes, k_begin + h * CHUNK, w, a16);
    }

    // ---- activation tables: 16 signed sums per 4 inputs, per pair, and the sum of x per chunk ----
    const int nibbles = kc / 4;  // a multiple of 32: each warp covers one chunk of one pair
    for (int idx = tid; idx < BM * nibbles; idx += NTHREADS) {
        const int i = idx / nibbles;
        const int j = idx - i * nibbles;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        const int p = pair_of(i, num_pairs, sorted_ids);
        if (p >= 0) {
#if MODE == 0
            load4(x, ld_x, p / topk, k_begin + 4 * j, K, v);
            if (apply_w_in) {
                const float rw = topk_weights[p];
#pragma unroll
                for (int t = 0; t < 4; ++t) v[t] *= rw;
            }
#else
            load4(x, ld_x, p, k_begin + 4 * j, K, v);
#endif
        }
        // entry e: sum_t (bit t of e ? +x_t : -x_t)
        const float a[4] = {-v[0] - v[1], v[0] - v[1], -v[0] + v[1], v[0] + v[1]};
        const float b[4] = {-v[2] - v[3], v[2] - v[3], -v[2] + v[3], v[2] + v[3]};
        float4* dst = (float4*)(chunk_tables(tables + i * pair_stride, j / TABLES_PER_CHUNK) + (j % TABLES_PER_CHUNK) * 16);
#pragma unroll
        for (int hi = 0; hi < 4; ++hi) dst[hi] = make_float4(a[0] + b[hi], a[1] + b[hi], a[2] + b[hi], a[3] + b[hi]);
        float s = a[3] + b[3];
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
        if ((tid & 31) == 0) sums[i * chunks_max + j / TABLES_PER_CHUNK] = s;
    }
    __syncthreads();

    // every lane runs the same number of passes (the shuffle below needs the whole warp)
    for (int base = n_begin; base < n_end; base += rows_per_pass) {
        const int n = base + (tid >> 1);
        const bool valid = n < n_end;
        float y[BM];
#pragma unroll
        for (int i = 0; i < BM; ++i) y[i] = 0.f;
        for (int c = h; valid && c < chunks; c += 2) {
            // registers double-buffer the plane words: this lane's next chunk (or the next row's first) is in
            // flight while this one is looked up
            uint4 wn[PMAX];
            unsigned short an[PMAX + 1];
            const bool last = c + 2 >= chunks;
            const int cn = last ? h : c + 2;
            const int nn = last ? n + rows_per_pass : n;
            if (nn < n_end) load_chunk(planes, alphas, q, N, groups, nn, row_bytes, k_begin + cn * CHUNK, wn, an);
            const float offset = half_to_float(a16[PMAX]);
#pragma unroll
            for (int i = 0; i < BM; ++i) y[i] += offset * sums[i * chunks_max + c];
            const float* t0 = chunk_tables(tables, c);
#pragma unroll
            for (int p = 0; p < PMAX; ++p) {
                if (p < q) {
#if UNIFORM
                    const float alpha = half_to_float(a16[0]) * (float)(1u << (q - 1 - p));
#else
                    const float alpha = half_to_float(a16[p]);
#endif
                    const u32 words[4] = {w[p].x, w[p].y, w[p].z, w[p].w};
                    // two partial sums per pair: halves the dependent-add chain of the 32 lookups
                    float acc[BM], acc2[BM];
#pragma unroll
                    for (int i = 0; i < BM; ++i) acc[i] = acc2[i] = 0.f;
#pragma unroll
                    for (int wi = 0; wi < 4; ++wi) {
                        const u32 lo = even_nibbles_x4(words[wi]);
                        const u32 hi = odd_nibbles_x4(words[wi]);
#pragma unroll
                        for (int b = 0; b < 4; ++b) {
                            const u32 off_lo = __byte_perm(lo, 0u, 0x4440u + b);
                            const u32 off_hi = __byte_perm(hi, 0u, 0x4440u + b);
                            const int t_lo = (wi * 8 + 2 * b) * 16;  // nibble 2b of word wi
#pragma unroll
                            for (int i = 0; i < BM; ++i) {
                                const float* ti = t0 + i * pair_stride;
                                acc[i] += lookup(ti + t_lo, off_lo);
                                acc2[i] += lookup(ti + t_lo + 16, off_hi);
                            }
                        }
                    }
#pragma unroll
                    for (int i = 0; i < BM; ++i) y[i] += alpha * (acc[i] + acc2[i]);
                }
            }
#pragma unroll
            for (int p = 0; p < PMAX; ++p) w[p] = wn[p];
#pragma unroll
            for (int p = 0; p <= PMAX; ++p) a16[p] = an[p];
        }
        // the row's two halves
#pragma unroll
        for (int i = 0; i < BM; ++i) y[i] += __shfl_xor_sync(0xffffffffu, y[i], 1);
        if (!valid || h) continue;
#pragma unroll
        for (int i = 0; i < BM; ++i) {
            const int p = pair_of(i, num_pairs, sorted_ids);
            if (p < 0) continue;
#if MODE == 1
            const float scale = apply_w_in ? 1.f : topk_weights[p];
            atomicAdd(out + (long long)(p / topk) * ld_out + n, y[i] * scale);
#else
            atomicAdd(out + (long long)p * ld_out + n, y[i]);
#endif
        }
    }
}
