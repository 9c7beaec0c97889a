// Row-wise softmax: one warp per row, three coalesced passes over the row with __shfl_xor_sync all-reduces
// for the max and the sum. Block a multiple of 32.
extern "C" __global__ void softmax_warp_row(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (r >= rows) {
        return;  // whole warps leave together
    }
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;
    float m = -INFINITY;
    for (int c = lane; c < cols; c += 32) {
        m = fmaxf(m, xr[c]);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    float s = 0.0f;
    for (int c = lane; c < cols; c += 32) {
        s += expf(xr[c] - m);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, offset);
    }
    float inv = 1.0f / s;
    for (int c = lane; c < cols; c += 32) {
        yr[c] = expf(xr[c] - m) * inv;
    }
}
