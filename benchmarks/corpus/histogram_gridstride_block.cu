// 64-bin histogram: few blocks, grid-stride loop into one block-private shared-memory histogram, then one
// global atomic per bin per block.
#define BINS 64

extern "C" __global__ void histogram_gridstride_block(const int* __restrict__ data, int* __restrict__ hist, int n) {
    __shared__ int sh[BINS];
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) {
        sh[b] = 0;
    }
    __syncthreads();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
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
