// GEMV, one thread per row with x staged through shared memory in blockDim-sized chunks (A reads still uncoalesced).
#define CHUNK 256
extern "C" __global__ void gemv_thread_row_smemx(const float* __restrict__ A, const float* __restrict__ x,
                                                 float* __restrict__ y, int M, int N) {
    __shared__ float xs[CHUNK];
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    const float* a = A + (size_t)row * N;
    float sum = 0.0f;
    for (int base = 0; base < N; base += CHUNK) {
        for (int k = threadIdx.x; k < CHUNK; k += blockDim.x) {
            xs[k] = (base + k < N) ? x[base + k] : 0.0f;
        }
        __syncthreads();
        if (row < M) {
            int len = min(CHUNK, N - base);
            for (int k = 0; k < len; ++k) {
                sum += a[base + k] * xs[k];
            }
        }
        __syncthreads();
    }
    if (row < M) {
        y[row] = sum;
    }
}
