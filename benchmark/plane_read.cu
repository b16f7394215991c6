// Read-only probes of how the decode kernels can stream bit-planes from HBM (benchmark/plane_read_bench.py).
// Each warp owns one tile of 16 rows and walks its K range in stages of PIECE bytes per row and plane, through a
// ring of D stages in shared memory, exactly as the fold kernel's loads do, but with no compute: what one
// access pattern can reach is the ceiling for any kernel built on it.
//   LAYOUT 0: planes as stored today, row r of a plane at r * row_bytes (a stage reads 16 pieces of PIECE bytes,
//             row_bytes apart); LAYOUT 1: tile-major planes, a stage's 16 x PIECE bytes contiguous.
//   BULK 0: cp.async of 16 bytes per lane; BULK 1: cp.async.bulk (the TMA engine's 1-D copies), completed on an
//           mbarrier per stage (LAYOUT 1: one copy per plane, LAYOUT 0: one per row and plane).
//   L2PF: the L2 prefetch size cp.async asks for (a 64-byte piece can make L2 fetch its whole 128 / 256 bytes).

#ifndef PIECE
#define PIECE 64
#endif
#ifndef D
#define D 2
#endif
#ifndef Q
#define Q 4
#endif
#ifndef LAYOUT
#define LAYOUT 0
#endif
#ifndef BULK
#define BULK 0
#endif
#ifndef L2PF
#define L2PF 0  // cp.async's L2 prefetch size hint: 0 none, 64, 128 or 256 bytes
#endif
#if L2PF == 0
#define CP_ASYNC "cp.async.cg.shared.global [%0], [%1], 16;"
#elif L2PF == 64
#define CP_ASYNC "cp.async.cg.shared.global.L2::64B [%0], [%1], 16;"
#elif L2PF == 128
#define CP_ASYNC "cp.async.cg.shared.global.L2::128B [%0], [%1], 16;"
#elif L2PF == 256
#define CP_ASYNC "cp.async.cg.shared.global.L2::256B [%0], [%1], 16;"
#else
#error "L2PF must be 0, 64, 128 or 256"
#endif
#if PIECE % 32
#error "PIECE must be a multiple of 32"
#endif

typedef unsigned int u32;
#define PLANE_STAGE (16 * PIECE)
#define STAGE_BYTES (Q * PLANE_STAGE)
#define WARP_RING (D * STAGE_BYTES)

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

extern "C" __global__ void __launch_bounds__(128) plane_read(const unsigned char* planes, long long plane_stride,
                                                          int tiles, int row_bytes, u32* sink) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tile = blockIdx.x * 4 + warp;
    if (tile >= tiles) return;
    unsigned char* ring = smem + warp * WARP_RING;
    const u32 ring_base = smem_u32(ring);
    const unsigned char* tile_src = planes + (long long)tile * 16 * row_bytes;
    const int nstages = row_bytes / PIECE;
#if BULK
    unsigned long long* bars = (unsigned long long*)(smem + 4 * WARP_RING) + warp * D;
    if (lane == 0) {
        for (int s = 0; s < D; ++s)
            asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_u32(bars + s)));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
#endif
    auto issue = [&](int st) {
        if (st >= nstages) {
#if !BULK
            asm volatile("cp.async.commit_group;" ::: "memory");
#endif
            return;
        }
        const u32 base = ring_base + (u32)((st % D) * STAGE_BYTES);
#if BULK
        const u32 bar = smem_u32(bars + st % D);
        if (lane == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(bar), "r"(STAGE_BYTES) : "memory");
        __syncwarp();
#if LAYOUT
        if (lane < Q) {
            const unsigned char* src = tile_src + lane * plane_stride + (long long)st * PLANE_STAGE;
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(base + lane * PLANE_STAGE), "l"(src), "r"(PLANE_STAGE), "r"(bar) : "memory");
        }
#else
        if (lane < 16) {
#pragma unroll
            for (int p = 0; p < Q; ++p) {
                const unsigned char* src = tile_src + p * plane_stride + (long long)lane * row_bytes + st * PIECE;
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             ::"r"(base + p * PLANE_STAGE + lane * PIECE), "l"(src), "r"(PIECE), "r"(bar) : "memory");
            }
        }
#endif
#else
#pragma unroll
        for (int p = 0; p < Q; ++p)
#pragma unroll
            for (int u = 0; u < PIECE / 32; ++u) {
                const int i = lane + 32 * u;  // 16-byte piece i of this plane's stage
#if LAYOUT
                const unsigned char* src = tile_src + p * plane_stride + (long long)st * PLANE_STAGE + i * 16;
#else
                const int r = i / (PIECE / 16), off = (i % (PIECE / 16)) * 16;
                const unsigned char* src = tile_src + p * plane_stride + (long long)r * row_bytes + st * PIECE + off;
#endif
                asm volatile(CP_ASYNC ::"r"(base + p * PLANE_STAGE + i * 16),
                             "l"(src) : "memory");
            }
        asm volatile("cp.async.commit_group;" ::: "memory");
#endif
    };
    for (int st = 0; st < D - 1; ++st) issue(st);
    u32 acc = 0;
    for (int st = 0; st < nstages; ++st) {
        issue(st + D - 1);
#if BULK
        const u32 bar = smem_u32(bars + st % D);
        const u32 parity = (u32)((st / D) & 1);
        u32 done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#else
        asm volatile("cp.async.wait_group %0;" ::"n"(D - 1) : "memory");
        __syncwarp();
#endif
        const unsigned char* s = ring + (st % D) * STAGE_BYTES;
#pragma unroll
        for (int p = 0; p < Q; ++p) acc ^= *(const u32*)(s + p * PLANE_STAGE + lane * 16);
        __syncwarp();
    }
#if !BULK
    asm volatile("cp.async.wait_group 0;" ::: "memory");
#endif
    if (acc == 0x9e3779b9u) sink[tile] = acc;  // keeps the reads; the planes are random, so never taken in practice
}
