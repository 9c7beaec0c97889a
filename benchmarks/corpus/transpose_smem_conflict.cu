// Transpose via a 32x32 shared-memory tile (32x8 threads, 4 rows each) WITHOUT padding: 32-way bank conflicts on the column read.
#define TILE 32
#define ROWS 8
extern "C" __global__ void transpose_smem_conflict(const float* __restrict__ in, float* __restrict__ out, int n) {
    __shared__ float tile[TILE][TILE];
    int x = blockIdx.x * TILE + threadIdx.x;
    int y = blockIdx.y * TILE + threadIdx.y;
    for (int j = 0; j < TILE; j += ROWS) {
        if (x < n && y + j < n) {
            tile[threadIdx.y + j][threadIdx.x] = in[(size_t)(y + j) * n + x];
        }
    }
    __syncthreads();
    x = blockIdx.y * TILE + threadIdx.x;  // column of out
    y = blockIdx.x * TILE + threadIdx.y;  // row of out
    for (int j = 0; j < TILE; j += ROWS) {
        if (x < n && y + j < n) {
            out[(size_t)(y + j) * n + x] = tile[threadIdx.x][threadIdx.y + j];
        }
    }
}
