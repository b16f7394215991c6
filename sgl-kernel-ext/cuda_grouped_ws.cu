// Prefill-size AP MoE over ubcq bit-planes, warp-specialized for Hopper (sm_90a): one producer warpgroup loads
// and decodes, two consumer warpgroups multiply ("grouped_ws" kernel; cuda_grouped.py, GroupedConfig(ws=True)).
//
// Same arithmetic, operand orders and epilogues as cuda_grouped_gemm.cu (read its header first): a block holds
// 128 weight rows (MODE 0: 64 gate rows and their 64 up rows) x BN (token, slot) pairs of one expert and walks K
// in chunks of 128 inputs. What differs is who does what:
// - the producer warpgroup issues every cp.async of a STAGES-deep pipeline (activations, plane bytes, group sums),
//   then decodes each chunk's planes exactly once into a [128 rows x 128 inputs] tile of centred 16-bit weights
//   (W' = fma(BIAS + c, A, C), in the activations' permuted order), K-major with the 128-byte swizzle, in one of
//   two shared tiles;
// - each consumer warpgroup takes its 64 rows' A fragments from that tile by ldmatrix and runs wgmma m64nBNk16 on
//   them with the activations (all BN pairs) from shared memory, one step in flight behind the next. So the
//   decoded tile is written and read in the generic proxy only; wgmma reading it from shared memory itself would
//   need a proxy fence (a membar) after the producer's stores, and measured no faster;
// - the group offsets (z + K0 A - eps) S go into a second fp32 accumulator, so the tensor pipe never drains
//   inside the mainloop.
// Hand-offs are named barriers, each used every other chunk: FULL (chunk c decoded and its copies landed; the
// producer arrives, the consumers wait) and FREE (chunk c's MMAs are done, so its stage and weight tile may be
// refilled; the consumers arrive right after the first MMA step of chunk c + 1 retires the last of chunk c, and
// the producer waits before refilling). docs/kernels.md, "The warp-specialized grouped kernel", has the measured
// state and what limits it.

#ifndef MODE
#error "MODE must be defined"
#endif
#ifndef BN
#define BN 128  // pairs per block: 64 or 128
#endif
#ifndef PMAX
#define PMAX 8
#endif
#ifndef G
#define G 128  // group size, a multiple of 128
#endif
#ifndef CT
#define CT 0  // activations and weights: 0 bf16, 1 fp16
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef DIAG
#define DIAG 0  // measurement only (benchmark/grouped_ws_diag.py): 1 the producer skips the decode, 2 the consumers the MMAs
#endif
#define WGMMA 1
#if G % 128
#error "G must be a multiple of 128"
#endif
#if BN != 64 && BN != 128
#error "BN must be 64 or 128"
#endif

#define NCONS 256  // two consumer warpgroups, then the producer warpgroup
#define NTHREADS 384
#define BROWS 128
#define CHUNK 128
#define ACT_STAGE (BN * 256)
#define PL_STAGE (BROWS * 16)
#define SUM_OFF (ACT_STAGE + PMAX * PL_STAGE)
#define STAGE_BYTES ((SUM_OFF + BN * 4 + 1023) / 1024 * 1024)  // 1024-byte aligned (the swizzle atoms)
#define WT_OFF (STAGES * STAGE_BYTES)
#define WT_BYTES (BROWS * CHUNK * 2)  // one decoded weight tile
#define BAR_FULL 1                    // + (chunk & 1)
#define BAR_FREE 3                    // + (chunk & 1)
#define BAR_PRODUCER 5

#include "cuda_common.cuh"
#include "grouped_common.cuh"
#include "gate_act.cuh"

