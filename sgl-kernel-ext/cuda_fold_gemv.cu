// Small-batch AP MoE / linear over ubcq bit-planes on tensor cores, with each group's scale and offset folded
// out of the per-weight work ("fold" kernel). Compiled at first use with NVRTC (cuda_fold.py); no CUDA headers.
//
// ubcq weight (docs/format.md): W[n, k] = 2 s c + z, z = o - s (2^q - 1), c the q-bit code (plane 0 = MSB),
// (s, o) = table[0 / 1][n, k / G]. Per group of G inputs the dot product splits into
//     sum_k W x = 2 s sum_k c x + z S,   S = sum of the group's activations,
// so the tensor cores multiply raw codes, and scale and offset are applied once per (row, group, token) in
// fp32. The codes enter the MMA through the exponent trick with no subtraction: the 16-bit pattern MAGIC | c
// is the value BIAS + c (bf16: 0x4300 = 128, fp16: 0x6400 = 1024), exact, so the MMA accumulates
// sum (BIAS + c) x = sum c x + BIAS S, and the epilogue removes BIAS S in fp32 together with adding z S:
//     y += A acc + (z - BIAS A) S,   A = 2 s 2^(q-4)   (q <= 4: the nibble holds c4 = c << (4 - q));
// q = 5..7 the same with c7 = c << (7 - q) (at most 127, exact under MAGIC in bf16 too), A = 2 s 2^(q-7): one byte per
// code from two nibble words (planes 0-2 and 3..), one mma chain as at 4 bits;
// q = 8 (255 needs 8 mantissa bits, bf16 has 7) reads c = 16 c_hi + c_lo as two nibbles with two accumulators:
//     y += A (16 acc_hi + acc_lo) + (z - 17 BIAS A) S,   A = 2 s.
// Per weight that leaves the bit transposition (a shift and a lop3 per plane and 8 codes) and one lop3 per
// two codes (q = 5..7: a shift and a lop3 per four codes for the bytes, then one prmt per two codes). The activations
// stay in their own 16-bit type (bf16 for bf16 / fp32 inputs, fp16 for fp16), so there is no range scaling.
//
// One warp: RT tiles of 16 A rows (MODE 0: gate rows n0..n0+7 in rows 0..7 and their up rows I+n0.. in rows 8..15;
// MODE 1/2: 16 consecutive rows), every tile fed by the same activation fragments, x a K range in chunks of 128 inputs. Lane (g, t) holds the 32-input quarter
// t of each chunk for its rows g and g + 8, so the 16 inputs of an mma lie in one group. The plane bytes pass
// through a per-warp ring in shared memory: cp.async copies 16 rows x 4 chunks (64 bytes) per plane and
// stage, and one ldmatrix.x4 gives each lane word t of four (plane, row-half) rows of a chunk, which is the
// 4 x 4 word transposition that puts quarter t in lane t.
// Bit transposition: nibble i of out_j (j = 0..3) holds the code of input 4 i + j of the quarter; an mma takes
// nibbles (e, e + 4) of out_j as the half pair of slots (2t, 2t+1) or (2t+8, 2t+9) (q = 5..7: the bytes of the same
// nibbles, in the same slots).
// Activations arrive in that order from ap_fold_prep (w13, linear) or the w13 epilogue (w2): per unit (m-block,
// or row / pair with DIRECT), chunk, n-tile and j, 32 lanes x 8 16-bit values; value 2 e + h of lane (g, t)
// is input 32 t + 4 (e + 4 h) + j of slot g. One coalesced 16-byte load per lane feeds 2 mma.
//
// MODE 0: MoE gate/up; gate_act(gate) * up (gate_act.cuh: ACT) is formed in the epilogue (gate and up of one n share a lane) and stored,
//         rounded to the compute type, in w2's activation order, with its group sums (float32 atomics).
// MODE 1: MoE down, times the routing weight, float32 atomics into [M, N]; the last block of each row block
//         converts its rows to the output dtype (one counter per row block; the prep kernel zeroes them).
// MODE 2: dense linear (rows of x in blocks of 8 NT), the same finish plus the bias.

#ifndef MODE
#error "MODE must be defined"
#endif
#ifndef NT
#define NT 1  // n-tiles of 8 slots per block
#endif
#ifndef PMAX
#define PMAX 8
#endif
#ifndef G
#define G 128  // group size, a multiple of 128
#endif
#ifndef CT
#define CT 0  // activations: 0 bf16, 1 fp16
#endif
#ifndef OT
#define OT 0  // MODE 1/2 output dtype: 0 bf16, 1 fp16, 2 fp32
#endif
#ifndef XT
#define XT 0  // prep input dtype: 0 bf16, 1 fp16, 2 fp32
#endif
#ifndef WK
#define WK 1  // warps of a block splitting its K range (the others split rows)
#endif
#ifndef MINB
#define MINB 1  // blocks per SM the register allocation must allow
#endif
#ifndef DIRECT
#define DIRECT 0  // MODE 0/1: block x is pair x, its expert topk_ids[x] (no sorted layout, one slot)
#endif
#ifndef RING
#define RING 16384  // shared-memory bytes of each warp's plane ring
#endif
#ifndef BPF
#define BPF 1  // NT 1: the next chunk's activations load while this chunk is multiplied (16 registers)
#endif
#ifndef SPD
#define SPD 3  // stages ahead that the (scale, offset) loads run
#endif
#ifndef SC
#define SC 4  // chunks per ring stage (2: 32-byte row pieces per plane, 4: 64-byte, 8: 128-byte; 4 halves to 2 where
             // the ring would otherwise hold too few stages)
