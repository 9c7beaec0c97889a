// SGEMM 2D blocktiling: 128x128 C tile per block, BK=8, each of 256 threads computes an 8x8 register tile.
#define BM 128
#define BN 128
#define BK 8
#define TM 8
#define TN 8
extern "C" __global__ void __launch_bounds__(256) sgemm_blocktile2d(const float* __restrict__ A,
                                                                    const float* __restrict__ B,
                                                                    float* __restrict__ C, int N) {
    __shared__ float As[BM * BK];
    __shared__ float Bs[BK * BN];
    const int tid = threadIdx.x;
    const int rowBase = blockIdx.y * BM;
    const int colBase = blockIdx.x * BN;
    const int threadRow = tid / (BN / TN);  // 0..15
    const int threadCol = tid % (BN / TN);  // 0..15
    const int aRow = tid / BK, aCol = tid % BK;  // rows aRow + 32*i of the 128 x 8 A tile
    const int bRow = tid / BN, bCol = tid % BN;  // rows bRow + 2*i of the 8 x 128 B tile
    float acc[TM][TN] = {{0.0f}};
    float regM[TM], regN[TN];
    for (int k0 = 0; k0 < N; k0 += BK) {
#pragma unroll
        for (int off = 0; off < BM; off += 256 / BK) {
            int gr = rowBase + aRow + off, gk = k0 + aCol;
            As[(aRow + off) * BK + aCol] = (gr < N && gk < N) ? A[gr * N + gk] : 0.0f;
        }
#pragma unroll
        for (int off = 0; off < BK; off += 256 / BN) {
            int gk = k0 + bRow + off, gc = colBase + bCol;
            Bs[(bRow + off) * BN + bCol] = (gk < N && gc < N) ? B[gk * N + gc] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
#pragma unroll
            for (int i = 0; i < TM; ++i) regM[i] = As[(threadRow * TM + i) * BK + k];
#pragma unroll
            for (int j = 0; j < TN; ++j) regN[j] = Bs[k * BN + threadCol * TN + j];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] += regM[i] * regN[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        int row = rowBase + threadRow * TM + i;
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            int col = colBase + threadCol * TN + j;
            if (row < N && col < N) C[row * N + col] = acc[i][j];
        }
    }
}
