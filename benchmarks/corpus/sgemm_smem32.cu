// SGEMM with 32x32 shared-memory tiles of A and B; block (32, 32), one output per thread.
#define TILE 32
extern "C" __global__ void sgemm_smem32(const float* __restrict__ A, const float* __restrict__ B,
                                        float* __restrict__ C, int N) {
    __shared__ float As[TILE][TILE];
    __shared__ float Bs[TILE][TILE];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int t = 0; t < N; t += TILE) {
        int ak = t + threadIdx.x;
        int bk = t + threadIdx.y;
        As[threadIdx.y][threadIdx.x] = (row < N && ak < N) ? A[row * N + ak] : 0.0f;
        Bs[threadIdx.y][threadIdx.x] = (bk < N && col < N) ? B[bk * N + col] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE; ++k) {
            acc += As[threadIdx.y][k] * Bs[k][threadIdx.x];
        }
        __syncthreads();
    }
    if (row < N && col < N) {
        C[row * N + col] = acc;
    }
}