#endif
#ifndef RT
#define RT 1  // row tiles (16 rows each) per warp, all multiplying the same activation fragments
#endif
#ifndef L2PF
#define L2PF 0  // L2 prefetch size of the plane copies: 0 (none), 128 or 256 bytes
#endif
#ifndef SA
#define SA 0  // activations through a block-shared ring in shared memory (filled with cp.async by the warps that read it)
#endif
#ifndef SAS
#define SAS 2  // SA: stages of the activation ring (2, 3 or 4); the plane rings run as many where they hold them, else 2
#endif
#ifndef SPLIT
#define SPLIT 0  // q <= 4: the two mma of each code word into two accumulator sets (chains of half the length)
#endif
#ifndef SUMR
#define SUMR 0  // SA: each stage's group sums come through the activation ring (cp.async), read from shared memory
#endif
#ifndef ACT_CLAMP_ALWAYS
#define ACT_CLAMP_ALWAYS 0  // SA: every stage's activation copies clamp each chunk (the A/B baseline of the fast path)
#endif
#ifndef SAH
#define SAH 0  // not SA: each stage's group sums are loaded a stage ahead (registers), not at the stage's start
#endif
#define SA_STAGES SAS
#ifndef PDL
#define PDL 0  // launched as a programmatic dependent of the kernel before it (cuda_common.cuh, pdl_wait)
#endif
#if L2PF != 0 && L2PF != 128 && L2PF != 256
#error "L2PF must be 0, 128 or 256"
#endif
#if SC != 2 && SC != 4 && SC != 8
#error "SC must be 2, 4 or 8"
#endif
#if DIRECT && (NT != 1 || MODE == 2)
#error "DIRECT needs NT 1 and an MoE mode"
#endif
#if G % 128
#error "G must be a multiple of 128"
#endif
#if WK != 1 && WK != 2 && WK != 4
#error "WK must be 1, 2 or 4"
#endif
#if RT != 1 && RT != 2 && RT != 4
#error "RT must be 1, 2 or 4"
#endif
#if SAS != 2 && SAS != 3 && SAS != 4
#error "SAS must be 2, 3 or 4"
#endif
#if SA && DIRECT
#error "SA needs blocks of 8 NT slots (not DIRECT)"
#endif
#if SUMR && !SA
#error "SUMR needs SA (the sums ride the activation ring)"
#endif
#if SAH && SA
#error "SAH is for the path without SA"
#endif

#ifndef NW
#define NW 4  // warps per block (4, 8 or 16): under SA all of a K range's warps share its activation ring
#endif
#if NW != 4 && NW != 8 && NW != 16
#error "NW must be 4, 8 or 16"
#endif
#define NWARPS NW
#define WR (NWARPS / WK)  // row tiles per block
#define SLOTS (DIRECT ? 1 : 8 * NT)
#define CHUNK 128
#define GC (G / CHUNK)                      // chunks per group
#define UNIT_CHUNK_ELEMS (NT * 4 * 32 * 8)  // 16-bit activation values of one unit and chunk
#define SUM_CHUNK_BYTES (SUMR ? SLOTS * 4 : 0)  // SUMR: one chunk's group sums (float32 per slot) in the ring
#define ACT_RING_BYTES (SA_STAGES * SC * (UNIT_CHUNK_ELEMS * 2 + SUM_CHUNK_BYTES))  // SA: one K range's activation ring (the widest stage)

#include "cuda_common.cuh"
#include "gate_act.cuh"

#if CT == 0
#define BIAS 128.f
#else
#define BIAS 1024.f
#endif





__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE
                 ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}


// L2PF: the L2 prefetch size the plane copies ask for. A stage reads 64 bytes of each row and plane; with the
// hint a miss makes L2 fetch the whole 128 / 256 bytes, so HBM serves whole lines and the next stages hit L2
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
#if L2PF == 0
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#elif L2PF == 128
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#else
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#endif
}


// Loads of what the previous kernel wrote (activations, group sums). Under PDL that kernel may still be running when this
// one starts, so these are plain (coherent, L1-cached) loads: a read-only (.nc) load may be moved above pdl_wait() by
// the compiler, which treats its memory as unchanging for the whole kernel.
#if PDL
__device__ __forceinline__ uint4 ld_act128(const u16* p) { return *(const uint4*)p; }
__device__ __forceinline__ float ld_sum(const float* p) { return *p; }
__device__ __forceinline__ float2 ld_sum2(const float* p) { return *(const float2*)p; }
#else
__device__ __forceinline__ uint4 ld_act128(const u16* p) { return __ldg((const uint4*)p); }
__device__ __forceinline__ float ld_sum(const float* p) { return __ldg(p); }
__device__ __forceinline__ float2 ld_sum2(const float* p) { return __ldg((const float2*)p); }
#endif


// the 8 codes of word j of rows g and g + 8 times every n-tile's activations, into acc: two mma, the code pairs
// (e0, e0 + 4) in slots (2t, 2t+1) and (e0 + 1, e0 + 5) in slots (2t+8, 2t+9), e0 = 0, 2; e0 = 0 into acc, e0 = 2 into
// acc2 (the same registers, or SPLIT a second set: two independent mma chains). pair(h, e): the mma operand of
// nibbles (e, e + 4) of row g (h = 0) or g + 8 (h = 1)
template <typename Pair>
__device__ __forceinline__ void mma_pairs(float (*acc)[4], float (*acc2)[4], Pair pair, const uint4 (*b)[4], int j) {
#pragma unroll
    for (int e0 = 0; e0 < 4; e0 += 2) {
        const u32 a0 = pair(0, e0), a1 = pair(1, e0);
        const u32 a2 = pair(0, e0 + 1), a3 = pair(1, e0 + 1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const uint4 bv = b[nt][j];
            mma16816(e0 == 0 ? acc[nt] : acc2[nt], a0, a1, a2, a3, e0 == 0 ? bv.x : bv.z, e0 == 0 ? bv.y : bv.w);
        }
    }
}

// nibble codes: word j of rows g (va) and g + 8 (vb)
__device__ __forceinline__ void mma_codes(float (*acc)[4], float (*acc2)[4], u32 va, u32 vb, const uint4 (*b)[4], int j) {
    mma_pairs(acc, acc2, [=](int h, int e) { return code_pair(h ? vb : va, e); }, b, j);
}

// 7-bit byte codes (q = 5..7, byte_codes): word j's hi and lo nibble words of rows g (ha, la) and g + 8 (hb, lb)
__device__ __forceinline__ void mma_bytes(float (*acc)[4], float (*acc2)[4], u32 ha, u32 la, u32 hb, u32 lb,
                                          const uint4 (*b)[4], int j) {
    u32 ea, oa, eb, ob;
    byte_codes(ha, la, ea, oa);
    byte_codes(hb, lb, eb, ob);
    const u32 pa[4] = {byte_pair<0>(ea, oa), byte_pair<1>(ea, oa), byte_pair<2>(ea, oa), byte_pair<3>(ea, oa)};
    const u32 pb[4] = {byte_pair<0>(eb, ob), byte_pair<1>(eb, ob), byte_pair<2>(eb, ob), byte_pair<3>(eb, ob)};
    mma_pairs(acc, acc2, [&](int h, int e) { return h ? pb[e] : pa[e]; }, b, j);
}

