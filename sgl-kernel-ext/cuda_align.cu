// moe_align_block_size for prefill sizes (align.py has the output contract): one block of 32 warps, no host
// sync, static shapes. Compiled at first use with NVRTC (cuda_align.py); no CUDA headers.
//
// Warp w owns the contiguous pairs [w per, (w + 1) per). Pass 1 counts each warp's pairs per expert into its own
// row of a shared histogram; a column scan turns the rows into each warp's first rank inside every expert, and a
// scan over the experts gives each expert's padded segment. Pass 2 walks each warp's pairs in order, 32 at a
// time: lanes holding the same expert (match.any) take consecutive slots after the warp's running rank, so the
// order inside an expert is the pair order (stable), as in the torch version. Work is O(pairs / 1024 + experts)
// per thread, against the single-program Triton version's O(pairs * experts / 128).
// Pass 1 issues UNROLL loads per lane before it counts them (a lane's loads are otherwise one global latency each)
// and keeps every pair's expert in shared memory (int16, where `stash_cap` pairs fit), so pass 2, a dependent chain
// per 32 pairs, reads shared memory instead of global.

#define UNROLL 8

#define NW 32

extern "C" __global__ void __launch_bounds__(1024) ap_moe_align(
    const void* ids, int ids_64, int* sorted_ids, int* expert_ids, int* post_pad, int num_pairs, int num_experts,
    int block_size, int max_padded, int max_blocks, int stash_cap) {
    extern __shared__ int sm[];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // A kernel launched after this one as a programmatic dependent (the fold MoE's prep) may launch now: it waits for
    // this kernel to complete before it reads the alignment. No effect on a dependent launched the plain way.
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    int* hist = sm;                          // [NW][E]: counts, then each warp's first rank per expert
    int* seg = sm + NW * num_experts;        // [E + 1]: padded segment starts (seg[E] = total)
    int* scan = seg + num_experts + 1;       // [1024]: scan scratch
    short* stash = (short*)(scan + 1024);    // [num_pairs]: each pair's expert (-1: none), where they fit
    const bool stashed = num_pairs <= stash_cap;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int per = ((num_pairs + NW * 32 - 1) / (NW * 32)) * 32;
    const int begin = warp * per, end = min(num_pairs, begin + per);
    auto expert_of = [&](int i) -> int {
        const long long v = ids_64 ? ((const long long*)ids)[i] : (long long)((const int*)ids)[i];
        return v >= 0 && v < num_experts ? (int)v : -1;
    };
    for (int i = tid; i < NW * num_experts; i += 1024) hist[i] = 0;
    __syncthreads();
    for (int i0 = begin + lane; i0 < end; i0 += 32 * UNROLL) {
        int ev[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) ev[u] = i0 + 32 * u < end ? expert_of(i0 + 32 * u) : -1;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (ev[u] >= 0) atomicAdd(&hist[warp * num_experts + ev[u]], 1);
            if (stashed && i0 + 32 * u < end) stash[i0 + 32 * u] = (short)ev[u];
        }
    }
    __syncthreads();
    // per expert: exclusive scan over the warps, the total, the padded size
    int padded = 0;
    for (int e0 = 0; e0 < num_experts; e0 += 1024) {
        const int e = e0 + tid;
        int run = 0;
        if (e < num_experts) {
            for (int w = 0; w < NW; ++w) {
                const int c = hist[w * num_experts + e];
                hist[w * num_experts + e] = run;
                run += c;
            }
        }
        const int pad = e < num_experts ? (run + block_size - 1) / block_size * block_size : 0;
        // inclusive scan of pad over this slice of experts (Hillis-Steele), plus the slices before it
        scan[tid] = pad;
        __syncthreads();
        for (int d = 1; d < 1024; d <<= 1) {
            const int v = tid >= d ? scan[tid - d] : 0;
            __syncthreads();
            scan[tid] += v;
            __syncthreads();
        }
        if (e < num_experts) seg[e] = padded + scan[tid] - pad;
        padded += scan[1023];
        __syncthreads();
    }
    if (tid == 0) {
        seg[num_experts] = padded;
        post_pad[0] = padded;
    }
    for (int i = tid; i < max_padded; i += 1024) sorted_ids[i] = num_pairs;
    __syncthreads();  // the pad fill (global) before the scatter into the same array, and seg[E]
    for (int b = tid; b < max_blocks; b += 1024) {
        const int start = b * block_size;
        int e = -1;
        if (start < padded) {  // the last expert whose segment starts at or before the block
            int lo = 0, hi = num_experts - 1;
            while (lo < hi) {
                const int mid = (lo + hi + 1) >> 1;
                if (seg[mid] <= start) lo = mid; else hi = mid - 1;
            }
            e = lo;
        }
        expert_ids[b] = e;
    }
    // pass 2: stable scatter
    for (int base = begin; base < end; base += 32) {
        const int i = base + lane;
        const int e = i < end ? (stashed ? (int)stash[i] : expert_of(i)) : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        int first = 0;
        if (e >= 0) {
            first = hist[warp * num_experts + e];
            sorted_ids[seg[e] + first + rank] = i;
        }
        __syncwarp();
        if (e >= 0 && rank == 0) hist[warp * num_experts + e] = first + __popc(peers);
        __syncwarp();
    }
}
