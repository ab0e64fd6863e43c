// Causal attention of a prompt chunk's queries over its sequence's paged K/V, read in place:
// the CPU's prefill attention (model/cpu_kernel.py builds it; model/paged.py's attend_paged is
// the reference). One task per (kv head, tile of queries); its rows (every query head of the
// group times the tile's queries) lie across vector lanes, L rows a vector (vec.h): the queries are
// transposed once per task, and each key's elements are broadcast from the pool as they are,
// so nothing is packed per key and no sum runs across lanes. The keys are walked a tile of KT
// at a time with a running max and sum per row (flash attention's online softmax): no score
// matrix is made. Products in float32 multiply-adds, or bfloat16 pairs into float32 (AVX512-BF16)
// where the CPU has them. Masked scores are a large finite negative and their weights zeroed by
// mask (the build is -ffast-math: no infinities).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "support.h"
#include "vec.h"

namespace {

// keys per tile, a multiple of 4 (the score loops write four keys at a time); 128, not 32: each
// tile's rescaling of the running output spreads over more keys (4k tokens: 0.93x the time)
constexpr int64_t KT = 128;
constexpr float MASKED = -1e30f;

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

// One task's state, rows in lanes (R rows padded to whole vectors): the transposed queries
// (float32 [hd, R], or bfloat16 pairs [hd/2, R]), the running max and sum [R], the weighted
// values [hd, R], each row's visible keys, and a tile's scores, then weights [KT, R]
struct Scratch {
  std::vector<float> q, m, l, o, s;
  std::vector<uint32_t> qp, vp, pp;  // bfloat16 pairs: queries, a tile's values, its weights
  std::vector<int64_t> lo, hi;
};

// scores s [KT, R] of row vectors v0..v0+V over keys 0..nk-1: float32 queries, keys widened
template <int V, typename T>
void scores_f32(const float* q, int64_t rows, const T* const* keys, int64_t nk, int64_t hd, int64_t v0, float* s) {
  for (int64_t j0 = 0; j0 < nk; j0 += 4) {
    const int64_t jn = std::min<int64_t>(4, nk - j0);
    Vec acc[4][V];
    for (int j = 0; j < 4; ++j)
      for (int v = 0; v < V; ++v) acc[j][v] = Vec::all(0.f);
    const T* kj[4];
    for (int j = 0; j < 4; ++j) kj[j] = keys[j0 + std::min<int64_t>(j, jn - 1)];  // a short group repeats its last key
    for (int64_t d = 0; d < hd; ++d) {
      Vec x[V];
      for (int v = 0; v < V; ++v) x[v] = Vec::load(q + d * rows + (v0 + v) * L).pinned();
      for (int j = 0; j < 4; ++j) {
        const Vec kd = Vec::all(widen(kj[j][d]));
        for (int v = 0; v < V; ++v) acc[j][v] = acc[j][v].fma(kd, x[v]);
      }
    }
    for (int j = 0; j < 4; ++j)  // all four, past nk too (never read): fixed indices keep acc in registers
      for (int v = 0; v < V; ++v) acc[j][v].store(s + (j0 + j) * rows + (v0 + v) * L);
  }
}

// o [hd, R] += weights s [KT, R] x values, row vectors v0..v0+V, float32
template <int V, typename T>
void values_f32(const float* s, int64_t rows, const T* const* vals, int64_t nk, int64_t hd, int64_t v0, float* o) {
  for (int64_t d0 = 0; d0 < hd; d0 += 4) {
    const int64_t dn = std::min<int64_t>(4, hd - d0);
    Vec acc[4][V];
    for (int d = 0; d < 4; ++d)
      for (int v = 0; v < V; ++v) acc[d][v] = Vec::load(o + (d0 + d) * rows + (v0 + v) * L);
    for (int64_t j = 0; j < nk; ++j) {
      Vec w[V];
      for (int v = 0; v < V; ++v) w[v] = Vec::load(s + j * rows + (v0 + v) * L).pinned();
      for (int d = 0; d < 4; ++d) {
        const Vec x = Vec::all(widen(vals[j][d0 + std::min<int64_t>(d, dn - 1)]));
        for (int v = 0; v < V; ++v) acc[d][v] = acc[d][v].fma(x, w[v]);
      }
    }
    for (int d = 0; d < 4; ++d)  // o has rows for hd rounded up to 4 (never read past hd)
      for (int v = 0; v < V; ++v) acc[d][v].store(o + (d0 + d) * rows + (v0 + v) * L);
  }
}

#if defined(__AVX512BF16__)
// The same products in bfloat16 pairs: a lane holds one row's two query dims (scores) or two
// keys' weights (values); a key's dim pair, or one dim of two keys (vp [KT/2, hd]), broadcast
template <int V>
void scores_bf16(const uint32_t* qp, int64_t rows, const c10::BFloat16* const* keys, int64_t nk, int64_t pairs,
                 int64_t v0, float* s) {
  for (int64_t j0 = 0; j0 < nk; j0 += 4) {
    const int64_t jn = std::min<int64_t>(4, nk - j0);
    __m512 acc[4][V];
    for (int j = 0; j < 4; ++j)
      for (int v = 0; v < V; ++v) acc[j][v] = _mm512_setzero_ps();
    const uint32_t* kj[4];
    for (int j = 0; j < 4; ++j) kj[j] = reinterpret_cast<const uint32_t*>(keys[j0 + std::min<int64_t>(j, jn - 1)]);
    for (int64_t d = 0; d < pairs; ++d) {
      __m512bh x[V];
      for (int v = 0; v < V; ++v) x[v] = pinned_register((__m512bh)_mm512_loadu_si512(qp + d * rows + (v0 + v) * L));
      for (int j = 0; j < 4; ++j) {
        const __m512bh kd = (__m512bh)_mm512_set1_epi32(static_cast<int>(kj[j][d]));
        for (int v = 0; v < V; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], kd, x[v]);
      }
    }
    for (int j = 0; j < 4; ++j)  // all four, past nk too (never read): fixed indices keep acc in registers
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(s + (j0 + j) * rows + (v0 + v) * L, acc[j][v]);
  }
}