// 16-bit element offset of input k of slot s inside one unit's activations
__device__ __forceinline__ long long act_offset(int k, int s) {
    const int c = k >> 7, t = (k >> 5) & 3, kk = k & 31;
    const int j = kk & 3, nib = kk >> 2;
    const int e = nib & 3, h = nib >> 2;
    const int nt = s >> 3, lane = ((s & 7) << 2) | t;
    return (((long long)c * NT + nt) * 4 + j) * 256 + lane * 8 + 2 * e + h;
}

struct Coef {  // per (row, group): y += a * acc + b * S
    float a, b;
};

template <int Q>
__device__ __forceinline__ Coef make_coef(u16 s16, u16 o16) {
    const float s = h2f(s16), o = h2f(o16);
    const float z = o - s * (float)((1 << Q) - 1);
    Coef c;
    constexpr int W = Q <= 4 ? 4 : Q <= 7 ? 7 : 8;  // bits of the code as the MMA reads it (c << (W - q))
    c.a = 2.f * s * __int_as_float((127 + Q - W) << 23);  // 2 s 2^(q-W)
    c.b = z - (Q == 8 ? 17.f : 1.f) * BIAS * c.a;  // q = 8: acc = 16 acc_hi + acc_lo holds 17 BIAS S
    return c;
}

// pair of slot i of this block, -1 for padding
__device__ __forceinline__ int pair_of(int i, int num_pairs, const int* sorted_ids) {
    if (i >= SLOTS) return -1;
#if DIRECT
    const int p = (int)blockIdx.x;
#elif MODE == 2
    const int p = blockIdx.x * SLOTS + i;
#else
    const int p = sorted_ids[blockIdx.x * SLOTS + i];
#endif
    return p < num_pairs ? p : -1;
}

__device__ __forceinline__ void zero_tiles(float (*a)[NT][4]) {
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) a[r][nt][0] = a[r][nt][1] = a[r][nt][2] = a[r][nt][3] = 0.f;
}

// ------------------------------------------------------------ what a block and warp work on
// The expert of block x (-1: nothing to do).
__device__ __forceinline__ int expert_of_block(int bx, int row_index, int num_pairs, int num_experts,
                                               const int* expert_ids, const int* post_pad) {
#if MODE == 2
    return row_index;
#elif DIRECT
    if (bx >= num_pairs) return -1;
    const int e = expert_ids[bx];
    return e < num_experts ? e : -1;  // -1: a non-local expert under expert parallelism
#else
    return bx * SLOTS < post_pad[0] ? expert_ids[bx] : -1;
#endif
}

// Rows of the RT tiles of warp row wr in row block by: MODE 0: gate n = 8 rt + g and up I + n; MODE 1/2: 16 rt + g and
// 16 rt + g + 8 (clamped to valid rows: a tile past the end reads row n_out - 1 and stores nothing). Returns whether
// the warp's first tile has rows.
__device__ __forceinline__ bool rows_of_warp(int by, int wr, int g, int n_out, int* na, int* nb, int* ra, int* rb) {
    const int rt0 = (by * WR + wr) * RT;  // first row tile of this warp (it holds RT consecutive tiles)
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#if MODE == 0
        na[r] = 8 * (rt0 + r) + g;
        nb[r] = na[r];
        ra[r] = min(na[r], n_out - 1);
        rb[r] = n_out + ra[r];
#else
        na[r] = 16 * (rt0 + r) + g;
        nb[r] = na[r] + 8;
        ra[r] = min(na[r], n_out - 1);
        rb[r] = min(nb[r], n_out - 1);
#endif
    }
    return (MODE == 0 ? 8 : 16) * rt0 < n_out;
}

// K range (chunks) of warp part wk in K slice bz (MODE 1/2; MODE 0 has one slice): WK parts of whole groups, `per`
// chunks each (the last may be shorter)
__device__ __forceinline__ int k_range_of_warp(int bz, int wk, int chunks, int k_per_split, int& c_begin, int& c_end) {
    const int kc = k_per_split / CHUNK;
    const int blk_begin = MODE == 0 ? 0 : min(chunks, bz * kc);
    const int blk_end = MODE == 0 ? chunks : min(chunks, blk_begin + kc);
    const int per = ((blk_end - blk_begin + GC * WK - 1) / (GC * WK)) * GC;
    c_begin = min(blk_end, blk_begin + wk * per);
    c_end = min(blk_end, c_begin + per);
    return per;
}

