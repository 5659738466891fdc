#include "context.h"

#include <cstdint>
#include <cstdlib>

#if defined(__APPLE__)
#define BNB_EMU_SYM(name) "_" #name
#define BNB_EMU_FUNC_BEGIN(name) ".globl _" #name "\n.private_extern _" #name "\n.p2align 4\n_" #name ":\n"
#define BNB_EMU_FUNC_END(name)
#else
#define BNB_EMU_SYM(name) #name
#define BNB_EMU_FUNC_BEGIN(name) ".globl " #name "\n.hidden " #name "\n.type " #name ",@function\n.p2align 4\n" #name ":\n"
#define BNB_EMU_FUNC_END(name) ".size " #name ", .-" #name "\n"
#endif

#if !BNB_EMU_USE_UCONTEXT

extern "C" void bnb_emu_ctx_switch(void** save_sp, void* load_sp);
extern "C" void bnb_emu_ctx_start();

#if defined(__x86_64__)
// Frame on a suspended stack, from the saved sp upwards: r15, r14, r13, r12, rbx, rbp, return
// address. The floating-point control registers (mxcsr, x87 control word) are shared by all
// fibers of a worker and never changed by kernel code, so they are not switched (ldmxcsr/fldcw
// would cost more than the rest of the switch): fibers run with the worker's float mode.
__asm__(
    ".text\n" BNB_EMU_FUNC_BEGIN(bnb_emu_ctx_switch)
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n" BNB_EMU_FUNC_END(bnb_emu_ctx_switch)
    // First entry into a fiber: r12 = argument, r13 = entry function.
    BNB_EMU_FUNC_BEGIN(bnb_emu_ctx_start)
    "  movq %r12, %rdi\n"
    "  callq *%r13\n"
    "  ud2\n" BNB_EMU_FUNC_END(bnb_emu_ctx_start));

namespace bnb_emu {
void context_init(Context* ctx, char* stack_lo, size_t size, FiberEntry entry, void* arg) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack_lo) + size) & ~uintptr_t(15);
  // The return-address slot sits at 8 mod 16 so that the stack is 16-aligned after `ret`, as the
  // ABI requires at the start of bnb_emu_ctx_start (which then `call`s).
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 72);
  sp[0] = 0;                                  // r15
  sp[1] = 0;                                  // r14
  sp[2] = reinterpret_cast<uint64_t>(entry);  // r13
  sp[3] = reinterpret_cast<uint64_t>(arg);    // r12
  sp[4] = 0;                                  // rbx
  sp[5] = 0;                                  // rbp
  sp[6] = reinterpret_cast<uint64_t>(&bnb_emu_ctx_start);
  sp[7] = 0;
  sp[8] = 0;
  ctx->sp = sp;
}
}  // namespace bnb_emu

#elif defined(__aarch64__)
// Frame, from the saved sp upwards: x19..x28, x29 (fp), x30 (lr), d8..d15, fpcr, padding.
__asm__(
    ".text\n" BNB_EMU_FUNC_BEGIN(bnb_emu_ctx_switch)
    "  sub sp, sp, #176\n"
    "  stp x19, x20, [sp, #0]\n"
    "  stp x21, x22, [sp, #16]\n"
    "  stp x23, x24, [sp, #32]\n"
    "  stp x25, x26, [sp, #48]\n"
    "  stp x27, x28, [sp, #64]\n"
    "  stp x29, x30, [sp, #80]\n"
    "  stp d8, d9, [sp, #96]\n"
    "  stp d10, d11, [sp, #112]\n"
    "  stp d12, d13, [sp, #128]\n"
    "  stp d14, d15, [sp, #144]\n"
    "  mrs x9, fpcr\n"
    "  str x9, [sp, #160]\n"
    "  mov x9, sp\n"
    "  str x9, [x0]\n"
    "  mov sp, x1\n"
    "  ldp x19, x20, [sp, #0]\n"
    "  ldp x21, x22, [sp, #16]\n"
    "  ldp x23, x24, [sp, #32]\n"
    "  ldp x25, x26, [sp, #48]\n"
    "  ldp x27, x28, [sp, #64]\n"
    "  ldp x29, x30, [sp, #80]\n"
    "  ldp d8, d9, [sp, #96]\n"
    "  ldp d10, d11, [sp, #112]\n"
    "  ldp d12, d13, [sp, #128]\n"
    "  ldp d14, d15, [sp, #144]\n"
    "  ldr x9, [sp, #160]\n"
    "  msr fpcr, x9\n"
    "  add sp, sp, #176\n"
    "  ret\n" BNB_EMU_FUNC_END(bnb_emu_ctx_switch)
    // First entry: x19 = argument, x20 = entry function.
    BNB_EMU_FUNC_BEGIN(bnb_emu_ctx_start)
    "  mov x0, x19\n"
    "  blr x20\n"
    "  brk #0\n" BNB_EMU_FUNC_END(bnb_emu_ctx_start));

namespace bnb_emu {
void context_init(Context* ctx, char* stack_lo, size_t size, FiberEntry entry, void* arg) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack_lo) + size) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top - 176);
  for (int i = 0; i < 22; ++i) sp[i] = 0;
  sp[0] = reinterpret_cast<uint64_t>(arg);    // x19
  sp[1] = reinterpret_cast<uint64_t>(entry);  // x20
  sp[11] = reinterpret_cast<uint64_t>(&bnb_emu_ctx_start);  // x30
  // The switch loads FPCR from the frame: a new fiber starts with the FP mode of the thread that
  // prepares it (the worker, which has set the dispatch's float mode), not with FPCR = 0.
  uint64_t fpcr;
  __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
  sp[20] = fpcr;
  ctx->sp = sp;
}
}  // namespace bnb_emu
#endif

namespace bnb_emu {
void context_switch(Context* from, Context* to) { bnb_emu_ctx_switch(&from->sp, to->sp); }
}  // namespace bnb_emu

#else  // ucontext fallback: portable, ~10x slower (a signal-mask system call per switch)

namespace bnb_emu {
namespace {
void ucontext_entry(unsigned hi_e, unsigned lo_e, unsigned hi_a, unsigned lo_a) {
  auto entry = reinterpret_cast<FiberEntry>((uintptr_t(hi_e) << 32) | lo_e);
  auto arg = reinterpret_cast<void*>((uintptr_t(hi_a) << 32) | lo_a);
  entry(arg);
  std::abort();
}
}  // namespace

void context_init(Context* ctx, char* stack_lo, size_t size, FiberEntry entry, void* arg) {
  getcontext(&ctx->uc);
  ctx->uc.uc_stack.ss_sp = stack_lo;
  ctx->uc.uc_stack.ss_size = size;
  ctx->uc.uc_link = nullptr;
  uintptr_t e = reinterpret_cast<uintptr_t>(entry), a = reinterpret_cast<uintptr_t>(arg);
  makecontext(&ctx->uc, reinterpret_cast<void (*)()>(ucontext_entry), 4, unsigned(e >> 32), unsigned(e),
              unsigned(a >> 32), unsigned(a));
}

void context_switch(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
}  // namespace bnb_emu
#endif
