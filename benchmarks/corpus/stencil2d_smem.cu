// 5-point Jacobi step staging a 32x8 tile plus a one-cell halo in shared memory; block (32, 8).
#define BX 32
#define BY 8
extern "C" __global__ void stencil2d_smem(const float* __restrict__ in, float* __restrict__ out, int H, int W) {
    __shared__ float tile[BY + 2][BX + 2];
    int tx = threadIdx.x, ty = threadIdx.y;
    int j = blockIdx.x * BX + tx;
    int i = blockIdx.y * BY + ty;
    bool inside = i < H && j < W;
    long idx = (long)i * W + j;
    tile[ty + 1][tx + 1] = inside ? in[idx] : 0.0f;
    if (tx == 0) tile[ty + 1][0] = (i < H && j > 0 && j - 1 < W) ? in[idx - 1] : 0.0f;
    if (tx == BX - 1) tile[ty + 1][BX + 1] = (i < H && j + 1 < W) ? in[idx + 1] : 0.0f;
    if (ty == 0) tile[0][tx + 1] = (i > 0 && i - 1 < H && j < W) ? in[idx - W] : 0.0f;
    if (ty == BY - 1) tile[BY + 1][tx + 1] = (i + 1 < H && j < W) ? in[idx + W] : 0.0f;
    __syncthreads();
    if (!inside) return;
    if (i == 0 || i == H - 1 || j == 0 || j == W - 1) {
        out[idx] = tile[ty + 1][tx + 1];
    } else {
        out[idx] = 0.2f * (tile[ty + 1][tx + 1] + tile[ty][tx + 1] + tile[ty + 2][tx + 1] + tile[ty + 1][tx] +
                           tile[ty + 1][tx + 2]);
    }
}
