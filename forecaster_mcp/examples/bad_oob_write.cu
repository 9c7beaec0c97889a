// BAD: an off-by-32 bound writes 32 floats past the end of c. The allocator would not notice; the guard
// region after each buffer does. Expected: status "out_of_bounds_write". Launch enough threads for n + 32.
extern "C" __global__ void vector_add_oob(const float* __restrict__ a, const float* __restrict__ b,
                                          float* __restrict__ c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        c[i] = a[i] + b[i];
    } else if (i < n + 32) {
        c[i] = 1.0f;
    }
}
