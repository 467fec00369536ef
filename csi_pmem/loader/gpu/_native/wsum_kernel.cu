// wsum64 of equal ranges of device memory, one (s1, s2) pair per range.
//
// The sums of csi_pmem/loader/wsum.py: a range's bytes as little-endian 64-bit words
// w_k (the last one zero-padded), s1 = sum(w_k), s2 = sum((k + 1) * w_k), mod 2**64.
// Range r is the range_bytes bytes at base + r * stride (blockIdx.y = r); its sums are
// added into out[2r] and out[2r + 1], which must start at 0. Unsigned wrap-around makes
// the order of additions irrelevant, so each thread sums strided words, a block reduces
// its threads' sums, and blocks add theirs atomically. base and stride must be 8-byte
// aligned.
//
// One pass over the data, one launch for a batch of whole chunks: torch's reductions
// needed two passes and a dozen small kernels, and a fresh process loaded their code
// (tens of ms) in the middle of a load. scripts/gen_wsum_kernel.py compiles this file
// with NVRTC into csi_pmem/loader/wsum_kernel.py (PTX and cubins); the loader loads it
// through the driver (cuda-python), so a pod needs no CUDA toolkit.

__device__ __forceinline__ void warp_sum(unsigned long long &a, unsigned long long &b)
{
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_down_sync(0xffffffffu, a, o);
        b += __shfl_down_sync(0xffffffffu, b, o);
    }
}

extern "C" __global__ void __launch_bounds__(256)
wsum64_ranges(const unsigned char *__restrict__ base, unsigned long long range_bytes,
              unsigned long long stride, unsigned long long *__restrict__ out)
{
    const unsigned char *data = base + (unsigned long long)blockIdx.y * stride;
    const unsigned long long *words = (const unsigned long long *)data;
    const unsigned long long n = range_bytes >> 3;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long s1 = 0, s2 = 0;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         k < n; k += step) {
        const unsigned long long w = __ldg(words + k);
        s1 += w;
        s2 += (k + 1) * w;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && (range_bytes & 7)) {
        unsigned long long w = 0;
        for (unsigned int b = 0; b < (unsigned int)(range_bytes & 7); b++)
            w |= (unsigned long long)data[(n << 3) + b] << (8 * b);
        s1 += w;
        s2 += (n + 1) * w;
    }
    warp_sum(s1, s2);
    __shared__ unsigned long long p1[8], p2[8];
    const unsigned int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        p1[warp] = s1;
        p2[warp] = s2;
    }
    __syncthreads();
    if (warp == 0) {
        const unsigned int warps = (blockDim.x + 31) >> 5;
        s1 = lane < warps ? p1[lane] : 0;
        s2 = lane < warps ? p2[lane] : 0;
        warp_sum(s1, s2);
        if (lane == 0) {
            atomicAdd(out + 2 * blockIdx.y, s1);
            atomicAdd(out + 2 * blockIdx.y + 1, s2);
        }
    }
}
