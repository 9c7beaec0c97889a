// 1D convolution (33 taps): shared input tile with halo, all 33 weights copied into registers and the
// tap loop fully unrolled with #pragma unroll.
#define R 16
#define TAPS (2 * R + 1)
#define BS 256
extern "C" __global__ void __launch_bounds__(BS) conv1d_unroll(const float* __restrict__ in,
                                                               const float* __restrict__ w,
                                                               float* __restrict__ out, int N) {
    __shared__ float tile[BS + 2 * R];
    int base = blockIdx.x * BS - R;
    for (int t = threadIdx.x; t < BS + 2 * R; t += BS) {
        int x = base + t;
        tile[t] = (x >= 0 && x < N) ? in[x] : 0.0f;
    }
    float wr[TAPS];
#pragma unroll
    for (int k = 0; k < TAPS; ++k) wr[k] = __ldg(&w[k]);
    __syncthreads();
    int i = blockIdx.x * BS + threadIdx.x;
    if (i >= N) return;
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < TAPS; ++k) acc += wr[k] * tile[threadIdx.x + k];
    out[i] = acc;
}
