// GEMV, one thread per row with the column loop unrolled by 4 into 4 independent accumulators (still uncoalesced).
extern "C" __global__ void gemv_thread_row_unroll4(const float* __restrict__ A, const float* __restrict__ x,
                                                   float* __restrict__ y, int M, int N) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < M) {
        const float* a = A + (size_t)row * N;
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        int j = 0;
        for (; j + 3 < N; j += 4) {
            s0 += a[j] * x[j];
            s1 += a[j + 1] * x[j + 1];
            s2 += a[j + 2] * x[j + 2];
            s3 += a[j + 3] * x[j + 3];
        }
        for (; j < N; ++j) {
            s0 += a[j] * x[j];
        }
        y[row] = (s0 + s1) + (s2 + s3);
    }
}
