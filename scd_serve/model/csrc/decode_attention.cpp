// One query per sequence over its paged K/V, read in place: the CPU's decode attention
// (model/cpu_kernel.py builds it; model/paged.py's attend_gathered is the reference).
// Per (sequence, kv head), one task: the query heads that share that kv head score every key
// of the sequence's blocks in float32 (bfloat16 widened by a shift), one softmax, then the
// weighted sum of the values; no gathered copy of the blocks and one call a layer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "support.h"
#include "vec.h"

namespace {

// the plain loops' sizes, where no vector path applies (no AVX2 with FMA, or a head size the vector
// paths do not take); every path pads its float32 rows to VEC
constexpr int64_t TILE = 16;  // value rows widened together
constexpr int64_t VEC = 16;   // float32 lanes the loops are written for

// L values widened to float32 lanes
inline Vec load_lanes(const float* x) { return Vec::load(x); }
inline Vec load_lanes(const c10::BFloat16* x) { return Vec::load_bf16(reinterpret_cast<const uint16_t*>(x)); }

// acc [group, hdp] = probabilities [group, n] x values (hd a multiple of L): two query heads and
// four vectors of dimensions at a time, eight independent accumulators over the keys
template <typename T>
void values_lanes(const float* w, int64_t group, int64_t hd, int64_t hdp, const T* v, const int64_t* rows, int64_t n,
                  float* acc) {
  const int64_t chunks = hd / L;
  for (int64_t g = 0; g < group; g += 2) {
    const bool pair = g + 1 < group;
    for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
      const int64_t cn = std::min<int64_t>(4, chunks - c0);
      Vec a0[4], a1[4];
      for (int c = 0; c < 4; ++c) a0[c] = a1[c] = Vec::all(0.f);
      for (int64_t i = 0; i < n; ++i) {
        const T* val = v + rows[i] + L * c0;
        const Vec w0 = Vec::all(w[g * n + i]);
        const Vec w1 = Vec::all(pair ? w[(g + 1) * n + i] : 0.f);
        for (int c = 0; c < cn; ++c) {
          const Vec x = load_lanes(val + L * c);
          a0[c] = a0[c].fma(w0, x);
          a1[c] = a1[c].fma(w1, x);
        }
      }
      for (int c = 0; c < cn; ++c) {
        a0[c].store(acc + g * hdp + L * (c0 + c));
        if (pair) a1[c].store(acc + (g + 1) * hdp + L * (c0 + c));
      }
    }
  }
}

#if defined(__AVX512F__)
// scores [group, n] of one task: each key's chunks loaded once, one product a query head, summed
template <typename T>
void scores_avx512(const float* qf, int64_t hdp, int64_t group, const T* k, const int64_t* rows, int64_t n,
                   float* scores) {
  const int64_t chunks = hdp / 16;
  for (int64_t i = 0; i < n; ++i) {
    const T* key = k + rows[i];
    __m512 kc[16];
    for (int64_t c = 0; c < chunks; ++c) kc[c] = load_lanes(key + 16 * c).x;
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * hdp;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kc[0]);
      for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kc[c], acc);
      scores[g * n + i] = _mm512_reduce_add_ps(acc);
    }
  }
}

#elif defined(__AVX2__) && defined(__FMA__)

// lane j: the sum of a[j]'s lanes (8 sums in one tree of additions, not one reduction each)
inline __m256 sum_lanes8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // each 128-bit half holds the sums of lanes 0-3 (low) or 4-7 (high) of a[0..3] / a[4..7]
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores [group, n] of one task, eight keys at a time: per query head, one accumulator a key
// over the head's dims, the eight summed together (bfloat16 keys widened once into kbuf [8, hd])
template <typename T>
void scores_avx2(const float* qf, int64_t hdp, int64_t hd, int64_t group, const T* k, const int64_t* rows,
                 int64_t n, float* scores, float* kbuf) {
  const int64_t chunks = hd / 8;
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - i0);
    const float* key[8];
    for (int j = 0; j < 8; ++j) {  // a short last group repeats its last key
      const T* src = k + rows[i0 + std::min<int64_t>(j, m - 1)];
      if constexpr (std::is_same_v<T, float>) {
        key[j] = src;
      } else {
        for (int64_t c = 0; c < chunks; ++c) load_lanes(src + 8 * c).store(kbuf + j * hd + 8 * c);
        key[j] = kbuf + j * hd;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * hdp;
      __m256 acc[8];
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256 qc = _mm256_loadu_ps(qg + 8 * c);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(key[j] + 8 * c), acc[j]);
      }
      float sums[8];
      _mm256_storeu_ps(sums, sum_lanes8(acc));
      std::copy(sums, sums + m, scores + g * n + i0);
    }
  }
}

