// wsum64 of one range of device memory, added into out[0] (s1) and out[1] (s2).
//
// The same sums as csi_pmem/loader/wsum.py: the range's bytes as little-endian 64-bit
// words w_k (the last one zero-padded), s1 = sum(w_k), s2 = sum((k + 1) * w_k), both
// mod 2**64. Unsigned wrap-around makes the order of additions irrelevant, so threads
// sum strided words and blocks add their partial sums atomically; out must start at 0.
// data must be 8-byte aligned.
//
// scripts/gen_wsum_ptx.py compiles this file to PTX with NVRTC and writes
// csi_pmem/gpucopy/wsum_ptx.py; the copy service loads that PTX with cuModuleLoadData,
// so the node needs the GPU driver only (no CUDA toolkit, no torch).

__device__ __forceinline__ void warp_sum(unsigned long long &a, unsigned long long &b)
{
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_down_sync(0xffffffffu, a, o);
        b += __shfl_down_sync(0xffffffffu, b, o);
    }
}

extern "C" __global__ void __launch_bounds__(256)
wsum64(const unsigned char *__restrict__ data, unsigned long long nbytes,
       unsigned long long *__restrict__ out)
{
    const unsigned long long *words = (const unsigned long long *)data;
    const unsigned long long n = nbytes >> 3;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long s1 = 0, s2 = 0;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         k < n; k += stride) {
        const unsigned long long w = __ldg(words + k);
        s1 += w;
        s2 += (k + 1) * w;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0 && (nbytes & 7)) {
        unsigned long long w = 0;
        for (unsigned int b = 0; b < (unsigned int)(nbytes & 7); b++)
            w |= (unsigned long long)data[(n << 3) + b] << (8 * b);
        s1 += w;
        s2 += (n + 1) * w;
    }
    warp_sum(s1, s2);
    __shared__ unsigned long long p1[32], p2[32];
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
            atomicAdd(out, s1);
            atomicAdd(out + 1, s2);
        }
    }
}
