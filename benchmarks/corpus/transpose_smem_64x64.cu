// Transpose via a padded 64x65 shared tile, 64x8 threads with 8 rows each (bigger tile, more work per thread).
#define TILE 64
#define ROWS 8
extern "C" __global__ void transpose_smem_64x64(const float* __restrict__ in, float* __restrict__ out, int n) {
    __shared__ float tile[TILE][TILE + 1];
    int x = blockIdx.x * TILE + threadIdx.x;
    int y = blockIdx.y * TILE + threadIdx.y;
#pragma unroll
    for (int j = 0; j < TILE; j += ROWS) {
        if (x < n && y + j < n) {
            tile[threadIdx.y + j][threadIdx.x] = in[(size_t)(y + j) * n + x];
        }
    }
    __syncthreads();
    x = blockIdx.y * TILE + threadIdx.x;  // column of out
    y = blockIdx.x * TILE + threadIdx.y;  // row of out
#pragma unroll
    for (int j = 0; j < TILE; j += ROWS) {
        if (x < n && y + j < n) {
            out[(size_t)(y + j) * n + x] = tile[threadIdx.x][threadIdx.y + j];
        }
    }
}
