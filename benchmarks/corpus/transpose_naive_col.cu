// Transpose, one element per thread: strided reads down a column of in, coalesced writes to out.
extern "C" __global__ void transpose_naive_col(const float* __restrict__ in, float* __restrict__ out, int n) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;  // column of out
    int y = blockIdx.y * blockDim.y + threadIdx.y;  // row of out
    if (x < n && y < n) {
        out[(size_t)y * n + x] = in[(size_t)x * n + y];
    }
}
