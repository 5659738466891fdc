// A test-only kernel (never part of csrc/kernels, which users load): it makes the GPU fail the command
// buffer it runs in, so that the acceptance run (scripts/mac_acceptance.sh, through
// tests/command_buffer_fault.py) sees first-use verification meet a command-buffer error.
//
// Thread 0 writes `far_elements` uints past the start of `out`: with 2^36 (256 GiB past a buffer of a
// few bytes) no GPU mapping is there, the GPU's address translation faults, and Metal ends the command
// buffer with an error (MTLCommandBufferErrorPageFault: "Caused GPU Address Fault Error"). The offset
// is a run-time argument, so the compiler cannot drop the write. Every other thread writes in bounds.
// (Checked under the emulator, which stops at the write with a memory fault: tests/test_verify.py.)
#include <metal_stdlib>
using namespace metal;

kernel void bnb_test_address_fault(device uint* out [[buffer(0)]],
                                   constant ulong& far_elements [[buffer(1)]],
                                   uint tid [[thread_position_in_grid]]) {
    if (tid == 0u) {
        out[far_elements] = 0xDEADu;
    } else {
        out[tid] = tid;
    }
}
