// SAXPY with float4 (128-bit) loads/stores: each thread handles 4 consecutive elements, scalar tail.
extern "C" __global__ void saxpy_float4(const float* __restrict__ x, const float* __restrict__ y,
                                        float* __restrict__ out, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int base = i * 4;
    if (base + 3 < n) {
        float4 xv = reinterpret_cast<const float4*>(x)[i];
        float4 yv = reinterpret_cast<const float4*>(y)[i];
        float4 r;
        r.x = a * xv.x + yv.x;
        r.y = a * xv.y + yv.y;
        r.z = a * xv.z + yv.z;
        r.w = a * xv.w + yv.w;
        reinterpret_cast<float4*>(out)[i] = r;
    } else {
        for (int k = base; k < n; ++k) {
            out[k] = a * x[k] + y[k];
        }
    }
}
