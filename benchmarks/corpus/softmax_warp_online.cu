// Row-wise softmax: one warp per row, online softmax (running max and rescaled sum in a single read pass,
// two expf per element), merged across lanes with shuffles, then one normalising pass. Block a multiple of 32.
extern "C" __global__ void softmax_warp_online(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (r >= rows) {
        return;  // whole warps leave together
    }
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;
    float m = -INFINITY;
    float s = 0.0f;
    for (int c = lane; c < cols; c += 32) {
        float v = xr[c];
        float mn = fmaxf(m, v);
        s = s * expf(m - mn) + expf(v - mn);  // expf(-inf) = 0 on the first element
        m = mn;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, offset);
        float s2 = __shfl_xor_sync(0xffffffffu, s, offset);
        float mn = fmaxf(m, m2);
        float a = (m == -INFINITY) ? 0.0f : s * expf(m - mn);    // lanes without elements add nothing
        float b = (m2 == -INFINITY) ? 0.0f : s2 * expf(m2 - mn);
        s = a + b;
        m = mn;
    }
    float inv = 1.0f / s;
    for (int c = lane; c < cols; c += 32) {
        yr[c] = expf(xr[c] - m) * inv;
    }
}
