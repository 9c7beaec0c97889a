// Sum of x into out[0]: few blocks, grid-stride loop accumulating in registers, warp shuffles, per-warp
// partials in shared memory, one atomicAdd per block. Block a multiple of 32, at most 1024.
extern "C" __global__ void rsum_gridstride_shfl(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float partial[32];
    float acc = 0.0f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        acc += x[i];
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        acc += __shfl_down_sync(0xffffffffu, acc, offset);
    }
    int lane = threadIdx.x & 31;
    int warp = threadIdx.x >> 5;
    if (lane == 0) {
        partial[warp] = acc;
    }
    __syncthreads();
    if (warp == 0) {
        int warps = (blockDim.x + 31) >> 5;
        acc = (lane < warps) ? partial[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset /= 2) {
            acc += __shfl_down_sync(0xffffffffu, acc, offset);
        }
        if (lane == 0) {
            atomicAdd(out, acc);
        }
    }
}
