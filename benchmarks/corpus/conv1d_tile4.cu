// 1D convolution (33 taps): shared tile of 1024 inputs + halo per block of 256, each thread computes 4
// outputs (strided by 256 so smem reads stay conflict-free) and reuses each weight from a register 4 times.
#define R 16
#define TAPS (2 * R + 1)
#define BS 256
#define OPT 4
#define TILE (BS * OPT)
extern "C" __global__ void __launch_bounds__(BS) conv1d_tile4(const float* __restrict__ in,
                                                              const float* __restrict__ w,
                                                              float* __restrict__ out, int N) {
    __shared__ float ws[TAPS];
    __shared__ float tile[TILE + 2 * R];
    int base = blockIdx.x * TILE - R;
    for (int t = threadIdx.x; t < TILE + 2 * R; t += BS) {
        int x = base + t;
        tile[t] = (x >= 0 && x < N) ? in[x] : 0.0f;
    }
    if (threadIdx.x < TAPS) ws[threadIdx.x] = w[threadIdx.x];
    __syncthreads();
    float acc[OPT] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k = 0; k < TAPS; ++k) {
        float wk = ws[k];
#pragma unroll
        for (int o = 0; o < OPT; ++o) acc[o] += wk * tile[o * BS + threadIdx.x + k];
    }
#pragma unroll
    for (int o = 0; o < OPT; ++o) {
        int i = blockIdx.x * TILE + o * BS + threadIdx.x;
        if (i < N) out[i] = acc[o];
    }
}
