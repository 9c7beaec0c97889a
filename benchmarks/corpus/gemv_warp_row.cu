// GEMV, one warp per row: lanes stride across the row (coalesced), warp-shuffle reduction.
extern "C" __global__ void gemv_warp_row(const float* __restrict__ A, const float* __restrict__ x,
                                         float* __restrict__ y, int M, int N) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (warp >= M) return;  // whole warp exits together
    const float* a = A + (size_t)warp * N;
    float sum = 0.0f;
    for (int j = lane; j < N; j += 32) {
        sum += a[j] * x[j];
    }
    for (int off = 16; off > 0; off >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, off);
    }
    if (lane == 0) {
        y[warp] = sum;
    }
}
