// SAXPY, 4 consecutive elements per thread with scalar accesses (warp accesses are 16-byte strided).
extern "C" __global__ void saxpy_4contig(const float* __restrict__ x, const float* __restrict__ y,
                                         float* __restrict__ out, float a, int n) {
    int base = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int i = base + k;
        if (i < n) {
            out[i] = a * x[i] + y[i];
        }
    }
}
