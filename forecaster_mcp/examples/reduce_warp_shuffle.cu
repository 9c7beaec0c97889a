// Sum of x into out[0]: a grid-stride loop accumulates in registers, warps reduce with __shfl_down_sync,
// one partial per warp goes through shared memory, and one atomicAdd per block. Any grid; block a multiple
// of 32 up to 1024.
extern "C" __global__ void reduce_warp_shuffle(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float partial[32];
    float acc = 0.0f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        acc += x[i];
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        acc += __shfl_down_sync(0xffffffffu, acc, offset);
    }
    int lane = threadIdx.x % 32;
    int warp = threadIdx.x / 32;
    if (lane == 0) {
        partial[warp] = acc;
    }
    __syncthreads();
    if (warp == 0) {
        int warps = (blockDim.x + 31) / 32;
        acc = (lane < warps) ? partial[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset /= 2) {
            acc += __shfl_down_sync(0xffffffffu, acc, offset);
        }
        if (lane == 0) {
            atomicAdd(out, acc);
        }
    }
}