// ------------------------------------------------------------ one warp: RT tiles of 16 rows x chunks [c_begin, c_end)
// Tile r holds rows ra[r] (lane row g) and rb[r] (g + 8); every tile multiplies the same activation fragments, so a
// warp of RT tiles loads each chunk's activations once for 16 RT rows.
// SA: the activations come from a ring in shared memory that the WR warps sharing this K range fill together with
// cp.async, one stage at a time next to their planes (each warp copies 1 / WR of it), so a unit's activations leave
// L2 once per block instead of once per warp. The warps of a block then step in lockstep: one block barrier per
// stage (every warp runs the same nstages, including those whose rows or K range are empty).
template <int Q>
__device__ __forceinline__ void warp_rows(const long long* prow, const u16* xf, const float* xs, int n_table, int K,
                                          unsigned char* ring, u32 act_ring, const unsigned char* act_ring_ptr,
                                          const int* ra, const int* rb, int c_begin,
                                          int c_end, int span, float (*y)[NT][4]) {
    // chunks per stage: SC, halved where two stages (SA: SA_STAGES) of RT tiles of Q planes would not fit the ring
    // (5-8 bits, or more than one tile, in the 8 KB ring)
    constexpr int SCQ = (SC == 4 && RING < (SA ? SA_STAGES : 2) * Q * 1024 * RT) ? 2 : SC;
    // q = 5..7: one chain of byte codes from planes 0-2 (hi words, bits 2..0 of the nibble) and 3.. (lo, from bit 3);
    // q = 8: two chains of nibbles, planes 0-3 (hi) and 4-7 (lo); q <= 4: hi only
    constexpr bool BYTES = Q >= 5 && Q <= 7;
    constexpr int NP_HI = Q < 4 ? Q : BYTES ? 3 : 4;
    constexpr int NP_LO = Q - NP_HI;
    // a second accumulator set: q = 8's lo chain, or SPLIT's second mma of each code word (q <= 4)
    constexpr bool ACC_LO = Q == 8 || (Q <= 4 && SPLIT);
    constexpr int RL = ACC_LO ? RT : 1;  // (size 1 and unused without it)
    constexpr int PLANE_BYTES = 16 * SCQ * 16;  // one plane of one tile and stage: 16 rows x SCQ chunks x 16 bytes
    constexpr int TILE_BYTES = Q * PLANE_BYTES;
    constexpr int STAGE_BYTES = RT * TILE_BYTES;
    constexpr int DR = RING / STAGE_BYTES;
    // ring slots (D - 1 stages in flight; 1: the warp waits for each stage); SA: the activation ring's SA_STAGES where
    // the plane ring holds that many stages of Q planes, else fewer (the activation ring then leaves slots unused)
    constexpr int D = SA ? (DR < SA_STAGES ? DR : SA_STAGES) : (DR > 8 ? 8 : (DR < 1 ? 1 : DR));
    static_assert(DR >= 1, "RING must hold one stage of PMAX planes");
    static_assert(!SA || D >= 2, "SA needs the plane ring to hold two stages");
    constexpr int ACT_DATA_BYTES = SCQ * UNIT_CHUNK_ELEMS * 2;  // one stage of the K range's activations
    constexpr int ACT_STAGE_BYTES = ACT_DATA_BYTES + SCQ * SUM_CHUNK_BYTES;  // SUMR: then the stage's group sums
    constexpr int ACT_STAGE_PIECES = ACT_DATA_BYTES / 16;  // 16-byte copies of one stage's activations (SA)
    constexpr int SUM_PIECES = SCQ * SUM_CHUNK_BYTES / 16;  // SUMR: 16-byte copies of its sums (one per lane)
    static_assert(SUM_PIECES <= WR * 32, "SUMR: a stage's sums must take one copy per lane of the K range");
    constexpr int ACT_PIECES = (ACT_STAGE_PIECES + WR * 32 - 1) / (WR * 32);  // per lane (the last may be idle)
    const int nstages = (span + SCQ - 1) / SCQ;  // span: chunks from c_begin (SA: the same for every warp of the block)
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long long row_bytes = K >> 3;
    const int ngroups = K / G;
    const u16* table = (const u16*)prow[1];
    // cp.async of this lane: rows g and g + 8 of each tile (global rows ra[r], rb[r]), 16-byte chunks t (and t + 4)
    // of each stage, into the swizzled slot (row r, chunk i) -> r * 16 SCQ + 16 (i ^ swz(r)) of each plane's piece:
    // conflict-free ldmatrix phases (8 rows of one chunk) and cp.async phases (2 rows x 4 chunks)
    const unsigned char* src[Q];  // row ra[0] of each plane
#pragma unroll
    for (int p = 0; p < Q; ++p)
        src[p] = (const unsigned char*)prow[2 + p] + (long long)ra[0] * row_bytes + (long long)(c_begin + t) * 16;
    long long da[RT], db[RT];  // byte offsets of each tile's rows ra[r], rb[r] from ra[0] (da[0] = 0 is not added)
    const u16* tab_a[RT];
    const u16* tab_b[RT];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        da[r] = (long long)(ra[r] - ra[0]) * row_bytes;
        db[r] = (long long)(rb[r] - ra[0]) * row_bytes;
        // table rows of ra and rb (scale at [0], offset at [n_table * ngroups])
        tab_a[r] = table + (long long)ra[r] * ngroups;
        tab_b[r] = table + (long long)rb[r] * ngroups;
    }
    auto swz = [](int r) {
        return SCQ == 2 ? (r >> 2) & 1 : SCQ == 4 ? (r >> 1) & 3 : ((r & 1) << 2) | ((r >> 1) & 3);
    };
    const u32 ring_base = smem_u32(ring);
    const u32 dst_a = (u32)(g * SCQ * 16 + ((t ^ swz(g)) << 4)), dst_b = (u32)((g + 8) * SCQ * 16 + ((t ^ swz(g + 8)) << 4));
    const u32 dst_a4 = (u32)(g * SCQ * 16 + (((t + 4) ^ swz(g)) << 4));
    const u32 dst_b4 = (u32)((g + 8) * SCQ * 16 + (((t + 4) ^ swz(g + 8)) << 4));
    // ldmatrix row address of this lane: matrix m = lane / 8 -> (plane +m/2, row half m%2), row lane % 8
    const int lm = lane >> 3, lr = (lane & 7) + 8 * (lm & 1);
    const u32 lsm = (u32)((lm >> 1) * PLANE_BYTES + lr * SCQ * 16);
    const int lsw = swz(lr);
    const int toff = n_table * ngroups;
    const u16* xl = xf + lane * 8;
    const int piece0 = (((int)threadIdx.x >> 5) % WR) * 32 + lane;  // SA: this lane's first copy of a stage
    // SA: 16-byte pieces per chunk, and the address of this lane's first piece at stage 0. Its other pieces lie at offsets
    // fixed at compile time (WR * 32 and PPC are powers of two, one a multiple of the other), so a stage inside the K
    // range copies from one address per lane; only a stage that reaches past it clamps each chunk
    constexpr int PPC = UNIT_CHUNK_ELEMS / 8;
    static_assert((WR * 32) % PPC == 0 || PPC % (WR * 32) == 0, "SA: lanes per K range and pieces per chunk must nest");
    const u16* act_lane = xf + (long long)(c_begin + piece0 / PPC) * UNIT_CHUNK_ELEMS + (piece0 % PPC) * 8;

    // the planes of stage si into ring slot si % D
    auto issue_planes = [&](int si) {
        const int c = c_begin + si * SCQ + t;
        if (si < nstages && t < SCQ && c < c_end) {
            const long long so = (long long)si * SCQ * 16;
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                const u32 base = ring_base + (u32)((si % D) * STAGE_BYTES + r * TILE_BYTES);
#pragma unroll
                for (int p = 0; p < Q; ++p) {
                    cp_async16(base + p * PLANE_BYTES + dst_a, src[p] + so + (r == 0 ? 0 : da[r]));
                    cp_async16(base + p * PLANE_BYTES + dst_b, src[p] + so + db[r]);
                }
                if (SCQ == 8 && c + 4 < c_end) {
#pragma unroll
                    for (int p = 0; p < Q; ++p) {
                        cp_async16(base + p * PLANE_BYTES + dst_a4, src[p] + so + 64 + (r == 0 ? 0 : da[r]));
                        cp_async16(base + p * PLANE_BYTES + dst_b4, src[p] + so + 64 + db[r]);
                    }
                }
            }
        }
    };
    // SA: this lane's share of stage si's activations into activation slot si % D. A chunk past the K range copies the
    // range's last chunk (real, finite values: its codes meet coefficients and sums of 0 there, see below).
    auto issue_acts = [&](int si) {
        if (SA && si < nstages) {
            const u32 base = act_ring + (u32)((si % D) * ACT_STAGE_BYTES);
            if (!ACT_CLAMP_ALWAYS && c_begin + (si + 1) * SCQ <= c_end) {
                // the whole stage inside the K range: each piece at a fixed offset from this lane's address
                const u16* src = act_lane + (long long)si * SCQ * UNIT_CHUNK_ELEMS;
#pragma unroll
                for (int j = 0; j < ACT_PIECES; ++j) {
                    const int piece = piece0 + j * WR * 32;
                    if (ACT_STAGE_PIECES % (WR * 32) != 0 && piece >= ACT_STAGE_PIECES) break;
                    cp_async16(base + (u32)piece * 16,
                               src + (j * WR * 32 / PPC) * UNIT_CHUNK_ELEMS + ((j * WR * 32) % PPC) * 8);
                }
            } else {
#pragma unroll
                for (int j = 0; j < ACT_PIECES; ++j) {
                    const int piece = piece0 + j * WR * 32;
                    if (ACT_STAGE_PIECES % (WR * 32) != 0 && piece >= ACT_STAGE_PIECES) break;
                    const int i = piece / PPC;  // chunk of the stage
                    const int c = max(0, min(c_begin + si * SCQ + i, c_end - 1));
                    cp_async16(base + (u32)piece * 16, xf + (long long)c * UNIT_CHUNK_ELEMS + (piece % PPC) * 8);
                }
            }
            // SUMR: the sums of the stage's group-end chunks inside the K range (the others are never read)
            if (SUMR && piece0 < SUM_PIECES) {
                constexpr int PER_CHUNK = SUM_CHUNK_BYTES / 16 > 0 ? SUM_CHUNK_BYTES / 16 : 1;
                const int i = piece0 / PER_CHUNK, c = c_begin + si * SCQ + i;
                if (c < c_end && (c + 1) % GC == 0)
                    cp_async16(base + (u32)(ACT_DATA_BYTES + piece0 * 16),
                               xs + (long long)((c * CHUNK) / G) * SLOTS + (piece0 % PER_CHUNK) * 4);
            }
        }
    };
    // (scale, offset) of each tile's rows ra, rb for the group of stage position t + 4 h
    auto load_scales = [&](int si, int h, u16 (*sc)[4]) {
        const int c = c_begin + si * SCQ + t + 4 * h;
        const bool ok = si < nstages && t < SCQ && c < c_end;
        const int grp = (c * CHUNK) / G;
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            if (ok) {
                sc[r][0] = __ldg(tab_a[r] + grp);
                sc[r][1] = __ldg(tab_a[r] + toff + grp);
                sc[r][2] = __ldg(tab_b[r] + grp);
                sc[r][3] = __ldg(tab_b[r] + toff + grp);
            } else {
                sc[r][0] = sc[r][1] = sc[r][2] = sc[r][3] = 0;
            }
        }
    };
    // chunk c's activations for every n-tile: from L2 (each warp its own), or SA from the activation ring (stage si)
    auto load_act = [&](int c, int si, uint4 (*b)[4]) {
        if constexpr (SA) {  // c: the chunk's position in stage si
            const u32 pc = act_ring + (u32)((si % D) * ACT_STAGE_BYTES + c * UNIT_CHUNK_ELEMS * 2 + lane * 16);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int v = 0; v < 4; ++v) b[nt][v] = lds128(pc + (nt * 4 + v) * 512);
        } else {
            const u16* pc = xl + (long long)c * UNIT_CHUNK_ELEMS;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int v = 0; v < 4; ++v) {
#if DIRECT
                    b[nt][v] = g == 0 ? ld_act128(pc + v * 256) : make_uint4(0u, 0u, 0u, 0u);
#else
                    b[nt][v] = ld_act128(pc + (nt * 4 + v) * 256);
#endif
                }
        }
    };

    // group sums (L2) of stage si's group-end chunks inside the K range, 0 elsewhere
    auto load_sums = [&](int si, float2 (*S)[NT]) {
#pragma unroll
        for (int i = 0; i < SCQ; ++i) {
            const int c = c_begin + si * SCQ + i;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                S[i][nt] = make_float2(0.f, 0.f);
                if ((c + 1) % GC == 0 && c < c_end) {
                    const long long grp = (c * CHUNK) / G;
#if DIRECT
                    S[i][nt] = make_float2(t == 0 ? ld_sum(xs + grp) : 0.f, 0.f);
#else
                    S[i][nt] = ld_sum2(xs + grp * SLOTS + nt * 8 + 2 * t);
#endif
                }
            }
        }
    };

    if (SA) {
        // the planes of the first D - 1 stages while the kernel before finishes; the activations it writes after
        // pdl_wait (cp.async group 0 then holds those planes and stage 0's activations)
#pragma unroll
        for (int st = 0; st < D - 1; ++st) issue_planes(st);
        pdl_wait();
#pragma unroll
        for (int st = 0; st < D - 1; ++st) {
            issue_acts(st);
            cp_async_commit();
        }
    } else {
#pragma unroll
        for (int st = 0; st < D - 1; ++st) {
            issue_planes(st);
            cp_async_commit();
        }
    }
    constexpr int NH = SCQ < 4 ? 1 : SCQ / 4;  // coefficient sets per lane, tile and stage
    // the tables come from DRAM: their loads run PD stages ahead (rotated through registers)
    constexpr int PD = SPD;
    u16 sc[PD][NH][RT][4];
