// Device helpers of the grouped prefill GEMMs (cuda_grouped_gemm.cu, cuda_grouped_ws.cu): packed fma, cp.async,
// Hopper warpgroup MMA, and the centred weight pairs built from ubcq codes. Pasted after cuda_common.cuh (needs CT).

#if CT == 0
#define PK "bf16x2"
#else
#define PK "f16x2"
#endif

__device__ __forceinline__ u32 pfma(u32 a, u32 b, u32 c) {  // packed a * b + c, one rounding
    u32 d;
    asm("fma.rn." PK " %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 splat(float f) {  // both halves = f in the compute type
    const u32 h = f2ct(f);
    return h | (h << 16);
}

#ifndef TAIL64
#define TAIL64 0  // the intermediate size is an odd multiple of 64 (cuda_grouped_gemm.cu)
#endif
// elements per row of w2's input ([pairs, I]): I, or with TAIL64 I rounded up to whole chunks of 128
#define ROW_STRIDE(n) (TAIL64 ? ((n) + 127) / 128 * 128 : (n))
#ifndef L2PF
#define L2PF 0  // L2 prefetch size of the 16-byte copies: 0 (none), 128 or 256 bytes
#endif
// A stage reads 16 bytes of each weight row and plane; with the hint a miss makes L2 fetch the row's next
// 128 / 256 bytes with it, so HBM serves whole lines and the next stages hit L2
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {  // src_bytes 0: zero fill
#if L2PF == 0
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
#elif L2PF == 128
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
#elif L2PF == 256
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
#else
#error "L2PF must be 0, 128 or 256"
#endif
}
// 8 bytes: the plane rows of a K that is an odd multiple of 64 (K / 8 bytes, 8 mod 16) start 8-byte aligned only
__device__ __forceinline__ void cp_async8(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

typedef unsigned long long u64;

#if WGMMA
// shared-memory matrix descriptor, 128-byte swizzle: start, leading (unused: 1) and stride (8-row groups) byte
// offsets, each >> 4
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 lbo, u32 sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// the "+f" operands of four / eight accumulator fragments d[b ..][0 .. 3] (16 / 32 registers of a wgmma D)
#define WG_ACC4(d, b)                                                                                                \
    "+f"(d[b][0]), "+f"(d[b][1]), "+f"(d[b][2]), "+f"(d[b][3]), "+f"(d[b + 1][0]), "+f"(d[b + 1][1]),               \
        "+f"(d[b + 1][2]), "+f"(d[b + 1][3]), "+f"(d[b + 2][0]), "+f"(d[b + 2][1]), "+f"(d[b + 2][2]),               \
        "+f"(d[b + 2][3]), "+f"(d[b + 3][0]), "+f"(d[b + 3][1]), "+f"(d[b + 3][2]), "+f"(d[b + 3][3])
#define WG_ACC8(d, b) WG_ACC4(d, b), WG_ACC4(d, b + 4)
// d[64 x N] += A[64 x 16] (registers, the mma.m16n8k16 A fragment per warp) x B[16 x N] (shared, K-major), scale-d
// on (accumulate): the instruction's text up to its D registers, and its A and descriptor operands
#define WG_MMA_BEGIN(n)                                                                                              \
    "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n" #n "k16.f32." MMA_TYPE "." MMA_TYPE " "
#define WG_MMA_IN "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc)
// the D operands of a wgmma, 16 at a time: WG_Rr is %16r .. %16r + 15
#define WG_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define WG_R1 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_R2 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define WG_R3 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_R4 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define WG_R5 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define WG_R6 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111"
#define WG_R7 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// wgmma_m64n<N>k16(d, a, desc): d[64 x N] (N / 2 registers: d[0 .. N / 8 - 1][0 .. 3]) += A x B; dregs the D
// operands, ain the A registers and the descriptor after them, the accumulators' "+f" operands last
#define WG_MMA_FN(n, dregs, ain, ...)                                                                                \
    __device__ __forceinline__ void wgmma_m64n##n##k16(float (*d)[4], const u32* a, u64 desc) {                     \
        asm volatile(WG_MMA_BEGIN(n) "{" dregs "}, " ain ", p, 1, 1, 0;\n}\n" : __VA_ARGS__ : WG_MMA_IN);          \
    }
WG_MMA_FN(64, WG_R0 ", " WG_R1, "{%32, %33, %34, %35}, %36", WG_ACC8(d, 0))
WG_MMA_FN(128, WG_R0 ", " WG_R1 ", " WG_R2 ", " WG_R3, "{%64, %65, %66, %67}, %68", WG_ACC8(d, 0), WG_ACC8(d, 8))
WG_MMA_FN(256, WG_R0 ", " WG_R1 ", " WG_R2 ", " WG_R3 ", " WG_R4 ", " WG_R5 ", " WG_R6 ", " WG_R7,
          "{%128, %129, %130, %131}, %132", WG_ACC8(d, 0), WG_ACC8(d, 8), WG_ACC8(d, 16), WG_ACC8(d, 24))
#undef WG_MMA_FN
#endif

struct RowCoef {  // one row's group: packed A and C (bf16: the weight is fma(BIAS + c, A, C); fp16: C = -K0), the
                  // offset's fp32 factor
    u32 a2, c2;
    float z;
};

// Bits of a code as the weight pairs read it, c << (W - q): a nibble (q <= 4); a 7-bit byte (q = 5..7: at most 127,
// so MAGIC | c is BIAS + c exactly in bf16 too, and a pair is one prmt); q = 8 (255 needs 8 mantissa bits, bf16 has
// 7) 16 hi + lo from two nibbles, formed exactly by two packed fmas
template <int Q>
__device__ __forceinline__ constexpr int code_bits() {
    return Q <= 4 ? 4 : Q <= 7 ? 7 : 8;
}

// the group's offset: W = A c + z with z = o - s (2^q - 1) (ubcq: sum_p s 2^(q-1-p) (2 bit_p - 1) + o)
template <int Q>
__device__ __forceinline__ float group_offset(float s, float o) {
    return o - s * (float)((1 << Q) - 1);
}

// A, the weight step of one code unit: 2 s per code, in units of c << (W - q) (code_bits)
template <int Q>
__device__ __forceinline__ float code_step(float s) {
    return 2.f * s * __int_as_float((127 + Q - code_bits<Q>()) << 23);
}

// The weights enter centred, W' = A (c - K0) (+ a known constant), K0 the middle of the code range, and the
// group's offset z + K0 A (less that constant) is applied in fp32: no large term of W' cancels
// against a large z S, so the rounding of A to the compute type costs 2^-9 of the result, not of the offset.
// bf16: one fma (BIAS + c) A + C with C = round(-(BIAS + K0) A): the product and the sum are exact before the one
// rounding; C's own rounding error eps = C + (BIAS + K0) A is exact in fp32 and moves into the offset. q = 8 forms
// c exactly first (exact_code_pair), so its C is round(-K0 A).
// fp16 (where (1024 + K0) A may overflow): c exactly, then c - K0 exactly, then one multiply by A.
template <int Q>
__device__ __forceinline__ RowCoef make_row_coef(u16 s16, u16 o16) {
    constexpr int W = code_bits<Q>();
    const float s = h2f(s16), o = h2f(o16);
    const float z = group_offset<Q>(s, o);
    const float a = code_step<Q>(s);
    // the middle of the code range: (2^q - 1) / 2 in units of c << (W - q)
    const float k0 = (float)((1 << Q) - 1) * __int_as_float((127 + W - 1 - Q) << 23);
    RowCoef c;
    c.a2 = splat(a);
    const float ar = ct2f((u16)c.a2);  // A as the compute type holds it
#if CT == 0
    const float k = W == 8 ? k0 : 128.f + k0;  // q = 8 forms c exactly first (no BIAS left in it)
    c.c2 = splat(-k * ar);
    const float eps = ct2f((u16)c.c2) + k * ar;  // exact: both terms are bf16 products with few bits
#else
    c.c2 = splat(-k0);  // exact in fp16
    const float eps = 0.f;
#endif
    c.z = z + k0 * a - eps;  // the exact A: the rounded one's error stays in the centred term
    return c;
}

// packed constants of the code arithmetic in the compute type (BIAS: 128 in bf16, 1024 in fp16)
struct CodeConst {
#if CT == 0
    static constexpr u32 NEG_BIAS = 0xC300C300u, ONE = 0x3F803F80u, SIXTEEN = 0x41804180u;
    static constexpr u32 NEG_BIAS_8 = 0xC308C308u, NEG_BIAS_64 = 0xC340C340u;  // -(BIAS + 8), -(BIAS + 64)
    static constexpr u32 NEG_17BIAS = 0xC508C508u, NEG_17BIAS_128 = 0xC510C510u;  // -17 BIAS, -(17 BIAS + 128)
#else
    static constexpr u32 NEG_BIAS = 0xE400E400u, ONE = 0x3C003C00u, SIXTEEN = 0x4C004C00u;
    static constexpr u32 NEG_BIAS_8 = 0xE408E408u, NEG_BIAS_64 = 0xE440E440u;
    static constexpr u32 NEG_17BIAS = 0xF440F440u, NEG_17BIAS_128 = 0xF448F448u;
#endif
    static constexpr u32 NEG_ZERO = 0x80008000u;
};

// The code words of one lane's 32 inputs of rows g (wa: its Q plane words) and g + 8 (wb), word j of row h in
// hi[h][j] / lo[h][j]: q <= 4 hi only, nibbles c << (4 - q); q = 8 the nibbles of planes 0-3 (hi) and 4-7 (lo);
// q = 5..7 the 7-bit bytes c << (7 - q) (byte_codes): planes 0-2 transposed one bit lower (bits 6..4 of the byte)
// and planes 3.. (bits 3..0; at 5 bits rows 0 and 1 of that word are zero, so its bit-0 stage goes first), joined
// into hi = the bytes of the even nibbles, lo = those of the odd ones.
template <int Q>
__device__ __forceinline__ void plane_codes(const u32* wa, const u32* wb, u32 (*hi)[4], u32 (*lo)[4]) {
    if constexpr (Q >= 5 && Q <= 7) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            codes_of<3, 2>(h ? wb : wa, hi[h]);
            codes_of<Q - 3, 3, Q == 5>((h ? wb : wa) + 3, lo[h]);
#pragma unroll
            for (int j = 0; j < 4; ++j) byte_codes(hi[h][j], lo[h][j], hi[h][j], lo[h][j]);
        }
    } else {
        codes_of<Q < 4 ? Q : 4>(wa, hi[0]);
        codes_of<Q < 4 ? Q : 4>(wb, hi[1]);
        if constexpr (Q == 8) {
            codes_of<4>(wa + 4, lo[0]);
            codes_of<4>(wb + 4, lo[1]);
        }
    }
}

