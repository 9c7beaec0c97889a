// SAXPY, one element per thread: out[i] = a * x[i] + y[i].
extern "C" __global__ void saxpy_naive(const float* x, const float* y, float* out, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = a * x[i] + y[i];
    }
}