#pragma unroll
    for (int d = 0; d < PD; ++d)
#pragma unroll
        for (int h = 0; h < NH; ++h) load_scales(d, h, sc[d][h]);
    float acc[RT][NT][4], acc_lo[RL][NT][4];
    zero_tiles(acc);
    if constexpr (ACC_LO) zero_tiles(acc_lo);
    // activations from L2: double-buffered for one n-tile (the next chunk's load is in flight), else loaded per chunk
    constexpr bool PREFETCH = !SA && NT == 1 && BPF;
    uint4 bq[PREFETCH ? 2 : 1][NT][4];
    // the activations and their sums are the previous kernel's output: everything above reads only planes and tables
    pdl_wait();
    if (PREFETCH) load_act(c_begin, 0, bq[0]);
    float2 S_nx[SAH ? SCQ : 1][NT];  // SAH: the next stage's group sums
    if constexpr (SAH) load_sums(0, S_nx);

    for (int si = 0; si < nstages; ++si) {
        if (SA) {
            // stage si complete in this thread; the barrier makes every warp's copies visible and tells that all are
            // done with stage si - 1, whose slots the next copies take
            cp_async_wait<D - 2>();
            __syncthreads();
            issue_planes(si + D - 1);
            issue_acts(si + D - 1);
            cp_async_commit();
        } else {
            issue_planes(si + D - 1);  // into the slot stage si - 1 used (every lane passed the __syncwarp below)
            cp_async_commit();
            cp_async_wait<D - 1>();
            __syncwarp();
        }
        Coef ca[NH][RT], cb[NH][RT];
#pragma unroll
        for (int h = 0; h < NH; ++h)
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                ca[h][r] = make_coef<Q>(sc[0][h][r][0], sc[0][h][r][1]);
                cb[h][r] = make_coef<Q>(sc[0][h][r][2], sc[0][h][r][3]);
            }
