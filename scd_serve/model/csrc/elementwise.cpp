// A decode step's elementwise work between the linears, one pass each instead of torch's several
// ops (model/cpu_kernel.py builds it). Each rounds where model/layers.py and model/rope.py round
// (to the tensors' dtype after each product and sum), so bfloat16 results match the torch path's
// but for the order of RMSNorm's sum of squares and the last float bit of SiLU's exp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "support.h"

namespace {

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

template <typename T>
void norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, parallel_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      float sum = 0.f;
      for (int64_t d = 0; d < dim; ++d) {
        const float v = static_cast<float>(xr[d]);
        sum += v * v;
      }
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
      T* o = out + r * dim;
      for (int64_t d = 0; d < dim; ++d)
        o[d] = round_to<T>(static_cast<float>(round_to<T>(static_cast<float>(xr[d]) * scale)) * static_cast<float>(w[d]));
    }
  });
}

// out = x * cos + rotate_half(x) * sin, each product and the sum rounded to T (rope.apply)
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, T* out, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t d = 0; d < hd; ++d) {
    const float rot = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
    const float a = static_cast<float>(round_to<T>(static_cast<float>(x[d]) * static_cast<float>(cos[d])));
    const float b = static_cast<float>(round_to<T>(rot * static_cast<float>(sin[d])));
    out[d] = round_to<T>(a + b);
  }
}

template <typename T>
void rope_rows(const T* q, const T* k, const T* v, const T* cos, const T* sin, T* k_pool, T* v_pool, const int64_t* slots,
               T* q_out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd) {
  at::parallel_for(0, rows, parallel_grain((heads + 2 * kv_heads) * hd), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * hd;
      const T* s = sin + r * hd;
      for (int64_t h = 0; h < heads; ++h) rotate(q + (r * heads + h) * hd, c, s, q_out + (r * heads + h) * hd, hd);
      const int64_t slot = slots[r] * kv_heads * hd;
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(k + (r * kv_heads + h) * hd, c, s, k_pool + slot + h * hd, hd);
        for (int64_t d = 0; d < hd; ++d) v_pool[slot + h * hd + d] = v[(r * kv_heads + h) * hd + d];
      }
    }
  });
}

// out = round(round(silu(gate)) * up), gate and up the two halves of each row (layers._finish_rows)
template <typename T>
void silu_rows(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, parallel_grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
      for (int64_t i = 0; i < inter; ++i) {
        const float x = static_cast<float>(g[i]);
        const float s = static_cast<float>(round_to<T>(x / (1.f + std::exp(-x))));
        o[i] = round_to<T>(s * static_cast<float>(u[i]));
      }
    }
  });
}

void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, what,
              ": bfloat16 or float32 only");
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_float(x, "rms_norm");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: the weight must be [dim] of x's dtype");
  x = x.contiguous();
  auto w = weight.contiguous();
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = dim ? x.numel() / dim : 0;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, dim,
                        static_cast<float>(eps));
  });
  return out;
}

// q: [N, heads, hd]; k, v: [N, kv_heads, hd]; cos, sin: [N, 1, hd]; k_layer, v_layer: [blocks,
// block_size, kv_heads, hd]; slots: [N] rows of the flattened pool. -> rotated q [N, heads, hd]
at::Tensor rope_write(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                         at::Tensor k_layer, at::Tensor v_layer, at::Tensor slots) {
  check_float(q, "rope_write");
  const auto dtype = q.scalar_type();
  for (const auto* t : {&k, &v, &cos, &sin, &k_layer, &v_layer})
    TORCH_CHECK(t->scalar_type() == dtype, "rope_write: every tensor must share q's dtype");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k_layer.dim() == 4 && v_layer.sizes() == k_layer.sizes(),
              "rope_write: bad shapes");
  const int64_t rows = q.size(0), heads = q.size(1), hd = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(hd % 2 == 0 && k.size(0) == rows && k.size(2) == hd && k_layer.size(2) == kv_heads && k_layer.size(3) == hd,
              "rope_write: head sizes do not match");
  TORCH_CHECK(cos.numel() == rows * hd && sin.numel() == rows * hd, "rope_write: one cos/sin row per token");
  TORCH_CHECK(k_layer.is_contiguous() && v_layer.is_contiguous(), "rope_write: the pool must be contiguous");
  auto s = slots.to(at::kLong).contiguous();
  TORCH_CHECK(s.numel() == rows, "rope_write: one slot per token");
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t pool_rows = k_layer.size(0) * k_layer.size(1);
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(sp[r] >= 0 && sp[r] < pool_rows, "rope_write: slot outside the pool");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, dtype, "rope_write", [&] {
    rope_rows<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                        sin.data_ptr<scalar_t>(), k_layer.data_ptr<scalar_t>(), v_layer.data_ptr<scalar_t>(), sp,
                        out.data_ptr<scalar_t>(), rows, heads, kv_heads, hd);
  });
  return out;
}

at::Tensor silu_mul(at::Tensor gate_up) {
  check_float(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_mul: the last dimension must be even");
  gate_up = gate_up.contiguous();
  const int64_t inter = gate_up.size(-1) / 2, rows = inter ? gate_up.numel() / (2 * inter) : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}
