// BAD: writes through a wild pointer, an illegal address fault. Expected: status "launch_error"; the
// faulted context is discarded and the next request gets a fresh worker.
extern "C" __global__ void write_wild_pointer(const float* __restrict__ a, const float* __restrict__ b,
                                              float* __restrict__ c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    float* wild = reinterpret_cast<float*>(0x10);
    wild[i] = a[0] + b[0];
    c[0] = 0.0f;
}