#pragma unroll
        for (int d = 0; d + 1 < PD; ++d)
#pragma unroll
            for (int h = 0; h < NH; ++h)
#pragma unroll
                for (int r = 0; r < RT; ++r)
#pragma unroll
                    for (int k = 0; k < 4; ++k) sc[d][h][r][k] = sc[d + 1][h][r][k];
#pragma unroll
        for (int h = 0; h < NH; ++h) load_scales(si + PD, h, sc[PD - 1][h]);
        // group sums of the stage's groups: SUMR from the activation ring, read at each group's end; else from L2,
        // loaded before the stage's work (SAH: during the stage before, into S_nx)
        float2 S_st[SUMR ? 1 : SCQ][NT];
        if constexpr (!SUMR) {
            if constexpr (SAH) {
#pragma unroll
                for (int i = 0; i < SCQ; ++i)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) S_st[i][nt] = S_nx[i][nt];
                load_sums(si + 1, S_nx);
            } else {
                load_sums(si, S_st);
            }
        }
        // No per-chunk guard (one n-tile): a chunk at or past c_end (the last stage of a slice) multiplies whatever
        // its ring slot holds (finite codes: MAGIC | nibble, or | a byte below 128) by real activations (clamped
        // loads) into acc, and its group's coefficients and sums are 0 (load_scales, S_st), so it adds exactly 0 to
        // y. The stage is then one straight-line block the compiler schedules across chunks (ldmatrix, shuffles and
        // mma of neighbours).
        const u32 sbase = ring_base + (u32)((si % D) * STAGE_BYTES);
#pragma unroll
        for (int i = 0; i < SCQ; ++i) {
            const int c = c_begin + si * SCQ + i;
            if (NT == 1 || c < c_end) {  // uniform over the warp; two n-tiles keep the guard (unguarded, they spill)
                uint4(*b)[4] = bq[PREFETCH ? (i & 1) : 0];
                if (SA) load_act(i, si, bq[0]);
                else if (!PREFETCH) load_act(min(c, c_end - 1), si, bq[0]);
                else load_act(min(c + 1, c_end - 1), si, bq[PREFETCH ? ((i + 1) & 1) : 0]);
                const bool group_end = (c + 1) % GC == 0;
                float2 S_sm[NT];  // SUMR: this chunk's sums from the ring (0 past the K range: see above)
                if constexpr (SUMR) {
                    if (group_end) {
                        const unsigned char* ps = act_ring_ptr + (si % D) * ACT_STAGE_BYTES + ACT_DATA_BYTES + i * SUM_CHUNK_BYTES;
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
                            S_sm[nt] = c < c_end ? *(const float2*)(ps + (nt * 8 + 2 * t) * 4) : make_float2(0.f, 0.f);
                    }
                }
                const float2* S = SUMR ? S_sm : S_st[SUMR ? 0 : i];
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    // plane words of this chunk and tile: w[p][0] row g, w[p][1] row g + 8, word t
                    const u32 tbase = sbase + r * TILE_BYTES + lsm + ((i ^ lsw) << 4);
                    u32 wa[Q], wb[Q];
#pragma unroll
                    for (int pp = 0; pp < Q / 2; ++pp)
                        ldsm_x4(tbase + pp * 2 * PLANE_BYTES, wa[2 * pp], wb[2 * pp], wa[2 * pp + 1], wb[2 * pp + 1]);
                    if (Q & 1) ldsm_x2(tbase + (Q - 1) * PLANE_BYTES, wa[Q - 1], wb[Q - 1]);
                    u32 ca4[4], cb4[4], la4[4], lb4[4];
                    codes_of<NP_HI, BYTES ? 2 : 3>(wa, ca4);
                    codes_of<NP_HI, BYTES ? 2 : 3>(wb, cb4);
                    if constexpr (NP_LO > 0) {  // q = 5: lo's rows 0 and 1 are zero, its bit-0 stage goes first
                        codes_of<NP_LO, 3, Q == 5>(wa + NP_HI, la4);
                        codes_of<NP_LO, 3, Q == 5>(wb + NP_HI, lb4);
                    }
                    float(*acc2)[4] = ACC_LO && Q != 8 ? acc_lo[r % RL] : acc[r];  // SPLIT: the e0 = 2 mma
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        if constexpr (BYTES) {
                            mma_bytes(acc[r], acc2, ca4[j], la4[j], cb4[j], lb4[j], b, j);
                        } else {
                            mma_codes(acc[r], acc2, ca4[j], cb4[j], b, j);
                            if constexpr (Q == 8) mma_codes(acc_lo[r % RL], acc_lo[r % RL], la4[j], lb4[j], b, j);
                        }
                    }
                    if (group_end) {
                        const int src_lane = g * 4 + (i & 3);  // the lane that read this group's (scale, offset)
                        const Coef& xa = ca[i >> 2][r];
                        const Coef& xb = cb[i >> 2][r];
                        const float aa = __shfl_sync(0xffffffffu, xa.a, src_lane);
                        const float ba = __shfl_sync(0xffffffffu, xa.b, src_lane);
                        const float ab = __shfl_sync(0xffffffffu, xb.a, src_lane);
                        const float bb = __shfl_sync(0xffffffffu, xb.b, src_lane);
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt) {
                            float v[4];
#pragma unroll
                            for (int c2 = 0; c2 < 4; ++c2) {
                                if constexpr (Q == 8) v[c2] = fmaf(16.f, acc[r][nt][c2], acc_lo[r % RL][nt][c2]);
                                else if constexpr (ACC_LO) v[c2] = acc[r][nt][c2] + acc_lo[r % RL][nt][c2];
                                else v[c2] = acc[r][nt][c2];
                                acc[r][nt][c2] = 0.f;
                                if constexpr (ACC_LO) acc_lo[r % RL][nt][c2] = 0.f;
                            }
                            y[r][nt][0] = fmaf(aa, v[0], fmaf(ba, S[nt].x, y[r][nt][0]));
                            y[r][nt][1] = fmaf(aa, v[1], fmaf(ba, S[nt].y, y[r][nt][1]));
                            y[r][nt][2] = fmaf(ab, v[2], fmaf(bb, S[nt].x, y[r][nt][2]));
                            y[r][nt][3] = fmaf(ab, v[3], fmaf(bb, S[nt].y, y[r][nt][3]));
                        }
                    }
                }
            }
        }
        if (!SA) __syncwarp();
    }
    cp_async_wait<0>();
}