// q <= 7: the operand (BIAS + c_e, BIAS + c_{e+4}) of nibbles (e, e + 4) of code word j (plane_codes' hi / lo words)
template <int Q>
__device__ __forceinline__ u32 magic_pair(u32 hi, u32 lo, int e) {
    static_assert(Q <= 7, "q = 8 forms its codes from two nibbles (exact_code_pair)");
    if (Q <= 4) return code_pair(hi, e);
    return e == 0 ? byte_pair<0>(hi, lo) : e == 1 ? byte_pair<1>(hi, lo) : e == 2 ? byte_pair<2>(hi, lo)
                                                                                 : byte_pair<3>(hi, lo);
}

// the codes of the nibbles (e, e + 4) exactly in the compute type: q <= 7 BIAS + c less BIAS, q = 8 16 hi + lo
// (<= 255) from the hi and lo words; CENTRED: less KC = 2^(W - 1) (8 nibble, 64 7-bit or 128 byte units; still
// exact: bf16 holds the integers to 256).
// q = 8 in two packed fmas: 16 (BIAS + hi) - 17 BIAS (- 128) = 16 hi - BIAS (- 128), a multiple of 16 the compute
// type holds exactly (bf16: at most 256 in magnitude, fp16: under 2048), then (BIAS + lo) plus it is the code (less
// 128), an integer under 256: both sums exact
template <int Q, bool CENTRED = false>
__device__ __forceinline__ u32 exact_code_pair(u32 hi, u32 lo, int e) {
    using K = CodeConst;
    if constexpr (Q <= 4) return pfma(code_pair(hi, e), K::ONE, CENTRED ? K::NEG_BIAS_8 : K::NEG_BIAS);
    if constexpr (Q <= 7) return pfma(magic_pair<Q>(hi, lo, e), K::ONE, CENTRED ? K::NEG_BIAS_64 : K::NEG_BIAS);
    const u32 hi_part = pfma(code_pair(hi, e), K::SIXTEEN, CENTRED ? K::NEG_17BIAS_128 : K::NEG_17BIAS);
    return pfma(code_pair(lo, e), K::ONE, hi_part);
}

