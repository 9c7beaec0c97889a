// 64-bin histogram: one element per thread, one atomicAdd straight into the global histogram per element.
#define BINS 64

extern "C" __global__ void histogram_global_atomic(const int* __restrict__ data, int* __restrict__ hist, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        int v = data[i];
        if ((unsigned int)v < BINS) {
            atomicAdd(&hist[v], 1);
        }
    }
}
