// Self-test of the emulator's fiber context switch (csrc/emu/src/context.cpp), built per target
// by tests/emulator/test_context_switch.py: two fibers ping-pong 1000 times doing floating-point
// and integer work that lives in callee-saved registers, and the results must equal the same work
// done without fibers. A third fiber, prepared while the thread flushes float32 subnormals (as the
// emulator's workers do for the Apple float mode), must compute with that mode. Exit status 0 and
// "ok" on success.
#include <cstdint>
#include <cstdio>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "context.h"

using bnb_emu::Context;

namespace {

Context main_ctx, ctx_a, ctx_b, ctx_fp;
constexpr int kRounds = 1000;
double acc_a = 0, acc_b = 0;
long steps = 0;

double step_a(double v, int i) { return v * 1.0000001 + i; }
double step_b(double v) { return v * 0.9999999 + 1.0; }

void fiber_a(void* arg) {
  double v = *static_cast<double*>(arg);
  for (int i = 0; i < kRounds; ++i) {
    v = step_a(v, i);
    acc_a += v;
    ++steps;
    bnb_emu::context_switch(&ctx_a, &ctx_b);
  }
  bnb_emu::context_switch(&ctx_a, &main_ctx);
}

void fiber_b(void* arg) {
  double v = *static_cast<double*>(arg);
  for (;;) {
    v = step_b(v);
    acc_b += v;
    ++steps;
    bnb_emu::context_switch(&ctx_b, &ctx_a);
  }
}

// Flush float32 subnormal inputs and results to zero on this thread (MXCSR FTZ|DAZ, FPCR.FZ).
void set_flush(bool on) {
#if defined(__x86_64__)
  const unsigned c = _mm_getcsr();
  _mm_setcsr(on ? (c | 0x8040u) : (c & ~0x8040u));
#elif defined(__aarch64__)
  uint64_t v;
  __asm__ volatile("mrs %0, fpcr" : "=r"(v));
  v = on ? (v | (uint64_t(1) << 24)) : (v & ~(uint64_t(1) << 24));
  __asm__ volatile("msr fpcr, %0" : : "r"(v));
#else
  (void)on;
#endif
}

volatile float subnormal = 1e-40f, one = 1.0f, small = 1e-20f;
float fp_results[2] = {-1.0f, -1.0f};

void fiber_fp(void*) {
  fp_results[0] = subnormal * one;  // a subnormal input
  fp_results[1] = small * small;    // a subnormal result
  bnb_emu::context_switch(&ctx_fp, &main_ctx);
}

}  // namespace

int main() {
  alignas(16) static char stack_a[1 << 16], stack_b[1 << 16];
  double start_a = 1.5, start_b = 2.5;
  // Values the compiler keeps in callee-saved registers across the switch.
  volatile double seed = 3.25;
  double kept = seed * 7.0;
  long kept_int = static_cast<long>(seed) * 12345;

  bnb_emu::context_init(&ctx_a, stack_a, sizeof stack_a, fiber_a, &start_a);
  bnb_emu::context_init(&ctx_b, stack_b, sizeof stack_b, fiber_b, &start_b);
  bnb_emu::context_switch(&main_ctx, &ctx_a);

  double want_a = 0, want_b = 0, va = start_a, vb = start_b;
  for (int i = 0; i < kRounds; ++i) {
    va = step_a(va, i);
    want_a += va;
    vb = step_b(vb);
    want_b += vb;
  }
  alignas(16) static char stack_fp[1 << 16];
  set_flush(true);
  bnb_emu::context_init(&ctx_fp, stack_fp, sizeof stack_fp, fiber_fp, nullptr);
  bnb_emu::context_switch(&main_ctx, &ctx_fp);
  set_flush(false);
  const float ieee = subnormal * one;  // back to IEEE on this thread
  const bool flushed = fp_results[0] == 0.0f && fp_results[1] == 0.0f && ieee == 1e-40f;

  const bool ok = flushed && acc_a == want_a && acc_b == want_b && steps == 2 * kRounds && kept == seed * 7.0 &&
                  kept_int == static_cast<long>(seed) * 12345;
  std::printf("%s a=%.17g/%.17g b=%.17g/%.17g steps=%ld flushed=%g,%g ieee=%g\n", ok ? "ok" : "MISMATCH", acc_a,
              want_a, acc_b, want_b, steps, fp_results[0], fp_results[1], ieee);
  return ok ? 0 : 1;
}