#if MODE == 0
// act = gate_act(gate) * up of finished row tile rt (n = 8 rt + g; slots 2t, 2t+1 of each n-tile), rounded to the compute
// type, into w2's activations (xo: this unit's) and their group sums (xs_unit: this unit's, float32 atomics)
__device__ __forceinline__ void w13_store_tile(const float (*yt)[4], int rt, int n_out, int g_out, u16* xo, float* xs_unit,
                                               int num_pairs, const int* sorted_ids) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n = 8 * rt + g;
    float* so = xs_unit + ((8 * rt) / g_out) * SLOTS;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float part[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int slot = nt * 8 + 2 * t + h;
            const int p = pair_of(slot, num_pairs, sorted_ids);
            const float gte = yt[nt][h], up = yt[nt][2 + h];
            const float act = gate_act(gte) * up;
            const u16 hv = f2ct(act);
            part[h] = 0.f;
            if (p >= 0 && n < n_out) {
                xo[act_offset(n, slot)] = hv;
                part[h] = ct2f(hv);
            }
        }
#pragma unroll
        for (int d = 4; d < 32; d <<= 1) {
            part[0] += __shfl_xor_sync(0xffffffffu, part[0], d);
            part[1] += __shfl_xor_sync(0xffffffffu, part[1], d);
        }
        if (g == 0) {
            const int s0 = nt * 8 + 2 * t;
            if (s0 < SLOTS) atomicAdd(so + s0, part[0]);
            if (s0 + 1 < SLOTS) atomicAdd(so + s0 + 1, part[1]);
        }
    }
}
#else
// finished row tile (rows n_a = 16 rt + g and n_b = n_a + 8): float32 atomics into [M, N] (MODE 1: times the routing
// weight, into the pair's token row)
__device__ __forceinline__ void w2_add_tile(const float (*yt)[4], int n_a, int n_b, int n_out, int num_pairs,
                                            const int* sorted_ids, const float* topk_weights, int apply_w_in, int topk,
                                            int m_rows, float* acc_out) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int n = c < 2 ? n_a : n_b;
            const int slot = nt * 8 + 2 * t + (c & 1);
            const int p = pair_of(slot, num_pairs, sorted_ids);
            if (n >= n_out || p < 0) continue;
#if MODE == 1
            const float v = apply_w_in ? yt[nt][c] : yt[nt][c] * topk_weights[p];
            atomicAdd(acc_out + (long long)(p / topk) * n_out + n, v);
#else
            if (p < m_rows) atomicAdd(acc_out + (long long)p * n_out + n, yt[nt][c]);
#endif
        }
    (void)topk_weights; (void)apply_w_in; (void)topk; (void)m_rows;
}
#endif

#if MODE != 0
// the output dtype of rows [r0, r0 + nrows) of the float32 [M, N] sums, plus the bias (the last block of a row block)
__device__ __forceinline__ void convert_rows(const float* acc_out, void* out, const void* bias, int has_bias, int m_rows,
                                             int n_out, int r0, int nrows) {
    for (int idx = threadIdx.x; idx < m_rows * nrows; idx += NWARPS * 32) {
        const int m = idx / nrows, n = r0 + idx % nrows;
        float v = __ldcg(acc_out + (long long)m * n_out + n);
#if OT == 0
        if (has_bias) v += __uint_as_float(((u32)((const u16*)bias)[n]) << 16);
        u16 hv;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(hv) : "f"(v));
        ((u16*)out)[(long long)m * n_out + n] = hv;
#elif OT == 1
        if (has_bias) v += h2f(((const u16*)bias)[n]);
        u16 hv;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hv) : "f"(v));
        ((u16*)out)[(long long)m * n_out + n] = hv;
#else
        if (has_bias) v += ((const float*)bias)[n];
        ((float*)out)[(long long)m * n_out + n] = v;
#endif
    }
}
#endif

extern "C" __global__ void __launch_bounds__(NWARPS * 32, MINB) ap_fold_gemv(
    const u16* xf, const float* xs, const long long* page_table, const float* topk_weights, const int* sorted_ids,
    const int* expert_ids, const int* post_pad, u16* xf_out, float* xs_out, float* acc_out, void* out,
    int* counters, const void* bias, int num_pairs, int topk, int n_out, int n_table, int K, int m_rows,
    int k_per_split, int row_index, int apply_w_in, int num_experts, int pt_stride, int g_out, int xunit_per_pair,
    int has_bias) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wr = warp % WR, wk = warp / WR;
    const int rt0 = (blockIdx.y * WR + wr) * RT;  // first row tile of this warp (it holds RT consecutive tiles)
    const int chunks = K / CHUNK;

    // the next kernel may launch as soon as every block of this one has started: its blocks take the SMs this grid's
    // last wave leaves free and copy their first planes while this one finishes (measured faster than a trigger after
    // the main loop). Routing and alignment were written before the prep kernel launched: read before pdl_wait.
    pdl_launch_dependents();
    const int expert = expert_of_block(blockIdx.x, row_index, num_pairs, num_experts, expert_ids, post_pad);
    int na[RT], nb[RT], ra[RT], rb[RT];
    const bool tile_ok = rows_of_warp(blockIdx.y, wr, g, n_out, na, nb, ra, rb);
    int c_begin, c_end;
    const int per = k_range_of_warp(blockIdx.z, wk, chunks, k_per_split, c_begin, c_end);
    // SA: every warp of a block with an expert steps through the same stages (a block barrier per stage); a warp past
    // the last rows reads the last row (clamped) and stores nothing, one past the K range multiplies zeros
    const bool active = SA ? expert >= 0 : expert >= 0 && tile_ok && c_begin < c_end;

    // input unit of the activations
