// Naive 5-point Jacobi step: one thread per cell, 2D blocks (launch shape set per kernel), boundary copied.
extern "C" __global__ void stencil2d_naive(const float* in, float* out, int H, int W) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int i = blockIdx.y * blockDim.y + threadIdx.y;
    if (i >= H || j >= W) return;
    long idx = (long)i * W + j;
    if (i == 0 || i == H - 1 || j == 0 || j == W - 1) {
        out[idx] = in[idx];
    } else {
        out[idx] = 0.2f * (in[idx] + in[idx - W] + in[idx + W] + in[idx - 1] + in[idx + 1]);
    }
}