__device__ __forceinline__ void bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void st_shared(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

// byte offset of 16-byte piece p (0..15) of row r of a K-major 128-byte-swizzled tile of `rows` rows: two atoms of
// [rows][128 bytes] (pieces 0-7, 8-15), piece ^ (row & 7)
__device__ __forceinline__ u32 swz(int rows, int r, int p) {
    return (u32)((p >> 3) * rows * 128 + r * 128 + (((p & 7) ^ (r & 7)) << 4));
}

// global weight row of block row r (0..127): MODE 0 interleaves 8 gate rows and their 8 up rows per 16
__device__ __forceinline__ int weight_row(int r, int row_tile, int n_out) {
#if MODE == 0
    const int n = 64 * row_tile + 8 * (r >> 4) + (r & 7);
    return (r & 8) ? n_out + n : n;
#else
    return BROWS * row_tile + r;
#endif
}

template <int Q>
__device__ __forceinline__ void producer(const long long* prow, const u16* x, const float* xs, int n_table, int K,
                                         int row_tile, int n_out, unsigned char* smem, const int* slot_unit) {
    const int ptid = threadIdx.x - NCONS, pw = ptid >> 5, lane = ptid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int chunks = K / CHUNK, ngroups = K / G;
    const u32 smem_base = smem_u32(smem);

    // copies: piece (ptid & 15) of slot rows (ptid >> 4) + 8 r; plane bytes of block row ptid; group sum of slot ptid
    const int a_piece = ptid & 15;
    u32 a_off[BN / 8];
    u32 a_real = 0;  // bit r: row r is a real pair
#pragma unroll
    for (int r = 0; r < BN / 8; ++r) {
        const int u = slot_unit[(ptid >> 4) + 8 * r];
        a_off[r] = (u >= 0 ? (u32)u * (u32)K : 0u) + (u32)(a_piece * 8);
        if (u >= 0) a_real |= 1u << r;
    }
    const long long p_off = (long long)weight_row(ptid, row_tile, n_out) * (K >> 3);
    const int s_unit = ptid < BN ? slot_unit[ptid] : -1;
    const float* s_src = xs + (s_unit >= 0 ? (long long)s_unit * ngroups : 0);
    auto issue = [&](int c) {
        if (c < chunks) {
            const u32 base = smem_base + (u32)((c % STAGES) * STAGE_BYTES);
#pragma unroll
            for (int r = 0; r < BN / 8; ++r)
                cp_async16(base + swz(BN, (ptid >> 4) + 8 * r, a_piece), x + a_off[r] + c * CHUNK,
                           (a_real >> r) & 1 ? 16u : 0u);
#pragma unroll
            for (int p = 0; p < Q; ++p)
                cp_async16(base + ACT_STAGE + p * PL_STAGE + ptid * 16,
                           (const unsigned char*)prow[2 + p] + p_off + (long long)c * 16, 16u);
            if (ptid < BN) cp_async4(base + SUM_OFF + ptid * 4, s_src + (c * CHUNK) / G, s_unit >= 0 ? 4u : 0u);
        }
        cp_async_commit();
    };

    // (scale, offset) of this lane's rows: tile T = 2 pw + a (16 rows), rows g (h = 0) and g + 8 (h = 1)
    const u16* table = (const u16*)prow[1];
    const u16* tab[2][2];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int h = 0; h < 2; ++h) tab[a][h] = table + (long long)weight_row(16 * (2 * pw + a) + 8 * h + g,
                                                                              row_tile, n_out) * ngroups;
    const long long toff = (long long)n_table * ngroups;
    u16 raw[2][2][2];
    auto load_raw = [&](int grp) {
        const int gg = grp < ngroups ? grp : ngroups - 1;
#pragma unroll
        for (int a = 0; a < 2; ++a)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                raw[a][h][0] = __ldg(tab[a][h] + gg);
                raw[a][h][1] = __ldg(tab[a][h] + toff + gg);
            }
    };
    RowCoef rc[2][2];

    // ldmatrix of the planes: lane >> 4 -> +1 plane, (lane >> 3) & 1 -> rows 8..15 of the tile
    const int lr = lane & 7;
    const u32 pl_addr0 = (u32)(ACT_STAGE + (lane >> 4) * PL_STAGE + (((lane >> 3) & 1) * 8 + lr) * 16);
    const u32 pl_addr_odd = (u32)(ACT_STAGE + (Q - 1) * PL_STAGE + (((lane >> 3) & 1) * 8 + lr) * 16);

