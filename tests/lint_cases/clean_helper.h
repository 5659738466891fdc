#pragma once
#include <metal_stdlib>

#define HELPER_TILE 32

// Overloads with the same name that do not call each other are fine.
inline float to_float(half x) { return float(x); }
inline float to_float(float x) { return x; }
