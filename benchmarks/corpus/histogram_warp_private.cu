// 64-bin histogram: grid-stride loop, one private histogram per warp in shared memory (less shared-atomic
// contention), warps summed per bin and merged with one global atomic per bin per block. Block <= 1024.
#define BINS 64

extern "C" __global__ void histogram_warp_private(const int* __restrict__ data, int* __restrict__ hist, int n) {
    __shared__ int sh[32 * BINS];
    int warps = (blockDim.x + 31) >> 5;
    int warp = threadIdx.x >> 5;
    for (int j = threadIdx.x; j < warps * BINS; j += blockDim.x) {
        sh[j] = 0;
    }
    __syncthreads();
    int* mine = sh + warp * BINS;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int v = data[i];
        if ((unsigned int)v < BINS) {
            atomicAdd(&mine[v], 1);
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) {
        int total = 0;
        for (int w = 0; w < warps; ++w) {
            total += sh[w * BINS + b];
        }
        if (total != 0) {
            atomicAdd(&hist[b], total);
        }
    }
}