#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) issue(st);
    load_raw(0);

    for (int c = 0; c < chunks; ++c) {
        if (c % (G / CHUNK) == 0) {
#pragma unroll
            for (int a = 0; a < 2; ++a)
#pragma unroll
                for (int h = 0; h < 2; ++h) rc[a][h] = make_row_coef<Q>(raw[a][h][0], raw[a][h][1]);
            load_raw(c / (G / CHUNK) + 1);
        }
        cp_async_wait<STAGES - 2>();
        bar_sync(BAR_PRODUCER, 128);  // every producer thread's copies of chunk c have landed
        const u32 sb = smem_base + (u32)((c % STAGES) * STAGE_BYTES);
        const u32 wt = smem_base + (u32)(WT_OFF + (c & 1) * WT_BYTES);  // free since FREE(c - 2)
#pragma unroll
        for (int a = 0; a < (DIAG & 1 ? 0 : 2); ++a) {
            const int T = 2 * pw + a;
            u32 wa[Q], wb[Q], hi[2][4], lo[2][4];
#pragma unroll
            for (int pp = 0; pp < Q / 2; ++pp)
                ldsm_x4(sb + pl_addr0 + 2 * pp * PL_STAGE + T * 256, wa[2 * pp], wb[2 * pp], wa[2 * pp + 1],
                        wb[2 * pp + 1]);
            if (Q & 1) ldsm_x2(sb + pl_addr_odd + T * 256, wa[Q - 1], wb[Q - 1]);
            plane_codes<Q>(wa, wb, hi, lo);
            // the pair of nibbles (e, e + 4) of code word j is inputs (2 t, 2 t + 1) of piece 4 j + e: rows
            // 16 T + g and + 8 share the swizzle (row & 7 = g)
            const u32 row_base = wt + (u32)((16 * T + g) * 128 + 4 * t);
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int p = 4 * j + e;
                    const u32 addr = row_base + (u32)((p >> 3) * BROWS * 128 + (((p & 7) ^ g) << 4));
                    st_shared(addr, weight_pair<Q>(hi[0][j], Q > 4 ? lo[0][j] : 0u, e, rc[a][0]));
                    st_shared(addr + 8 * 128, weight_pair<Q>(hi[1][j], Q > 4 ? lo[1][j] : 0u, e, rc[a][1]));
                }
        }
        bar_arrive(BAR_FULL + (c & 1), NTHREADS);
        if (c >= 1) bar_sync(BAR_FREE + ((c - 1) & 1), NTHREADS);  // chunk c - 1's stage and tile are free
        issue(c + STAGES - 1);                                       // into chunk c - 1's stage
    }
    cp_async_wait<0>();
}

template <int Q>
__device__ __forceinline__ void consumer(const long long* prow, int n_table, int K, int row_tile, int n_out,
                                         unsigned char* smem, float (*acc)[4], float (*off)[4]) {
    const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int chunks = K / CHUNK, ngroups = K / G;
    const u32 smem_base = smem_u32(smem);
    // the offset factors of this lane's accumulator rows 16 T + g, + 8 (T = 4 wg + w)
    const u16* table = (const u16*)prow[1];
    const u16* tab[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
        tab[h] = table + (long long)weight_row(16 * (4 * wg + w) + 8 * h + g, row_tile, n_out) * ngroups;
    const long long toff = (long long)n_table * ngroups;
    u16 raw[2][2];
    auto load_raw = [&](int grp) {
        const int gg = grp < ngroups ? grp : ngroups - 1;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            raw[h][0] = __ldg(tab[h] + gg);
            raw[h][1] = __ldg(tab[h] + toff + gg);
        }
    };
    float z[2];
    load_raw(0);
    // ldmatrix of the A fragments: lanes 0-7 / 8-15 rows 0-7 / 8-15 of the warp's tile at the step's first piece,
    // lanes 16-31 the same rows at its second
    const int a_row = 16 * (4 * wg + w) + (lane & 7) + 8 * ((lane >> 3) & 1);
    for (int c = 0; c < chunks; ++c) {
        if (c % (G / CHUNK) == 0) {
#pragma unroll
            for (int h = 0; h < 2; ++h) z[h] = make_row_coef<Q>(raw[h][0], raw[h][1]).z;
            load_raw(c / (G / CHUNK) + 1);
        }
        bar_sync(BAR_FULL + (c & 1), NTHREADS);
        const u32 sb = smem_base + (u32)((c % STAGES) * STAGE_BYTES);
        const u32 wt = smem_base + (u32)(WT_OFF + (c & 1) * WT_BYTES);
#pragma unroll
        for (int s = 0; s < (DIAG & 2 ? 0 : CHUNK / 16); ++s) {  // k16 step s: pieces 2 s, 2 s + 1
            u32 a[4];  // the A fragment of this warp's 16 rows, as mma.m16n8k16 takes it
            ldsm_x4(wt + swz(BROWS, a_row, 2 * s + (lane >> 4)), a[0], a[1], a[2], a[3]);
            const u64 db = wg_desc(sb + (u32)((s >> 2) * BN * 128 + (s & 3) * 32), 16, 1024);
            wg_fence();
#if BN == 128
            wgmma_m64n128k16(acc, a, db);
#else
            wgmma_m64n64k16(acc, a, db);
#endif
            wg_commit();
            wg_wait<1>();  // the step before is done: its A registers are free again
            // after step 0, chunk c - 1's MMAs are all done: its stage and weight tile go back to the producer now,
            // so its refill and the next decode overlap this chunk's remaining MMAs
            if (s == 0 && c >= 1) bar_arrive(BAR_FREE + ((c - 1) & 1), NTHREADS);
        }
#if DIAG & 2
        if (c >= 1) bar_arrive(BAR_FREE + ((c - 1) & 1), NTHREADS);
#endif
        if ((c + 1) % (G / CHUNK) == 0) {  // the group's offsets: off += z S, beside the MMAs in flight
            const float* S = (const float*)(smem + (c % STAGES) * STAGE_BYTES + SUM_OFF);
#pragma unroll
            for (int i = 0; i < BN / 8; ++i) {
                const float2 sv = *(const float2*)(S + 8 * i + 2 * t);
                off[i][0] = fmaf(z[0], sv.x, off[i][0]);
                off[i][1] = fmaf(z[0], sv.y, off[i][1]);
                off[i][2] = fmaf(z[1], sv.x, off[i][2]);
                off[i][3] = fmaf(z[1], sv.y, off[i][3]);
            }
        }
    }
    wg_wait<0>();
}

