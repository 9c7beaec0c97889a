// SGEMM 2D blocktiling (128x128, BK=8, 8x8 per thread) with float4 global loads, A tile stored transposed
// in shared memory and float4 reads of both tiles; scalar fallback when N % 4 != 0 or at the edges.
#define BM 128
#define BN 128
#define BK 8
#define TM 8
#define TN 8
extern "C" __global__ void __launch_bounds__(256) sgemm_blocktile2d_vec4(const float* __restrict__ A,
                                                                         const float* __restrict__ B,
                                                                         float* __restrict__ C, int N) {
    __shared__ __align__(16) float As[BK * BM];  // transposed: As[k * BM + m]
    __shared__ __align__(16) float Bs[BK * BN];
    const int tid = threadIdx.x;
    const int rowBase = blockIdx.y * BM;
    const int colBase = blockIdx.x * BN;
    const int threadRow = tid / (BN / TN);
    const int threadCol = tid % (BN / TN);
    const bool vec = (N % 4) == 0;
    const int aRow = tid / (BK / 4), aCol = (tid % (BK / 4)) * 4;  // 128 rows x 2 float4
    const int bRow = tid / (BN / 4), bCol = (tid % (BN / 4)) * 4;  // 8 rows x 32 float4
    float acc[TM][TN] = {{0.0f}};
    float regM[TM], regN[TN];
    for (int k0 = 0; k0 < N; k0 += BK) {
        {
            int gr = rowBase + aRow, gk = k0 + aCol;
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (gr < N) {
                if (vec && gk + 3 < N) {
                    a = *reinterpret_cast<const float4*>(&A[gr * N + gk]);
                } else {
                    if (gk < N) a.x = A[gr * N + gk];
                    if (gk + 1 < N) a.y = A[gr * N + gk + 1];
                    if (gk + 2 < N) a.z = A[gr * N + gk + 2];
                    if (gk + 3 < N) a.w = A[gr * N + gk + 3];
                }
            }
            As[(aCol + 0) * BM + aRow] = a.x;
            As[(aCol + 1) * BM + aRow] = a.y;
            As[(aCol + 2) * BM + aRow] = a.z;
            As[(aCol + 3) * BM + aRow] = a.w;
        }
        {
            int gk = k0 + bRow, gc = colBase + bCol;
            float4 b = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (gk < N) {
                if (vec && gc + 3 < N) {
                    b = *reinterpret_cast<const float4*>(&B[gk * N + gc]);
                } else {
                    if (gc < N) b.x = B[gk * N + gc];
                    if (gc + 1 < N) b.y = B[gk * N + gc + 1];
                    if (gc + 2 < N) b.z = B[gk * N + gc + 2];
                    if (gc + 3 < N) b.w = B[gk * N + gc + 3];
                }
            }
            *reinterpret_cast<float4*>(&Bs[bRow * BN + bCol]) = b;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; ++k) {
#pragma unroll
            for (int i = 0; i < TM; i += 4) {
                float4 m = *reinterpret_cast<const float4*>(&As[k * BM + threadRow * TM + i]);
                regM[i] = m.x; regM[i + 1] = m.y; regM[i + 2] = m.z; regM[i + 3] = m.w;
            }
#pragma unroll
            for (int j = 0; j < TN; j += 4) {
                float4 n = *reinterpret_cast<const float4*>(&Bs[k * BN + threadCol * TN + j]);
                regN[j] = n.x; regN[j + 1] = n.y; regN[j + 2] = n.z; regN[j + 3] = n.w;
            }
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
        if (row >= N) continue;
#pragma unroll
        for (int j = 0; j < TN; j += 4) {
            int col = colBase + threadCol * TN + j;
            if (vec && col + 3 < N) {
                *reinterpret_cast<float4*>(&C[row * N + col]) =
                    make_float4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3]);
            } else {
                for (int q = 0; q < 4; ++q)
                    if (col + q < N) C[row * N + col + q] = acc[i][j + q];
            }
        }
    }
}
