// Naive 1D convolution (33 taps, R = 16, zero padding): every tap reads in[] and w[] from global memory.
#define R 16
extern "C" __global__ void conv1d_naive(const float* in, const float* w, float* out, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N) return;
    float acc = 0.0f;
    for (int k = 0; k < 2 * R + 1; ++k) {
        int x = i + k - R;
        if (x >= 0 && x < N) acc += w[k] * in[x];
    }
    out[i] = acc;
}