#endif

template <typename T>
void attend(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lengths, T* out,
            int64_t batch, int64_t heads, int64_t kv_heads, int64_t hd, int64_t block_size, int64_t width,
            int64_t window, float scale) {
  const int64_t group = heads / kv_heads;
  // q: [B, heads, hd]; k, v: [num_blocks, block_size, kv_heads, hd]; out: [B, heads, hd]
  // float32 rows padded to a whole number of vectors: every inner loop below is fixed-width
  const int64_t hdp = (hd + VEC - 1) / VEC * VEC;
  // a task's work at most: the step's few short tasks run where they are
  int64_t longest = 1;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, window > 0 ? std::min(lengths[b], window) : lengths[b]);
  at::parallel_for(0, batch * kv_heads, parallel_grain(longest * group * hd), [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * hdp, 0.f), acc(group * hdp), kf(8 * hdp, 0.f), vt(TILE * hdp, 0.f), scores;
    std::vector<int64_t> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads;
      const int64_t length = lengths[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
      const int64_t n = length - first;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < hd; ++d)
          qf[g * hdp + d] = widen(q[(b * heads + kvh * group + g) * hd + d]) * scale;
      scores.assign(group * n, 0.f);
      rows.resize(n);  // each key's offset in the pool, block by block (no division per key)
      for (int64_t i = 0, p = first; i < n;) {
        const int64_t blk = p / block_size, off = p % block_size;
        const int64_t base = (tables[b * width + blk] * block_size * kv_heads + kvh) * hd;
        for (int64_t o = off; o < block_size && i < n; ++o, ++i, ++p) rows[i] = base + o * kv_heads * hd;
      }
#if defined(__AVX512F__)
      const bool vector = hd % 16 == 0 && hd <= 256;
      if (vector) scores_avx512(qf.data(), hdp, group, k, rows.data(), n, scores.data());
#elif defined(__AVX2__) && defined(__FMA__)
      const bool vector = hd % 8 == 0;
      if (vector) scores_avx2(qf.data(), hdp, hd, group, k, rows.data(), n, scores.data(), kf.data());
#else
      const bool vector = false;
#endif
      // scores: each key widened once into kf, then one fixed-width product per query head that
      // shares it, its lanes summed (the heads' sums are independent: they overlap)
      for (int64_t i = 0; i < n && !vector; ++i) {
        const T* key = k + rows[i];
        for (int64_t d = 0; d < hd; ++d) kf[d] = widen(key[d]);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * hdp;
          float lanes[VEC];
#pragma omp simd
          for (int64_t e = 0; e < VEC; ++e) lanes[e] = qg[e] * kf[e];
          for (int64_t d0 = VEC; d0 < hdp; d0 += VEC) {
#pragma omp simd
            for (int64_t e = 0; e < VEC; ++e) lanes[e] += qg[d0 + e] * kf[d0 + e];
          }
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t e = 0; e < VEC; ++e) sum += lanes[e];
          scores[g * n + i] = sum;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * n;
        float top = row[0];
        for (int64_t i = 1; i < n; ++i) top = std::max(top, row[i]);
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < n; ++i) {
          row[i] = std::exp(row[i] - top);
          total += row[i];
        }
        const float inv = 1.f / total;
        for (int64_t i = 0; i < n; ++i) row[i] *= inv;
      }
      // the weighted values (the plain loops: tiles of TILE rows widened into vt [TILE, hdp]; per query
      // head and vector of dimensions, two chains over the tile's keys)
      std::fill(acc.begin(), acc.end(), 0.f);
      if (vector) values_lanes(scores.data(), group, hd, hdp, v, rows.data(), n, acc.data());
      for (int64_t i0 = 0; i0 < n && !vector; i0 += TILE) {
        const int64_t tile = std::min<int64_t>(TILE, n - i0);
        for (int64_t j = 0; j < tile; ++j) {
          const T* val = v + rows[i0 + j];
          for (int64_t d = 0; d < hd; ++d) vt[j * hdp + d] = widen(val[d]);
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* w = scores.data() + g * n + i0;
          for (int64_t d0 = 0; d0 < hdp; d0 += VEC) {
            float* a = acc.data() + g * hdp + d0;
            float r0[VEC], r1[VEC] = {0.f};
            for (int64_t e = 0; e < VEC; ++e) r0[e] = a[e];
            int64_t j = 0;
            for (; j + 1 < tile; j += 2) {
              const float* x0 = vt.data() + j * hdp + d0;
              const float* x1 = x0 + hdp;
#pragma omp simd
              for (int64_t e = 0; e < VEC; ++e) {
                r0[e] += w[j] * x0[e];
                r1[e] += w[j + 1] * x1[e];
              }
            }
            if (j < tile) {
              const float* x0 = vt.data() + j * hdp + d0;
#pragma omp simd
              for (int64_t e = 0; e < VEC; ++e) r0[e] += w[j] * x0[e];
            }
            for (int64_t e = 0; e < VEC; ++e) a[e] = r0[e] + r1[e];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < hd; ++d)
          out[(b * heads + kvh * group + g) * hd + d] = static_cast<T>(acc[g * hdp + d]);
    }
  });
}

}  // namespace

