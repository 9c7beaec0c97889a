// GEMV, one 256-thread block per row: strided partial sums, shared-memory tree reduction.
#define BLOCK 256
extern "C" __global__ void gemv_block_row(const float* __restrict__ A, const float* __restrict__ x,
                                          float* __restrict__ y, int M, int N) {
    __shared__ float partial[BLOCK];
    int row = blockIdx.x;
    int tid = threadIdx.x;
    float sum = 0.0f;
    if (row < M) {
        const float* a = A + (size_t)row * N;
        for (int j = tid; j < N; j += BLOCK) {
            sum += a[j] * x[j];
        }
    }
    partial[tid] = sum;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (tid < s) {
            partial[tid] += partial[tid + s];
        }
        __syncthreads();
    }
    if (tid == 0 && row < M) {
        y[row] = partial[0];
    }
}
