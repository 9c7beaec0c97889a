// Sum of x into out[0]: like the grid-stride shuffle kernel but the loop reads float4 (128-bit) vectors;
// the n % 4 tail is read as scalars. One atomicAdd per block. Block a multiple of 32, at most 1024.
extern "C" __global__ void rsum_gridstride_float4(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float partial[32];
    const float4* x4 = reinterpret_cast<const float4*>(x);
    int n4 = n >> 2;
    int tid = blockIdx.x * blockDim.x + threadIdx.x;
    int stride = gridDim.x * blockDim.x;
    float acc = 0.0f;
    for (int i = tid; i < n4; i += stride) {
        float4 v = x4[i];
        acc += (v.x + v.y) + (v.z + v.w);
    }
    for (int i = n4 * 4 + tid; i < n; i += stride) {
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
