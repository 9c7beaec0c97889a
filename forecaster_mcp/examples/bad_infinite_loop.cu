// BAD: never terminates. Spins on a flag in device memory that nobody sets (volatile, so the loop cannot be
// optimised away). Expected result: status "timeout", charged the whole max_seconds, worker killed.
extern "C" __global__ void spin_forever(const float* __restrict__ a, const float* __restrict__ b,
                                        float* __restrict__ c, int n) {
    volatile int* flag = reinterpret_cast<volatile int*>(c);
    while (flag[0] != 0x7fbadbad) {
    }
}
