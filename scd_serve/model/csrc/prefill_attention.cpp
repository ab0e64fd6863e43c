// Causal attention of a prompt chunk's queries over its sequence's paged K/V, read in place:
// the CPU's prefill attention (model/cpu_kernel.py builds it; model/paged.py's attend_paged is
// the reference). One task per (kv head, tile of queries): the tile's rows (every query head of
// the group times the tile's queries) walk the keys they may see a tile of KT keys at a time,
// with a running max and sum (flash attention's online softmax), so no score matrix is made and
// each key tile is packed once for all the rows that share it. Products in float32 (AVX-512
// multiply-adds), or bfloat16 pairs into float32 (AVX512-BF16's dot products) where the CPU has
// them; plain loops elsewhere. Masked scores are a large finite negative (the build is
// -ffast-math: no infinities).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t KT = 64;      // keys per tile
constexpr int KV = KT / 16;     // AVX-512 vectors of float32 a tile row
constexpr int64_t RB = 4;       // rows scored together (the key tile's loads shared)
constexpr float MASKED = -1e30f;

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// What one call attends: q [T, heads, hd]; k, v [num_blocks, block_size, kv_heads, hd]; query i
// is at position first + i and sees keys max(0, p - window + 1)..p (window <= 0: from 0)
template <typename T>
struct Problem {
  const T* q;
  const T* k;
  const T* v;
  const int64_t* table;
  T* out;
  int64_t tokens, heads, kv_heads, hd, block_size, first, window;
  float scale;
  int64_t group() const { return heads / kv_heads; }
  int64_t lowest(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
  int64_t offset(int64_t pos, int64_t kvh) const {  // where key `pos` of kv head kvh starts in the pool
    return ((table[pos / block_size] * block_size + pos % block_size) * kv_heads + kvh) * hd;
  }
};

// One thread's buffers: rows padded to RB, head_dim to 16 floats
struct Scratch {
  std::vector<float> q, o, m, l, p, kt, vt;
  std::vector<uint32_t> qp, kp, vp;  // bfloat16 pairs (AVX512-BF16)
  std::vector<int64_t> lo, hi;       // each row's first and last visible key
};

#if defined(__AVX512F__)
// exp of x <= 0: 2^(x log2 e), a degree-6 polynomial of the fraction scaled by 2^n (rel. error
// ~2e-7); 0 below -87 (masked keys)
inline __m512 exp512(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}
#endif

// Scores of rows r0..r0+RB over the tile: s [RB, KT] = q rows . keys (float32 tiles:
// q [rows, hdp], kt [hdp, KT] transposed)
inline void scores_f32(const float* q, const float* kt, int64_t hdp, float* s) {
#if defined(__AVX512F__)
  __m512 acc[RB][KV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hdp; ++d) {
    __m512 k[KV];
    for (int c = 0; c < KV; ++c) k[c] = _mm512_loadu_ps(kt + d * KT + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512 x = _mm512_set1_ps(q[r * hdp + d]);
      for (int c = 0; c < KV; ++c) acc[r][c] = _mm512_fmadd_ps(x, k[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KV; ++c) _mm512_storeu_ps(s + r * KT + 16 * c, acc[r][c]);
#else
  for (int r = 0; r < RB; ++r) {
    float acc[KT] = {0.f};
    for (int64_t d = 0; d < hdp; ++d) {
      const float x = q[r * hdp + d];
#pragma omp simd
      for (int64_t j = 0; j < KT; ++j) acc[j] += x * kt[d * KT + j];
    }
    for (int64_t j = 0; j < KT; ++j) s[r * KT + j] = acc[j];
  }
#endif
}

// o [RB, hdp] += p [RB, KT] x values (vt [KT, hdp]), float32; C vectors of 16 dims at a time
// (a compile-time count: the accumulators stay in registers)
#if defined(__AVX512F__)
template <int C>
inline void values_f32_chunk(const float* p, const float* vt, int64_t hdp, int64_t c0, float* o) {
  __m512 acc[RB][C];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + r * hdp + c0 + 16 * c);
  for (int64_t j = 0; j < KT; ++j) {
    __m512 x[C];
    for (int c = 0; c < C; ++c) x[c] = _mm512_loadu_ps(vt + j * hdp + c0 + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * KT + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, x[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * hdp + c0 + 16 * c, acc[r][c]);
}
#endif

inline void values_f32(const float* p, const float* vt, int64_t hdp, float* o) {
#if defined(__AVX512F__)
  for (int64_t c0 = 0; c0 < hdp; c0 += 64) {
    switch ((hdp - c0) / 16) {
      case 1: values_f32_chunk<1>(p, vt, hdp, c0, o); break;
      case 2: values_f32_chunk<2>(p, vt, hdp, c0, o); break;
      case 3: values_f32_chunk<3>(p, vt, hdp, c0, o); break;
      default: values_f32_chunk<4>(p, vt, hdp, c0, o);
    }
  }
#else
  for (int r = 0; r < RB; ++r)
    for (int64_t j = 0; j < KT; ++j) {
      const float w = p[r * KT + j];
#pragma omp simd
      for (int64_t d = 0; d < hdp; ++d) o[r * hdp + d] += w * vt[j * hdp + d];
    }
#endif
}

#if defined(__AVX512BF16__)
// The same two products in bfloat16 pairs: qp [rows, hd/2] (two dims a lane), kp [hd/2, KT]
// (two dims of one key a lane), pp [RB, KT/2] (two keys' probabilities a lane), vp [KT/2, hd]
// (one dim of two keys a lane)
inline void scores_bf16(const uint32_t* qp, const uint32_t* kp, int64_t pairs, float* s) {
  __m512 acc[RB][KV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KV; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < pairs; ++d) {
    __m512bh k[KV];
    for (int c = 0; c < KV; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kp + d * KT + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * pairs + d]));
      for (int c = 0; c < KV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, k[c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < KV; ++c) _mm512_storeu_ps(s + r * KT + 16 * c, acc[r][c]);
}

template <int C>
inline void values_bf16_chunk(const uint32_t* pp, const uint32_t* vp, int64_t hd, int64_t c0, float* o) {
  __m512 acc[RB][C];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(o + r * hd + c0 + 16 * c);
  for (int64_t j = 0; j < KT / 2; ++j) {
    __m512bh x[C];
    for (int c = 0; c < C; ++c) x[c] = (__m512bh)_mm512_loadu_si512(vp + j * hd + c0 + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * (KT / 2) + j]));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, x[c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * hd + c0 + 16 * c, acc[r][c]);
}

inline void values_bf16(const uint32_t* pp, const uint32_t* vp, int64_t hd, float* o) {
  for (int64_t c0 = 0; c0 < hd; c0 += 64) {
    switch ((hd - c0) / 16) {
      case 1: values_bf16_chunk<1>(pp, vp, hd, c0, o); break;
      case 2: values_bf16_chunk<2>(pp, vp, hd, c0, o); break;
      case 3: values_bf16_chunk<3>(pp, vp, hd, c0, o); break;
      default: values_bf16_chunk<4>(pp, vp, hd, c0, o);
    }
  }
}

#endif

template <typename T>
constexpr bool pairs_path(const Problem<T>&) {
  return false;
}
#if defined(__AVX512BF16__)
template <>
constexpr bool pairs_path(const Problem<c10::BFloat16>&) {
  return true;
}
#endif

// Row sr [KT] of raw scores -> exp(scale * score - new max), keys outside a0..a1-1 zero; the
// row's running max m and sum l updated and its accumulated values o [width] rescaled
inline void online_softmax(float* sr, int64_t a0, int64_t a1, float scale, float& m, float& l, float* o, int64_t width) {
#if defined(__AVX512F__)
  const uint64_t seen = (a1 >= 64 ? ~uint64_t{0} : (uint64_t{1} << a1) - 1) & ~((uint64_t{1} << a0) - 1);
  __m512 x[KV];
  __m512 top = _mm512_set1_ps(MASKED);
  for (int c = 0; c < KV; ++c) {
    x[c] = _mm512_mask_mul_ps(_mm512_set1_ps(MASKED), static_cast<__mmask16>(seen >> (16 * c)), _mm512_loadu_ps(sr + 16 * c),
                              _mm512_set1_ps(scale));
    top = _mm512_max_ps(top, x[c]);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(top));
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < KV; ++c) {
    const __m512 e = exp512(_mm512_sub_ps(x[c], mv));
    _mm512_storeu_ps(sr + 16 * c, e);
    sum = _mm512_add_ps(sum, e);
  }
  const float total = _mm512_reduce_add_ps(sum);
#else
  float top = MASKED;
  for (int64_t j = 0; j < KT; ++j) {
    sr[j] = (j >= a0 && j < a1) ? sr[j] * scale : MASKED;
    top = std::max(top, sr[j]);
  }
  const float m_new = std::max(m, top);
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < KT; ++j) {
    sr[j] = (j >= a0 && j < a1) ? std::exp(sr[j] - m_new) : 0.f;
    total += sr[j];
  }
#endif
  const float alpha = std::exp(m - m_new);
  l = l * alpha + total;
  m = m_new;
  if (alpha != 1.f)
#pragma omp simd
    for (int64_t d = 0; d < width; ++d) o[d] *= alpha;
}

// One task: kv head kvh, queries q0..q0+qn-1 (rows: the group's heads x those queries)
template <typename T>
void run_task(const Problem<T>& a, int64_t kvh, int64_t q0, int64_t qn, Scratch& s) {
  const int64_t group = a.group(), hd = a.hd;
  const int64_t hdp = (hd + 15) / 16 * 16, pairs = hd / 2;
  const bool bf16 = pairs_path(a) && hd % 16 == 0;
  const int64_t rows = group * qn, padded = (rows + RB - 1) / RB * RB;
  s.q.assign(padded * hdp, 0.f);
  s.o.assign(padded * hdp, 0.f);
  s.m.assign(padded, MASKED);
  s.l.assign(padded, 0.f);
  s.p.resize(padded * KT);
  s.lo.assign(padded, 1);
  s.hi.assign(padded, 0);  // padding rows see nothing
  if (bf16) s.qp.assign(padded * pairs, 0u);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < qn; ++i) {
      const int64_t r = g * qn + i, pos = a.first + q0 + i;
      const T* src = a.q + ((q0 + i) * a.heads + kvh * group + g) * hd;
      if (bf16) {
        std::memcpy(s.qp.data() + r * pairs, src, hd * sizeof(T));
      } else {
        for (int64_t d = 0; d < hd; ++d) s.q[r * hdp + d] = widen(src[d]);
      }
      s.lo[r] = a.lowest(pos);
      s.hi[r] = pos;
    }
  const int64_t last = a.first + q0 + qn - 1, start = a.lowest(a.first + q0) / KT * KT;
  s.kt.assign(hdp * KT, 0.f);
  s.vt.assign(KT * hdp, 0.f);
  if (bf16) {
    s.kp.assign(pairs * KT, 0u);
    s.vp.assign(KT / 2 * hd, 0u);
  }
  std::vector<uint32_t> pp(bf16 ? RB * KT / 2 : 0);
  for (int64_t t0 = start; t0 <= last; t0 += KT) {
    const int64_t nk = std::min<int64_t>(KT, last + 1 - t0);
    // the tile packed once for every row of the task; keys past nk stay zero
    for (int64_t j = 0; j < KT; ++j) {
      if (j >= nk) {
        if (bf16) {
          for (int64_t d = 0; d < pairs; ++d) s.kp[d * KT + j] = 0u;
          for (int64_t d = 0; d < hd; ++d) reinterpret_cast<uint16_t*>(s.vp.data() + (j / 2) * hd + d)[j % 2] = 0;
        } else {
          for (int64_t d = 0; d < hd; ++d) s.kt[d * KT + j] = s.vt[j * hdp + d] = 0.f;
        }
        continue;
      }
      const int64_t at = a.offset(t0 + j, kvh);
      const T* key = a.k + at;
      const T* val = a.v + at;
      if (bf16) {
        const uint32_t* kpairs = reinterpret_cast<const uint32_t*>(key);
        for (int64_t d = 0; d < pairs; ++d) s.kp[d * KT + j] = kpairs[d];
        const uint16_t* vbits = reinterpret_cast<const uint16_t*>(val);
        for (int64_t d = 0; d < hd; ++d) reinterpret_cast<uint16_t*>(s.vp.data() + (j / 2) * hd + d)[j % 2] = vbits[d];
      } else {
        for (int64_t d = 0; d < hd; ++d) {
          s.kt[d * KT + j] = widen(key[d]);
          s.vt[j * hdp + d] = widen(val[d]);
        }
      }
    }
    for (int64_t r0 = 0; r0 < padded; r0 += RB) {
      bool any = false;
      for (int r = 0; r < RB; ++r) any |= s.hi[r0 + r] >= t0 && s.lo[r0 + r] < t0 + nk;
      if (!any) continue;
      float* sc = s.p.data() + r0 * KT;
#if defined(__AVX512BF16__)
      if (bf16) scores_bf16(s.qp.data() + r0 * pairs, s.kp.data(), pairs, sc);
#endif
      if (!bf16) scores_f32(s.q.data() + r0 * hdp, s.kt.data(), hdp, sc);
      // the online softmax, row by row: masked keys out, the running max and sum updated, the
      // row's accumulated values rescaled by exp(old max - new max)
      for (int r = 0; r < RB; ++r) {
        const int64_t row = r0 + r;
        float* sr = sc + r * KT;
        const int64_t a0 = std::max<int64_t>(s.lo[row], t0) - t0, a1 = std::min<int64_t>(s.hi[row] + 1, t0 + nk) - t0;
        if (a0 >= a1) {  // nothing visible in this tile: no weight, the row's state kept
          std::fill(sr, sr + KT, 0.f);
          continue;
        }
        const int64_t width = bf16 ? hd : hdp;
        online_softmax(sr, a0, a1, a.scale, s.m[row], s.l[row], s.o.data() + row * width, width);
      }
#if defined(__AVX512BF16__)
      if (bf16) {  // the probabilities rounded to bfloat16, two keys a lane
        for (int r = 0; r < RB; ++r)
          for (int64_t j = 0; j < KT; j += 16) {
            const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(sc + r * KT + j));
            std::memcpy(pp.data() + r * (KT / 2) + j / 2, &b, 32);
          }
        values_bf16(pp.data(), s.vp.data(), hd, s.o.data() + r0 * hd);
      }
#endif
      if (!bf16) values_f32(sc, s.vt.data(), hdp, s.o.data() + r0 * hdp);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < qn; ++i) {
      const int64_t r = g * qn + i;
      const float inv = 1.f / s.l[r];
      const float* orow = s.o.data() + r * (bf16 ? hd : hdp);
      T* dst = a.out + ((q0 + i) * a.heads + kvh * group + g) * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<T>(orow[d] * inv);
    }
}

template <typename T>
void attend(const Problem<T>& a) {
  // ~96 rows a task: a key tile's packing pays for itself, and enough tasks for the threads
  const int64_t qt = std::max<int64_t>(4, std::min<int64_t>(64, 96 / a.group()));
  const int64_t tiles = (a.tokens + qt - 1) / qt, tasks = tiles * a.kv_heads;
  // task order: tiles from both ends in turn, so that each thread's contiguous share of the
  // causal triangle costs about the same
  std::vector<int64_t> order(tiles);
  for (int64_t i = 0; i < tiles; ++i) order[i] = i % 2 == 0 ? i / 2 : tiles - 1 - i / 2;
  const int64_t work = a.tokens * (a.first + a.tokens) * a.heads * a.hd;
  const int64_t grain = work < (int64_t{1} << 20) ? tasks : 1;  // a short chunk: one thread
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t tile = order[t % tiles], kvh = t / tiles;
      const int64_t q0 = tile * qt;
      run_task(a, kvh, q0, std::min(qt, a.tokens - q0), s);
    }
  });
}

}  // namespace

