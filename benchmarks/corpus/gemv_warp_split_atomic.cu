// GEMV, 2D grid: each warp sums a 1024-column slice of one row and atomicAdds into y (needs y zeroed first).
#define SLICE 1024
extern "C" __global__ void gemv_warp_split_atomic(const float* __restrict__ A, const float* __restrict__ x,
                                                  float* y, int M, int N) {
    int row = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= M) return;  // whole warp exits together
    const float* a = A + (size_t)row * N;
    int start = blockIdx.x * SLICE;
    int end = min(start + SLICE, N);
    float sum = 0.0f;
    for (int j = start + lane; j < end; j += 32) {
        sum += a[j] * x[j];
    }
    for (int off = 16; off > 0; off >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, off);
    }
    if (lane == 0) {
        atomicAdd(&y[row], sum);
    }
}
