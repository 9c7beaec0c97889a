// Row-wise softmax: one warp per row, three passes reading and writing float4 (128-bit) vectors when cols is
// a multiple of 4 (rows stay 16-byte aligned); otherwise, and for any tail, scalar accesses. Block a multiple of 32.
extern "C" __global__ void softmax_warp_float4(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    int r = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (r >= rows) {
        return;  // whole warps leave together
    }
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;
    const float4* xr4 = reinterpret_cast<const float4*>(xr);
    float4* yr4 = reinterpret_cast<float4*>(yr);
    int c4 = ((cols & 3) == 0) ? (cols >> 2) : 0;  // vectors per row; the scalar loops cover [4*c4, cols)
    float m = -INFINITY;
    for (int c = lane; c < c4; c += 32) {
        float4 v = xr4[c];
        m = fmaxf(m, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
    }
    for (int c = 4 * c4 + lane; c < cols; c += 32) {
        m = fmaxf(m, xr[c]);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
    }
    float s = 0.0f;
    for (int c = lane; c < c4; c += 32) {
        float4 v = xr4[c];
        s += expf(v.x - m) + expf(v.y - m) + expf(v.z - m) + expf(v.w - m);
    }
    for (int c = 4 * c4 + lane; c < cols; c += 32) {
        s += expf(xr[c] - m);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, offset);
    }
    float inv = 1.0f / s;
    for (int c = lane; c < c4; c += 32) {
        float4 v = xr4[c];
        float4 o;
        o.x = expf(v.x - m) * inv;
        o.y = expf(v.y - m) * inv;
        o.z = expf(v.z - m) * inv;
        o.w = expf(v.w - m) * inv;
        yr4[c] = o;
    }
    for (int c = 4 * c4 + lane; c < cols; c += 32) {
        yr[c] = expf(xr[c] - m) * inv;
    }
}
