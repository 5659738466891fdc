// Force-included (-include) before every kernel source the emulator compiles. Includes every
// C++ header first, then defines the MSL keywords and attributes as macros (after this point a
// standard header would no longer compile: `thread` and `device` are gone).
#pragma once

#include "kernel.h"

#define BNB_EMU 1
#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310  // Metal 3.1: bfloat available
#endif
#define __HAVE_BFLOAT__ 1

// Address spaces and function qualifiers. `constant` is `const` where the compiler allows a
// duplicate `const` (clang; catches writes to constant buffers), nothing under g++.
#define kernel
#define device
#define thread
#define threadgroup
#if defined(__clang__)
#define constant const
#else
#define constant
#endif
#define METAL_FUNC inline
// Metal 3.2's coherent(device) (and coherent(system)) pointee qualifier: a volatile pointee here, so
// that a kernel taking such a buffer reports it (kernel.h, buffer_value) and a coherent pointer does
// not convert to a plain one, as in MSL. Compiled at every language version: the coherence check,
// not the compiler, is what makes it mean nothing below 3.2.
#define coherent(scope) volatile

// Parameter attributes -> default arguments.
#define buffer(n) maybe_unused]] = ::metal::emu::buffer_binding{uint32_t(n), __FILE__, __LINE__}[::metal::emu::no_index[0
#define BNB_EMU_ATTR(field) maybe_unused]] = ::metal::emu::attribute(::metal::emu::lane().field)[::metal::emu::no_index[0
#define thread_position_in_grid BNB_EMU_ATTR(thread_position_in_grid)
#define thread_position_in_threadgroup BNB_EMU_ATTR(thread_position_in_threadgroup)
#define threadgroup_position_in_grid BNB_EMU_ATTR(threadgroup_position_in_grid)
#define threads_per_threadgroup BNB_EMU_ATTR(threads_per_threadgroup)
#define dispatch_threads_per_threadgroup BNB_EMU_ATTR(dispatch_threads_per_threadgroup)
#define threadgroups_per_grid BNB_EMU_ATTR(threadgroups_per_grid)
#define threads_per_grid BNB_EMU_ATTR(threads_per_grid)
#define thread_index_in_threadgroup BNB_EMU_ATTR(thread_index_in_threadgroup)
#define thread_index_in_simdgroup BNB_EMU_ATTR(thread_index_in_simdgroup)
#define simdgroup_index_in_threadgroup BNB_EMU_ATTR(simdgroup_index_in_threadgroup)
#define threads_per_simdgroup BNB_EMU_ATTR(threads_per_simdgroup)
#define thread_execution_width BNB_EMU_ATTR(threads_per_simdgroup)
#define simdgroups_per_threadgroup BNB_EMU_ATTR(simdgroups_per_threadgroup)
#define dispatch_simdgroups_per_threadgroup BNB_EMU_ATTR(simdgroups_per_threadgroup)
#define thread_index_in_quadgroup maybe_unused]] = ::metal::emu::attribute(::metal::emu::lane().thread_index_in_threadgroup % 4u)[::metal::emu::no_index[0
#define quadgroup_index_in_threadgroup maybe_unused]] = ::metal::emu::attribute(::metal::emu::lane().thread_index_in_threadgroup / 4u)[::metal::emu::no_index[0

// Function attributes that only matter to the Metal compiler.
#define host_name(x) maybe_unused
#define max_total_threads_per_threadgroup(n) maybe_unused
