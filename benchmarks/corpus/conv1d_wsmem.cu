// 1D convolution (33 taps) with the weights staged in shared memory per block; input still read from global.
#define R 16
#define TAPS (2 * R + 1)
extern "C" __global__ void conv1d_wsmem(const float* __restrict__ in, const float* __restrict__ w,
                                        float* __restrict__ out, int N) {
    __shared__ float ws[TAPS];
    if (threadIdx.x < TAPS) ws[threadIdx.x] = w[threadIdx.x];
    __syncthreads();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < TAPS; ++k) {
        int x = i + k - R;
        if (x >= 0 && x < N) acc += ws[k] * in[x];
    }
    out[i] = acc;
}
