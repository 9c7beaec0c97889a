// Vector add, four floats per thread through 128-bit loads and stores (float4); the tail past the last
// multiple of four is handled by the first threads. Launch with ceil(n / 4 / block) blocks.
extern "C" __global__ void vector_add_float4(const float* __restrict__ a, const float* __restrict__ b,
                                             float* __restrict__ c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int n4 = n / 4;
    if (i < n4) {
        float4 x = reinterpret_cast<const float4*>(a)[i];
        float4 y = reinterpret_cast<const float4*>(b)[i];
        reinterpret_cast<float4*>(c)[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
    }
    int tail = 4 * n4 + i;
    if (i < n - 4 * n4) {
        c[tail] = a[tail] + b[tail];
    }
}