#if DIRECT
    const int unit = MODE == 0 ? (xunit_per_pair ? (int)blockIdx.x : (int)blockIdx.x / topk) : (int)blockIdx.x;
#else
    const int unit = blockIdx.x;
#endif
    float y[RT][NT][4];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) y[r][nt][0] = y[r][nt][1] = y[r][nt][2] = y[r][nt][3] = 0.f;

#if MODE == 0
    u16* xo = xf_out + (long long)blockIdx.x * (n_out / CHUNK) * UNIT_CHUNK_ELEMS;  // this unit's w2 activations
    float* xs_unit = xs_out + (long long)blockIdx.x * (n_out / g_out) * SLOTS;
#endif
    if (active) {
        const long long* prow = page_table + (long long)expert * pt_stride;
        const int q = (int)prow[0];
        const u16* xfu = xf + (long long)unit * chunks * UNIT_CHUNK_ELEMS;
        const float* xsu = xs + (long long)unit * (K / G) * SLOTS;
        unsigned char* ring = smem + warp * RING;
        const unsigned char* act_ring_ptr = smem + NWARPS * RING + wk * ACT_RING_BYTES;  // SA: this K range's
        const u32 act_ring = smem_u32(act_ring_ptr);
#define CALL_ROWS(Q) \
    warp_rows<(Q <= PMAX ? Q : 1)>(prow, xfu, xsu, n_table, K, ring, act_ring, act_ring_ptr, ra, rb, c_begin, c_end, \
                                   SA ? per : c_end - c_begin, y)
        Q_SWITCH(q, CALL_ROWS)
#undef CALL_ROWS
    }
    // every thread waits before the epilogue's reads and writes (a no-op for the warps that waited in warp_rows, once
    // their first plane copies were in flight)
    pdl_wait();

#if MODE == 0
    // sum the WK parts of each row tile (the rings are free once every warp is past this barrier)
    if (WK > 1) {
        __syncthreads();
        float* red = (float*)smem;
        constexpr int PER_LANE = RT * NT * 4;
        if (wk > 0) {
#pragma unroll
            for (int r = 0; r < RT; ++r)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        red[(((wk - 1) * WR + wr) * 32 + lane) * PER_LANE + (r * NT + nt) * 4 + c] = y[r][nt][c];
        }
        __syncthreads();
        if (wk == 0) {
#pragma unroll
            for (int p = 1; p < WK; ++p)
#pragma unroll
                for (int r = 0; r < RT; ++r)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int c = 0; c < 4; ++c)
                            y[r][nt][c] += red[(((p - 1) * WR + wr) * 32 + lane) * PER_LANE + (r * NT + nt) * 4 + c];
        }
    }
    if (wk != 0 || expert < 0 || !tile_ok) return;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        if (8 * (rt0 + r) >= n_out) break;  // uniform: the tiles past the end
        w13_store_tile(y[r], rt0 + r, n_out, g_out, xo, xs_unit, num_pairs, sorted_ids);
    }
    (void)nb;
#else
    // float32 atomics into [M, N], then the last block of each row block converts it
    if (active) {
#pragma unroll
        for (int r = 0; r < RT; ++r)
            w2_add_tile(y[r], na[r], nb[r], n_out, num_pairs, sorted_ids, topk_weights, apply_w_in, topk, m_rows,
                        acc_out);
        __threadfence();
    }
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        const int prev = atomicAdd(counters + blockIdx.y, 1);
        last = prev == (int)(gridDim.x * gridDim.z) - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int r0 = blockIdx.y * WR * RT * 16;
    const int nrows = min(WR * RT * 16, n_out - r0);
    if (nrows > 0) convert_rows(acc_out, out, bias, has_bias, m_rows, n_out, r0, nrows);
    (void)xf_out; (void)xs_out; (void)g_out; (void)xunit_per_pair; (void)has_bias;
#endif
}

// ---------------------------------------------------------------- activations -> the fragment order
// Block (unit, group): every slot's G inputs of this group rounded to the compute type, stored where
// ap_fold_gemv's lanes load them, and their sum (of the rounded values). src_mode: 0 unit = token,
// 1 unit = pair (x[pair / topk] * w[pair]), 2 unit = m-block of pairs (sorted_ids), 3 the same times w[pair],
// 4 unit = block of rows of a dense linear. Also zeroes `zero[0 .. zero_len)` (the accumulators of the calls
// that follow) with the whole grid.

extern "C" __global__ void __launch_bounds__(256) ap_fold_prep(
    const void* x, int ld, const float* topk_weights, const int* sorted_ids, const int* post_pad, int has_post_pad,
    u16* xf, float* xs, int num_pairs, int topk, int K, int m_rows, int src_mode, float* zero, int zero_len) {
    pdl_wait();  // x and the routing are the previous kernels' outputs, and `zero` may be memory they used
    pdl_launch_dependents();  // then w13 may launch and copy planes (it waits for this kernel before its activations)
    const long long nthreads = (long long)gridDim.x * gridDim.y * 256;
    for (long long i = ((long long)blockIdx.y * gridDim.x + blockIdx.x) * 256 + threadIdx.x; i < zero_len; i += nthreads)
        zero[i] = 0.f;
    const int unit = blockIdx.x, grp = blockIdx.y;
    if (has_post_pad && unit * SLOTS >= post_pad[0]) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    u16* xu = xf + (long long)unit * (K / CHUNK) * UNIT_CHUNK_ELEMS;
    for (int slot = warp; slot < SLOTS; slot += 8) {
        long long row = -1;
        float wgt = 1.f;
        if (src_mode == 0) {
            row = unit;
        } else if (src_mode == 1) {
            row = unit / topk;
            wgt = topk_weights[unit];
        } else if (src_mode == 2 || src_mode == 3) {
            const int p = sorted_ids[unit * SLOTS + slot];
            if (p < num_pairs) {
                row = p / topk;
                if (src_mode == 3) wgt = topk_weights[p];
            }
        } else {
            const int r = unit * SLOTS + slot;
            if (r < m_rows) row = r;
        }
        float sum = 0.f;
        for (int kk = lane; kk < G; kk += 32) {
            const int k = grp * G + kk;
            const u16 hv = f2ct(row >= 0 ? load_x(x, row, ld, k) * wgt : 0.f);
            xu[act_offset(k, slot)] = hv;
            sum += ct2f(hv);
        }
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
        if (lane == 0) xs[((long long)unit * (K / G) + grp) * SLOTS + slot] = sum;
    }
}
