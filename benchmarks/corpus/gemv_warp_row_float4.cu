// GEMV, one warp per row with float4 loads of A and x (when N % 4 == 0), warp-shuffle reduction.
extern "C" __global__ void gemv_warp_row_float4(const float* __restrict__ A, const float* __restrict__ x,
                                                float* __restrict__ y, int M, int N) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int lane = threadIdx.x % 32;
    if (warp >= M) return;  // whole warp exits together
    const float* a = A + (size_t)warp * N;
    float sum = 0.0f;
    if ((N & 3) == 0) {  // rows are 16-byte aligned only when N is a multiple of 4
        const float4* a4 = reinterpret_cast<const float4*>(a);
        const float4* x4 = reinterpret_cast<const float4*>(x);
        int n4 = N / 4;
        for (int j = lane; j < n4; j += 32) {
            float4 av = a4[j];
            float4 xv = x4[j];
            sum += av.x * xv.x + av.y * xv.y + av.z * xv.z + av.w * xv.w;
        }
    } else {
        for (int j = lane; j < N; j += 32) {
            sum += a[j] * x[j];
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        sum += __shfl_down_sync(0xffffffffu, sum, off);
    }
    if (lane == 0) {
        y[warp] = sum;
    }
}
