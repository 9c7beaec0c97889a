// Transpose via a padded 32x33 shared tile with 32x32 = 1024-thread blocks, one element per thread.
#define TILE 32
extern "C" __global__ void transpose_smem_32x32(const float* __restrict__ in, float* __restrict__ out, int n) {
    __shared__ float tile[TILE][TILE + 1];
    int x = blockIdx.x * TILE + threadIdx.x;
    int y = blockIdx.y * TILE + threadIdx.y;
    if (x < n && y < n) {
        tile[threadIdx.y][threadIdx.x] = in[(size_t)y * n + x];
    }
    __syncthreads();
    x = blockIdx.y * TILE + threadIdx.x;  // column of out
    y = blockIdx.x * TILE + threadIdx.y;  // row of out
    if (x < n && y < n) {
        out[(size_t)y * n + x] = tile[threadIdx.x][threadIdx.y];
    }
}
