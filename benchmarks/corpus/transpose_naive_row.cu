// Transpose, one element per thread: coalesced reads along a row of in, strided writes to out.
extern "C" __global__ void transpose_naive_row(const float* in, float* out, int n) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;  // column of in
    int y = blockIdx.y * blockDim.y + threadIdx.y;  // row of in
    if (x < n && y < n) {
        out[(size_t)x * n + y] = in[(size_t)y * n + x];
    }
}
