// A value of the pool's element type as float32, for the kernels' float32 arithmetic: bfloat16
// by a shift (its bits are float32's upper half), float32 as it is.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}