// the weight pair of the nibbles (e, e + 4), centred (make_row_coef)
template <int Q>
__device__ __forceinline__ u32 weight_pair(u32 hi, u32 lo, int e, const RowCoef& rc) {
    using K = CodeConst;
#if CT == 0
    if constexpr (Q <= 7) return pfma(magic_pair<Q>(hi, lo, e), rc.a2, rc.c2);  // (BIAS + c) A + C in one fma
    else return pfma(exact_code_pair<Q>(hi, lo, e), rc.a2, rc.c2);
#else
    return pfma(pfma(exact_code_pair<Q>(hi, lo, e), K::ONE, rc.c2), rc.a2, K::NEG_ZERO);
#endif
}

// offset_in_weights (OFFW): the whole weight per pair, centred: (c - KC) A + (z + KC A), KC = 2^(W - 1) code units
// (c - KC exact in the compute type), the offset term rounded once to the compute type. Centring matters: the
// offset's rounding is the same for every weight of a row's group, so it adds up coherently over the group's inputs
// (2^-9 of it times the group's activation sum), and z + KC A is about the group's middle weight where z alone is
// -(2^q - 1) s. No offset pass over the accumulators, so nothing drains the MMAs at a group's end.
template <int Q>
__device__ __forceinline__ float centred_offset(float s, float o) {
    return group_offset<Q>(s, o) + (float)(1 << (code_bits<Q>() - 1)) * code_step<Q>(s);
}

