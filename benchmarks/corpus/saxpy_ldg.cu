// SAXPY, one element per thread, __restrict__ pointers and explicit read-only __ldg loads.
extern "C" __global__ void saxpy_ldg(const float* __restrict__ x, const float* __restrict__ y,
                                     float* __restrict__ out, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = a * __ldg(x + i) + __ldg(y + i);
    }
}
