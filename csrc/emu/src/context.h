// Fiber contexts: a saved stack pointer and a hand-written switch (x86-64, aarch64), ucontext
// elsewhere. A switch saves the callee-saved registers on the current stack, stores the stack
// pointer, loads the other one and returns into it: ~10 instructions, no system call.
#pragma once

#include <cstddef>

#if !defined(BNB_EMU_USE_UCONTEXT) && !(defined(__x86_64__) || defined(__aarch64__))
#define BNB_EMU_USE_UCONTEXT 1
#endif

#if BNB_EMU_USE_UCONTEXT
#include <ucontext.h>
#endif

namespace bnb_emu {

struct Context {
#if BNB_EMU_USE_UCONTEXT
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
};

using FiberEntry = void (*)(void*);

// Prepares `ctx` so that switching to it runs entry(arg) on [stack_lo, stack_lo + size).
// `entry` must never return (it switches away for the last time instead).
void context_init(Context* ctx, char* stack_lo, size_t size, FiberEntry entry, void* arg);

// Saves the current execution into `from` and resumes `to`.
void context_switch(Context* from, Context* to);

}  // namespace bnb_emu
