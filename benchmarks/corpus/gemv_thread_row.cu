// GEMV y = A x (A row-major MxN), one thread per row: adjacent threads read addresses N floats apart (uncoalesced).
extern "C" __global__ void gemv_thread_row(const float* A, const float* x, float* y, int M, int N) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < M) {
        const float* a = A + (size_t)row * N;
        float sum = 0.0f;
        for (int j = 0; j < N; ++j) {
            sum += a[j] * x[j];
        }
        y[row] = sum;
    }
}
