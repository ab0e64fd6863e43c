// What the kernels share: the pool's two element types (float32 and bfloat16) widened to
// float32 and dispatched on, and how much work a thread's share of a parallel region needs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

// A value of the pool's element type as float32: bfloat16 by a shift (its bits are float32's
// upper half), float32 as it is
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// f(T{}) for the element type, T float or c10::BFloat16 (the caller checked it is one of them)
template <typename F>
void with_element_type(at::ScalarType type, F&& f) {
  if (type == at::kBFloat16)
    f(c10::BFloat16{});
  else
    f(0.f);
}

// Items per thread at least, each of `per_item` elements of work: below torch's own grain a
// parallel region costs more than it saves (and on a loaded machine far more)
inline int64_t parallel_grain(int64_t per_item) {
  return std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, per_item));
}