// a2: A (RowCoef::a2), zc2: centred_offset, both splat in the compute type
template <int Q>
__device__ __forceinline__ u32 weight_pair_ow(u32 hi, u32 lo, int e, u32 a2, u32 zc2) {
    return pfma(exact_code_pair<Q, true>(hi, lo, e), a2, zc2);
}

// w13's epilogue, second half: the block's [ROWS pairs][OUTS] tile of silu(gate) * up (the compute type, in shared
// memory; OUTS = 64: half (n0 / 64) & 1 of a chunk of w2's input, 128: a whole chunk) out in w2's order (slot row,
// the OUTS / 16 values of piece (j, e) that fall in the block's outputs), with each piece's sum added to the pair's
// group sum (float32 atomics); NT threads, every warp whole. Needs CHUNK.
template <int ROWS, int NT, int OUTS>
__device__ __forceinline__ void store_w2_input(const u16* tile, const int* slot_pair, u16* act_out, float* xs_out,
                                               int row_tile, int n_out, int g_out) {
    static_assert(OUTS == 64 || OUTS == 128, "a block writes half a chunk or a whole one");
    constexpr int TT = OUTS / 32;  // lane quarters t of the chunk inside the block's outputs
    const int n0 = OUTS * row_tile;
    const int half = OUTS == 64 ? (n0 >> 6) & 1 : 0;
    for (int idx = threadIdx.x; idx < ROWS * 16; idx += NT) {
        const int slot = idx >> 4, piece = idx & 15;
        const int j = piece >> 2, e = piece & 3;
        u16 v[2 * TT];
        float part = 0.f;
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                v[2 * tt + h] = tile[slot * OUTS + 32 * tt + 4 * (e + 4 * h) + j];
                part += ct2f(v[2 * tt + h]);
            }
#pragma unroll
        for (int d = 8; d > 0; d >>= 1) part += __shfl_xor_sync(0xffffffffu, part, d);
        const int p = slot_pair[slot];
        if (p >= 0) {
            u16* dst = act_out + (long long)p * ROW_STRIDE(n_out) + (n0 >> 7) * CHUNK + piece * 8 + 4 * half;
            if constexpr (OUTS == 64) {
                *(uint2*)dst = make_uint2((u32)v[0] | ((u32)v[1] << 16), (u32)v[2] | ((u32)v[3] << 16));
            } else {
                *(uint4*)dst = make_uint4((u32)v[0] | ((u32)v[1] << 16), (u32)v[2] | ((u32)v[3] << 16),
                                          (u32)v[4] | ((u32)v[5] << 16), (u32)v[6] | ((u32)v[7] << 16));
            }
            if (piece == 0) atomicAdd(xs_out + (long long)p * (n_out / g_out) + n0 / g_out, part);
        }
    }
}

// the dynamic shared memory from its first 1024-byte boundary (128-byte swizzle atoms); the host adds 1024 bytes
__device__ __forceinline__ unsigned char* align_1024(unsigned char* smem_raw) {
    return smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
}

// the pair (-1: padding) and activation row of each of token block tb's ROWS slots (threads 0 .. ROWS - 1); MODE 0
// reads the token's row (or the pair's, when the router weight was applied on the input), MODE 1 the pair's
template <int ROWS>
__device__ __forceinline__ void fill_slots(const int* sorted_ids, int tb, int num_pairs, int topk, int xunit_per_pair,
                                           int* slot_pair, int* slot_unit) {
    const int tid = threadIdx.x;
    if (tid < ROWS) {
        const int p = sorted_ids[tb * ROWS + tid];
        const bool ok = p < num_pairs;
        slot_pair[tid] = ok ? p : -1;
#if MODE == 0
        slot_unit[tid] = ok ? (xunit_per_pair ? p : p / topk) : -1;
#else
        slot_unit[tid] = ok ? p : -1;
        (void)topk; (void)xunit_per_pair;
#endif
    }
}
