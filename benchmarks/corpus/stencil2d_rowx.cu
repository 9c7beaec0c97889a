// 5-point Jacobi step with 1D blocks of 256 where consecutive threads walk down a column (row index from x):
// neighbouring threads touch addresses W floats apart, so every load and store is uncoalesced.
extern "C" __global__ void stencil2d_rowx(const float* in, float* out, int H, int W) {
    long t = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long)H * W) return;
    int i = (int)(t % H);
    int j = (int)(t / H);
    long idx = (long)i * W + j;
    if (i == 0 || i == H - 1 || j == 0 || j == W - 1) {
        out[idx] = in[idx];
    } else {
        out[idx] = 0.2f * (in[idx] + in[idx - W] + in[idx + W] + in[idx - 1] + in[idx + 1]);
    }
}