at::Tensor prefill_attention(at::Tensor q, at::Tensor k_layer, at::Tensor v_layer, at::Tensor table, int64_t first,
                             int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_layer.dim() == 4 && v_layer.sizes() == k_layer.sizes(), "prefill_attention: bad shapes");
  TORCH_CHECK(q.scalar_type() == k_layer.scalar_type() && q.scalar_type() == v_layer.scalar_type(),
              "prefill_attention: q, k and v must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "prefill_attention: bfloat16 or float32 only");
  TORCH_CHECK(k_layer.is_contiguous() && v_layer.is_contiguous(), "prefill_attention: the pool must be contiguous");
  TORCH_CHECK(q.size(2) == k_layer.size(3) && q.size(2) % 2 == 0 && q.size(2) <= 512 && q.size(1) % k_layer.size(2) == 0,
              "prefill_attention: head sizes do not match");
  q = q.contiguous();
  auto t = table.to(at::kLong).contiguous();
  TORCH_CHECK(t.dim() == 1, "prefill_attention: one sequence's block ids");
  const int64_t tokens = q.size(0), block_size = k_layer.size(1);
  TORCH_CHECK(first >= 0 && tokens >= 1 && first + tokens <= t.numel() * block_size,
              "prefill_attention: the keys 0..first+tokens-1 must lie in the table's blocks");
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < (first + tokens + block_size - 1) / block_size; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < k_layer.size(0), "prefill_attention: block ids outside the pool");
  auto out = at::empty_like(q);
  const auto run = [&](auto zero) {  // zero: a value of the element type, for its type
    using T = decltype(zero);
    attend<T>(Problem<T>{q.data_ptr<T>(), k_layer.data_ptr<T>(), v_layer.data_ptr<T>(), tp, out.data_ptr<T>(), tokens,
                         q.size(1), k_layer.size(2), q.size(2), block_size, first, window, static_cast<float>(scale)});
  };
  if (q.scalar_type() == at::kBFloat16)
    run(c10::BFloat16{});
  else
    run(0.f);
  return out.view({tokens, q.size(1) * q.size(2)});
}
