// 64-bin histogram: one element per thread, shared-memory atomics into a block-private histogram, then each
// block merges its non-zero bins into global memory (64 global atomics per block of 256 elements).
#define BINS 64

extern "C" __global__ void histogram_smem_block(const int* __restrict__ data, int* __restrict__ hist, int n) {
    __shared__ int sh[BINS];
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) {
        sh[b] = 0;
    }
    __syncthreads();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        int v = data[i];
        if ((unsigned int)v < BINS) {
            atomicAdd(&sh[v], 1);
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) {
        if (sh[b] != 0) {
            atomicAdd(&hist[b], sh[b]);
        }
    }
}
