// 1D convolution (33 taps): block of 256 stages its input tile plus a 16-element halo each side and the
// weights in shared memory (zeros outside the signal), then computes one output per thread from smem.
#define R 16
#define TAPS (2 * R + 1)
#define BS 256
extern "C" __global__ void __launch_bounds__(BS) conv1d_tile(const float* __restrict__ in,
                                                             const float* __restrict__ w,
                                                             float* __restrict__ out, int N) {
    __shared__ float ws[TAPS];
    __shared__ float tile[BS + 2 * R];
    int base = blockIdx.x * BS - R;
    for (int t = threadIdx.x; t < BS + 2 * R; t += BS) {
        int x = base + t;
        tile[t] = (x >= 0 && x < N) ? in[x] : 0.0f;
    }
    if (threadIdx.x < TAPS) ws[threadIdx.x] = w[threadIdx.x];
    __syncthreads();
    int i = blockIdx.x * BS + threadIdx.x;
    if (i >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < TAPS; ++k) acc += ws[k] * tile[threadIdx.x + k];
    out[i] = acc;
}