extern "C" __global__ void __launch_bounds__(NTHREADS, 1) ap_grouped_ws_gemm(
    const u16* x, const float* xs, const long long* page_table, const float* topk_weights, const int* sorted_ids,
    const int* expert_ids, const int* post_pad, u16* act_out, float* xs_out, float* acc_out, int num_pairs,
    int topk, int n_out, int n_table, int K, int apply_w_in, int num_experts, int pt_stride, int g_out,
    int xunit_per_pair) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem = align_1024(smem_raw);
    __shared__ int slot_pair[BN];  // pair of each slot, -1 for padding
    __shared__ int slot_unit[BN];  // activation row of each slot, -1 for padding
    const int row_tile = blockIdx.x, tb = blockIdx.y;
    if (tb * BN >= post_pad[0]) return;
    const int expert = expert_ids[tb];
    if (expert < 0 || expert >= num_experts) return;
    const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    fill_slots<BN>(sorted_ids, tb, num_pairs, topk, xunit_per_pair, slot_pair, slot_unit);
    __syncthreads();

    const long long* prow = page_table + (long long)expert * pt_stride;
    const int q = (int)prow[0];
    float acc[BN / 8][4], off[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[i][c] = off[i][c] = 0.f;
    if (tid >= NCONS) {
#define CALL_PRODUCER(Q) \
    producer<(Q <= PMAX ? Q : 1)>(prow, x, xs, n_table, K, row_tile, n_out, smem, slot_unit)
        Q_SWITCH(q, CALL_PRODUCER)
#undef CALL_PRODUCER
    } else {
#define CALL_CONSUMER(Q) consumer<(Q <= PMAX ? Q : 1)>(prow, n_table, K, row_tile, n_out, smem, acc, off)
        Q_SWITCH(q, CALL_CONSUMER)
#undef CALL_CONSUMER
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][c] += off[i][c];
    }
    __syncthreads();  // the pipeline is drained: its shared memory is free

    const int T = 4 * wg + w;  // consumers: accumulator rows 16 T + g (c < 2), + 8 (c >= 2)
#if MODE == 0
    // act = gate_act(gate) * up for (n, pair) into a [BN][64] tile in shared memory ...
    u16* tile = (u16*)smem;
    if (tid < NCONS) {
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float gte = acc[i][h], up = acc[i][2 + h];
                tile[(8 * i + 2 * t + h) * 64 + 8 * T + g] = f2ct(gate_act(gte) * up);
            }
    }
    __syncthreads();
    // ... then out in w2's order
    store_w2_input<BN, NTHREADS, 64>(tile, slot_pair, act_out, xs_out, row_tile, n_out, g_out);
    (void)acc_out; (void)topk_weights; (void)apply_w_in;
#else
    if (tid < NCONS) {
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int n = BROWS * row_tile + 16 * T + g + (c >= 2 ? 8 : 0);
                const int p = slot_pair[8 * i + 2 * t + (c & 1)];
                if (p < 0) continue;
                const float v = apply_w_in ? acc[i][c] : acc[i][c] * topk_weights[p];
                atomicAdd(acc_out + (long long)(p / topk) * n_out + n, v);
            }
    }
    (void)act_out; (void)xs_out; (void)g_out; (void)xunit_per_pair;
#endif
}
