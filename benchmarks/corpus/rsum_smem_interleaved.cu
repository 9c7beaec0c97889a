// Sum of x into out[0]: shared-memory tree per block with interleaved addressing (divergent tid % (2*stride)),
// then one atomicAdd per block. One element per thread; block size must be 256.
#define BLOCK 256

extern "C" __global__ void rsum_smem_interleaved(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float s[BLOCK];
    unsigned int tid = threadIdx.x;
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    s[tid] = (i < (unsigned int)n) ? x[i] : 0.0f;
    __syncthreads();
    for (unsigned int stride = 1; stride < BLOCK; stride *= 2) {
        if (tid % (2 * stride) == 0) {
            s[tid] += s[tid + stride];
        }
        __syncthreads();
    }
    if (tid == 0) {
        atomicAdd(out, s[0]);
    }
}
