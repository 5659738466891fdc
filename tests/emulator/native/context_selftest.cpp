// Self-test of the emulator's fiber context switch (csrc/emu/src/context.cpp), built per target
// by tests/emulator/test_context_switch.py: two fibers ping-pong 1000 times doing floating-point
// and integer work that lives in callee-saved registers, and the results must equal the same work
// done without fibers. Exit status 0 and "ok" on success.
#include <cstdio>

#include "context.h"

using bnb_emu::Context;

namespace {

Context main_ctx, ctx_a, ctx_b;
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
  const bool ok = acc_a == want_a && acc_b == want_b && steps == 2 * kRounds && kept == seed * 7.0 &&
                  kept_int == static_cast<long>(seed) * 12345;
  std::printf("%s a=%.17g/%.17g b=%.17g/%.17g steps=%ld\n", ok ? "ok" : "MISMATCH", acc_a, want_a, acc_b, want_b,
              steps);
  return ok ? 0 : 1;
}