// window <= 0: every key; else the last `window` keys of each sequence
at::Tensor decode_attention(at::Tensor q, at::Tensor k_layer, at::Tensor v_layer, at::Tensor tables,
                               at::Tensor lengths, int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_layer.dim() == 4 && v_layer.sizes() == k_layer.sizes(), "decode_attention: bad shapes");
  TORCH_CHECK(q.scalar_type() == k_layer.scalar_type() && q.scalar_type() == v_layer.scalar_type(),
              "decode_attention: q, k and v must share a dtype");
  TORCH_CHECK(k_layer.is_contiguous() && v_layer.is_contiguous(), "decode_attention: the pool must be contiguous");
  TORCH_CHECK(q.size(2) == k_layer.size(3) && q.size(2) <= 512 && q.size(1) % k_layer.size(2) == 0,
              "decode_attention: head sizes do not match");
  q = q.contiguous();
  auto t = tables.to(at::kLong).contiguous();
  auto l = lengths.to(at::kLong).contiguous();
  auto out = at::empty_like(q);
  const int64_t batch = q.size(0), heads = q.size(1), hd = q.size(2);
  TORCH_CHECK(t.dim() == 2 && t.size(0) == batch && l.numel() == batch, "decode_attention: one table row and length per query");
  const int64_t block_size = k_layer.size(1), kv_heads = k_layer.size(2), width = t.size(1);
  // the blocks read are in the pool and each length fits its row: no read outside the tensors
  const int64_t* tp = t.data_ptr<int64_t>();
  const int64_t* lp = l.data_ptr<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < k_layer.size(0), "decode_attention: block ids outside the pool");
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * block_size, "decode_attention: lengths must lie in 1..blocks x block_size");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
              "decode_attention: bfloat16 or float32 only");
  with_element_type(q.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    attend<T>(q.data_ptr<T>(), k_layer.data_ptr<T>(), v_layer.data_ptr<T>(), tp, lp, out.data_ptr<T>(), batch, heads,
              kv_heads, hd, block_size, width, window, static_cast<float>(scale));
  });
  return out.view({batch, heads * hd});
}
