// SGEMM 1D blocktiling: 64x64 C tile per block, BK=8, each of 512 threads computes 8 outputs in a column.
#define BM 64
#define BN 64
#define BK 8
#define TM 8
extern "C" __global__ void __launch_bounds__(512) sgemm_blocktile1d(const float* __restrict__ A,
                                                                    const float* __restrict__ B,
                                                                    float* __restrict__ C, int N) {
    __shared__ float As[BM * BK];
    __shared__ float Bs[BK * BN];
    const int tid = threadIdx.x;
    const int rowBase = blockIdx.y * BM;
    const int colBase = blockIdx.x * BN;
    const int threadCol = tid % BN;
    const int threadRow = tid / BN;  // 0..7, owns rows threadRow*TM .. +TM-1
    const int aRow = tid / BK, aCol = tid % BK;  // 64 x 8 tile of A, one element per thread
    const int bRow = tid / BN, bCol = tid % BN;  // 8 x 64 tile of B, one element per thread
    float acc[TM] = {0.0f};
    for (int k0 = 0; k0 < N; k0 += BK) {
        int gr = rowBase + aRow, gk = k0 + aCol;
        As[aRow * BK + aCol] = (gr < N && gk < N) ? A[gr * N + gk] : 0.0f;
        int gkb = k0 + bRow, gc = colBase + bCol;
        Bs[bRow * BN + bCol] = (gkb < N && gc < N) ? B[gkb * N + gc] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float b = Bs[k * BN + threadCol];
#pragma unroll
            for (int m = 0; m < TM; ++m) {
                acc[m] += As[(threadRow * TM + m) * BK + k] * b;
            }
        }
        __syncthreads();
    }
    int col = colBase + threadCol;
#pragma unroll
    for (int m = 0; m < TM; ++m) {
        int row = rowBase + threadRow * TM + m;
        if (row < N && col < N) {
            C[row * N + col] = acc[m];
        }
    }
}