template <int V>
void values_bf16(const uint32_t* pp, int64_t rows, const uint32_t* vp, int64_t nk, int64_t hd, int64_t v0, float* o) {
  for (int64_t d0 = 0; d0 < hd; d0 += 4) {
    const int64_t dn = std::min<int64_t>(4, hd - d0);
    __m512 acc[4][V];
    for (int d = 0; d < 4; ++d)
      for (int v = 0; v < V; ++v) acc[d][v] = _mm512_loadu_ps(o + (d0 + d) * rows + (v0 + v) * L);
    for (int64_t i = 0; i < (nk + 1) / 2; ++i) {
      __m512bh w[V];
      for (int v = 0; v < V; ++v) w[v] = pinned_register((__m512bh)_mm512_loadu_si512(pp + i * rows + (v0 + v) * L));
      for (int d = 0; d < 4; ++d) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(vp[i * hd + d0 + std::min<int64_t>(d, dn - 1)]));
        for (int v = 0; v < V; ++v) acc[d][v] = _mm512_dpbf16_ps(acc[d][v], x, w[v]);
      }
    }
    for (int d = 0; d < 4; ++d)  // o has rows for hd rounded up to 4 (never read past hd)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(o + (d0 + d) * rows + (v0 + v) * L, acc[d][v]);
  }
}
#endif

template <typename T>
constexpr bool pairs_path() {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, c10::BFloat16>;
#else
  return false;
#endif
}

// f(V, v0) over the row vectors in blocks of RB, V a compile-time count
template <typename F>
void by_blocks(int64_t vectors, F&& f) {
  for (int64_t v0 = 0; v0 < vectors; v0 += RB) {
    switch (std::min<int64_t>(RB, vectors - v0)) {
      case 1: f(std::integral_constant<int, 1>{}, v0); break;
      case 2: f(std::integral_constant<int, 2>{}, v0); break;
      case 3: f(std::integral_constant<int, 3>{}, v0); break;
      default: f(std::integral_constant<int, 4>{}, v0);
    }
  }
}

