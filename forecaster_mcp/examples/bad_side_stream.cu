// SUSPECT: the parent does nothing itself; the work runs in a child grid launched (dynamic parallelism)
// into a non-blocking device-side stream, the kernel-level version of "launch on a side stream so the
// timing events miss it". Child grids nest inside their parent (CUDA 12 CDP), so the end event waits for
// them, and the harness also compares events against host wall clock around a device-wide synchronize.
// Expected: status "ok" with a runtime that includes the child's work, and no events_disagree flag.
// Needs -rdc=true (the harness then device-links the device runtime).
__global__ void side_child(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                           int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        c[i] = a[i] + b[i];
    }
}

extern "C" __global__ void side_stream_parent(const float* __restrict__ a, const float* __restrict__ b,
                                              float* __restrict__ c, int n) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        cudaStream_t side;
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking);
        side_child<<<(n + 255) / 256, 256, 0, side>>>(a, b, c, n);
        cudaStreamDestroy(side);
    }
}
