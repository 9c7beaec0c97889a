// Sum of x into out[0]: a shared-memory tree per block with interleaved addressing (the divergent modulo
// pattern of the classic first reduction kernel), then one atomicAdd per block. Block size must be 256.
#define BLOCK 256

extern "C" __global__ void reduce_naive(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float s[BLOCK];
    unsigned int tid = threadIdx.x;
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    s[tid] = (i < n) ? x[i] : 0.0f;
    __syncthreads();
    for (unsigned int stride = 1; stride < blockDim.x; stride *= 2) {
        if (tid % (2 * stride) == 0) {
            s[tid] += s[tid + stride];
        }
        __syncthreads();
    }
    if (tid == 0) {
        atomicAdd(out, s[0]);
    }
}
