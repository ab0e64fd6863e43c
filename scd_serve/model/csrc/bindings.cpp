// The kernels' Python module (model/cpu_kernel.py builds and loads it).
#include <torch/extension.h>

at::Tensor decode_attention(at::Tensor q, at::Tensor k_layer, at::Tensor v_layer, at::Tensor tables,
                               at::Tensor lengths, int64_t window, double scale);
at::Tensor prefill_attention(at::Tensor q, at::Tensor k_layer, at::Tensor v_layer, at::Tensor table, int64_t first,
                             int64_t window, double scale);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor rope_write(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                         at::Tensor k_layer, at::Tensor v_layer, at::Tensor slots);
at::Tensor silu_mul(at::Tensor gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one query per sequence over its paged K/V");
  m.def("prefill_attention", &prefill_attention, "a prompt chunk's causal attention over its sequence's paged K/V");
  // whether prefill_attention runs vectorized here (AVX-512); elsewhere SDPA serves prefills
#if defined(__AVX512F__)
  m.attr("prefill_vectorized") = true;
#else
  m.attr("prefill_vectorized") = false;
#endif
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, as model/layers.py rounds it");
  m.def("rope_write", &rope_write, "rotate q and k, write k and v into the pool's slots; -> rotated q");
  m.def("silu_mul", &silu_mul, "SiLU of the first half times the second half of the last dimension");
}
