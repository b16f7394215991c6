// One 16-byte load of plane bytes through the read-only path, for kernels whose lanes load their own rows' plane
// words (MMA, LUT). L2PF (0, 128 or 256) adds the L2 prefetch-size hint: a miss makes L2 fetch the whole 128 / 256
// bytes around the 16, so HBM serves whole lines and the loads of the row's next bytes find them in L2.
#ifndef L2PF
#define L2PF 0
#endif
#if L2PF != 0 && L2PF != 128 && L2PF != 256
#error "L2PF must be 0, 128 or 256"
#endif

__device__ __forceinline__ uint4 ldg_plane(const void* p) {
#if L2PF == 0
    return __ldg((const uint4*)p);
#else
    uint4 v;
#if L2PF == 128
    asm volatile("ld.global.nc.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
#else
    asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
#endif
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#endif
}

// Eight bytes of plane words (rows of K / 8 bytes with K a multiple of 64 but not of 128 are only 8-byte aligned),
// with the same L2 prefetch-size hint.
__device__ __forceinline__ uint2 ldg_plane8(const void* p) {
#if L2PF == 0
    return __ldg((const uint2*)p);
#else
    uint2 v;
#if L2PF == 128
    asm volatile("ld.global.nc.L2::128B.v2.u32 {%0,%1}, [%2];"
#else
    asm volatile("ld.global.nc.L2::256B.v2.u32 {%0,%1}, [%2];"
#endif
                 : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
#endif
}