// One task: kv head kvh, queries q0..q0+qn-1; row r = g * qn + i (the group's head g, query i)
template <typename T>
void run_task(const Problem<T>& a, int64_t kvh, int64_t q0, int64_t qn, Scratch& s) {
  constexpr bool bf16 = pairs_path<T>();
  const int64_t group = a.group(), hd = a.hd, pairs = hd / 2;
  const int64_t rows = (group * qn + L - 1) / L * L, vectors = rows / L;
  s.m.assign(rows, MASKED);
  s.l.assign(rows, 0.f);
  s.o.assign((hd + 3) / 4 * 4 * rows, 0.f);
  s.s.resize(KT * rows);
  s.lo.assign(rows, 1);
  s.hi.assign(rows, 0);  // padding rows see nothing
  if (bf16) {
    s.qp.assign(pairs * rows, 0u);
    s.pp.resize(KT / 2 * rows);
    s.vp.resize(KT / 2 * hd);
  } else {
    s.q.assign(hd * rows, 0.f);
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < qn; ++i) {
      const int64_t r = g * qn + i, pos = a.first + q0 + i;
      const T* src = a.q + ((q0 + i) * a.heads + kvh * group + g) * hd;
      if (bf16) {
        const uint32_t* two = reinterpret_cast<const uint32_t*>(src);
        for (int64_t d = 0; d < pairs; ++d) s.qp[d * rows + r] = two[d];
      } else {
        for (int64_t d = 0; d < hd; ++d) s.q[d * rows + r] = widen(src[d]) * a.scale;
      }
      s.lo[r] = a.lowest(pos);
      s.hi[r] = pos;
    }
  const int64_t last = a.first + q0 + qn - 1;
  const T* keys[KT];
  const T* vals[KT];
  for (int64_t t0 = a.lowest(a.first + q0); t0 <= last; t0 += KT) {
    const int64_t nk = std::min<int64_t>(KT, last + 1 - t0);
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t at = a.offset(t0 + j, kvh);
      keys[j] = a.k + at;
      vals[j] = a.v + at;
    }
    if constexpr (bf16) {  // one dim of two keys a lane; an odd last key's partner zero
      for (int64_t i = 0; i < (nk + 1) / 2; ++i) {
        const uint16_t* v0 = reinterpret_cast<const uint16_t*>(vals[2 * i]);
        const uint16_t* v1 = 2 * i + 1 < nk ? reinterpret_cast<const uint16_t*>(vals[2 * i + 1]) : nullptr;
        for (int64_t d = 0; d < hd; ++d) s.vp[i * hd + d] = v0[d] | (v1 ? static_cast<uint32_t>(v1[d]) << 16 : 0u);
      }
    }
    by_blocks(vectors, [&](auto vn, int64_t v0) {
      constexpr int V = decltype(vn)::value;
      // rows of this block that see some key of the tile, and whether every row sees all of them
      bool any = false, whole = true;
      for (int64_t r = v0 * L; r < (v0 + V) * L; ++r) {
        any |= s.hi[r] >= t0 && s.lo[r] < t0 + nk;
        whole &= s.lo[r] <= t0 && s.hi[r] >= t0 + nk - 1;
      }
      if (!any) return;
#if defined(__AVX512BF16__)
      if constexpr (bf16) scores_bf16<V>(s.qp.data(), rows, reinterpret_cast<const c10::BFloat16* const*>(keys), nk, pairs, v0, s.s.data());
#endif
      if constexpr (!bf16) scores_f32<V>(s.q.data(), rows, keys, nk, hd, v0, s.s.data());
      for (int64_t v = v0; v < v0 + V; ++v) {
        uint16_t seen[KT];
        for (int64_t j = 0; j < nk; ++j) {
          seen[j] = 0xffff;
          if (!whole)
            for (int l = 0; l < L; ++l)
              if (s.lo[v * L + l] > t0 + j || s.hi[v * L + l] < t0 + j) seen[j] &= static_cast<uint16_t>(~(1u << l));
        }
        const Vec scale = Vec::all(bf16 ? a.scale : 1.f);
        Vec top = Vec::all(MASKED);
        for (int64_t j = 0; j < nk; ++j) {
          const Vec x = (Vec::load(s.s.data() + j * rows + v * L) * scale).keep(seen[j], MASKED);
          x.store(s.s.data() + j * rows + v * L);
          top = top.max(x);
        }
        const Vec m_old = Vec::load(s.m.data() + v * L), m_new = m_old.max(top);
        const Vec alpha = (m_old - m_new).exp();
        Vec sum = Vec::all(0.f);
        for (int64_t j = 0; j < nk; ++j) {
          const Vec p = (Vec::load(s.s.data() + j * rows + v * L) - m_new).exp().keep(seen[j], 0.f);
          p.store(s.s.data() + j * rows + v * L);
          sum = sum + p;
        }
        (Vec::load(s.l.data() + v * L) * alpha + sum).store(s.l.data() + v * L);
        m_new.store(s.m.data() + v * L);
        for (int64_t d = 0; d < hd; ++d) (Vec::load(s.o.data() + d * rows + v * L) * alpha).store(s.o.data() + d * rows + v * L);
#if defined(__AVX512BF16__)
        if constexpr (bf16) {  // the weights rounded to bfloat16, two keys a lane
          for (int64_t i = 0; i < (nk + 1) / 2; ++i) {
            const __m512i w0 = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s.s.data() + 2 * i * rows + v * L)));
            const __m512i w1 = 2 * i + 1 < nk
                ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s.s.data() + (2 * i + 1) * rows + v * L)))
                : _mm512_setzero_si512();
            _mm512_storeu_si512(s.pp.data() + i * rows + v * L, _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16)));
          }
        }
#endif
      }
#if defined(__AVX512BF16__)
      if constexpr (bf16) values_bf16<V>(s.pp.data(), rows, s.vp.data(), nk, hd, v0, s.o.data());
#endif
      if constexpr (!bf16) values_f32<V>(s.s.data(), rows, vals, nk, hd, v0, s.o.data());
    });
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < qn; ++i) {
      const int64_t r = g * qn + i;
      const float inv = 1.f / s.l[r];
      T* dst = a.out + ((q0 + i) * a.heads + kvh * group + g) * hd;
      for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<T>(s.o[d * rows + r] * inv);
    }
}

template <typename T>
void attend(const Problem<T>& a) {
  // about 64 rows a task (whole vectors where the group allows), and enough tasks for the threads
  const int64_t qt = std::max<int64_t>(1, std::min<int64_t>(64, 64 / a.group()));
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
  with_element_type(q.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    attend<T>(Problem<T>{q.data_ptr<T>(), k_layer.data_ptr<T>(), v_layer.data_ptr<T>(), tp, out.data_ptr<T>(), tokens,
                         q.size(1), k_layer.size(2), q.size(2), block_size, first, window, static_cast<float>(scale)});
  });
  return out.view({tokens, q.size(1) * q.size(2)});
}
