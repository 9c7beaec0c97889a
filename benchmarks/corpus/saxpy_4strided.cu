// SAXPY, 4 elements per thread spaced blockDim.x apart (each of the 4 passes stays coalesced).
extern "C" __global__ void saxpy_4strided(const float* __restrict__ x, const float* __restrict__ y,
                                          float* __restrict__ out, float a, int n) {
    int base = blockIdx.x * blockDim.x * 4 + threadIdx.x;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int i = base + k * blockDim.x;
        if (i < n) {
            out[i] = a * x[i] + y[i];
        }
    }
}
