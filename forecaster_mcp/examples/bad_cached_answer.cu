// BAD: computes the answer on its first launch only and returns at once on every later launch, leaving
// whatever is in c. The first correctness check passes and timing sees a nearly empty kernel; the check on
// a fresh input set after timing catches it. Expected: status "wrong_output" (and likely below_physical_floor).
// Launches are told apart race-free: every block takes a ticket, and ticket / gridDim.x is the launch index.
__device__ unsigned int blocks_started = 0;

extern "C" __global__ void vector_add_cached(const float* __restrict__ a, const float* __restrict__ b,
                                             float* __restrict__ c, int n) {
    __shared__ unsigned int launch;
    if (threadIdx.x == 0) {
        launch = atomicAdd(&blocks_started, 1u) / gridDim.x;
    }
    __syncthreads();
    if (launch > 0) {
        return;
    }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        c[i] = a[i] + b[i];
    }
}
