// Row-wise softmax: one 256-thread block per row, strided passes over the row and shared-memory tree
// reductions (sequential addressing) for the max and the sum. Block size must be 256.
#define BLOCK 256

extern "C" __global__ void softmax_block_row(const float* __restrict__ x, float* __restrict__ y, int rows, int cols) {
    __shared__ float red[BLOCK];
    int r = blockIdx.x;
    int tid = threadIdx.x;
    if (r >= rows) {
        return;  // whole block leaves together
    }
    const float* xr = x + (size_t)r * cols;
    float* yr = y + (size_t)r * cols;
    float m = -INFINITY;
    for (int c = tid; c < cols; c += BLOCK) {
        m = fmaxf(m, xr[c]);
    }
    red[tid] = m;
    __syncthreads();
    for (int stride = BLOCK / 2; stride > 0; stride >>= 1) {
        if (tid < stride) {
            red[tid] = fmaxf(red[tid], red[tid + stride]);
        }
        __syncthreads();
    }
    m = red[0];
    __syncthreads();  // everyone has read the max before red is reused
    float s = 0.0f;
    for (int c = tid; c < cols; c += BLOCK) {
        s += expf(xr[c] - m);
    }
    red[tid] = s;
    __syncthreads();
    for (int stride = BLOCK / 2; stride > 0; stride >>= 1) {
        if (tid < stride) {
            red[tid] += red[tid + stride];
        }
        __syncthreads();
    }
    float inv = 1.0f / red[0];
    for (int c = tid; c < cols; c += BLOCK) {
        yr[c] = expf(xr[c] - m) * inv;
    }
}
