// Row-wise softmax: one thread per row, three sequential passes over the row (max, sum of exp, normalise);
// neighbouring threads read addresses a whole row apart (uncoalesced).
extern "C" __global__ void softmax_thread_row(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) {
        return;
    }
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;
    float m = -INFINITY;
    for (int c = 0; c < cols; ++c) {
        m = fmaxf(m, xr[c]);
    }
    float s = 0.0f;
    for (int c = 0; c < cols; ++c) {
        s += expf(xr[c] - m);
    }
    float inv = 1.0f / s;
    for (int c = 0; c < cols; ++c) {
        yr[c] = expf(xr[c] - m) * inv;
    }
}
