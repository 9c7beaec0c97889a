// 64-bin histogram: each thread loads 4 elements with one int4 (128-bit) load into a block-private
// shared-memory histogram, then merges it into global memory. The n % 4 tail is read as scalars.
#define BINS 64

extern "C" __global__ void histogram_int4_block(const int* __restrict__ data, int* __restrict__ hist, int n) {
    __shared__ int sh[BINS];
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) {
        sh[b] = 0;
    }
    __syncthreads();
    int n4 = n >> 2;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n4) {
        int4 v = reinterpret_cast<const int4*>(data)[i];
        if ((unsigned int)v.x < BINS) atomicAdd(&sh[v.x], 1);
        if ((unsigned int)v.y < BINS) atomicAdd(&sh[v.y], 1);
        if ((unsigned int)v.z < BINS) atomicAdd(&sh[v.z], 1);
        if ((unsigned int)v.w < BINS) atomicAdd(&sh[v.w], 1);
    }
    int t = 4 * n4 + i;  // at most 3 tail elements, taken by the first threads of the grid
    if (t < n) {
        int v = data[t];
        if ((unsigned int)v < BINS) atomicAdd(&sh[v], 1);
    }
    __syncthreads();
    for (int b = threadIdx.x; b < BINS; b += blockDim.x) {
        if (sh[b] != 0) {
            atomicAdd(&hist[b], sh[b]);
        }
    }
}
