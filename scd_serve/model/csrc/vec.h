// L float32 lanes as one vector register: AVX-512 (16 lanes), AVX2 with FMA (8 lanes: one ymm
// register; with 16 registers instead of 32, fewer row vectors a block), else L arrays the
// compiler vectorizes as it can. The decode attention's weighted values use it (AVX-512, AVX2); the
// prefill attention's row-in-lanes loops serve on AVX-512 only (bindings.cpp, prefill_vectorized):
// on an AVX2 CPU that kernel was not shown to beat SDPA (docs/benchmarks.md: runs a minute apart
// disagreed by more than the difference), so SDPA serves there; the tests run these paths too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// x in a register the compiler may not fold back into its uses as memory operands: a vector read by
// several multiply-adds is loaded once, not once a use (where a CPU loads 64 bytes a cycle the
// reloads set the pace: 1.4x the time in float32, 1.25x in bfloat16, at the 0.5B shape)
template <typename R>
inline R pinned_register(R x) {
#if defined(__AVX512F__)
  asm("" : "+v"(x));
#elif defined(__AVX2__)
  asm("" : "+x"(x));
#endif
  return x;
}

// exp(x) for x <= 0 from 2^(x log2 e): a degree-6 polynomial of the fraction f (rel. error ~2e-7),
// which the caller scales by 2^n and zeroes below -87 (where 2^n leaves float32's range)
template <typename R, typename Fma, typename Set1>
inline R exp2_fraction(R f, Fma fma, Set1 set1) {
  R p = set1(1.535336188319500e-4f);
  for (float c : {1.339887440266574e-3f, 9.618437357674640e-3f, 5.550332471162809e-2f, 2.402264791363012e-1f,
                  6.931472028550421e-1f, 1.f})
    p = fma(p, f, set1(c));
  return p;
}

#if defined(__AVX512F__)
constexpr int L = 16;   // rows a vector
constexpr int RB = 4;   // row vectors a block (the broadcast keys shared by them): 4 keys x 4 + 4 of 32 registers
struct Vec {
  __m512 x;
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load_bf16(const uint16_t* p) {  // bfloat16 bits widened: float32's high half
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
  }
  static Vec all(float v) { return {_mm512_set1_ps(v)}; }
  void store(float* p) const { _mm512_storeu_ps(p, x); }
  Vec fma(Vec a, Vec b) const { return {_mm512_fmadd_ps(a.x, b.x, x)}; }  // this + a * b
  Vec operator*(Vec b) const { return {_mm512_mul_ps(x, b.x)}; }
  Vec operator+(Vec b) const { return {_mm512_add_ps(x, b.x)}; }
  Vec operator-(Vec b) const { return {_mm512_sub_ps(x, b.x)}; }
  Vec max(Vec b) const { return {_mm512_max_ps(x, b.x)}; }
  Vec keep(uint32_t m, float other) const { return {_mm512_mask_mov_ps(_mm512_set1_ps(other), m, x)}; }
  Vec pinned() const { return {pinned_register(x)}; }
  Vec exp() const {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504089f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    const __m512 p = exp2_fraction(f, [](__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); },
                                   [](float c) { return _mm512_set1_ps(c); });
    return {_mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n))};
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int L = 8;
constexpr int RB = 2;  // 4 keys x 2 + 2 + the broadcast key of 16 registers
struct Vec {
  __m256 x;
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load_bf16(const uint16_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))};
  }
  static Vec all(float v) { return {_mm256_set1_ps(v)}; }
  void store(float* p) const { _mm256_storeu_ps(p, x); }
  Vec fma(Vec a, Vec b) const { return {_mm256_fmadd_ps(a.x, b.x, x)}; }
  Vec operator*(Vec b) const { return {_mm256_mul_ps(x, b.x)}; }
  Vec operator+(Vec b) const { return {_mm256_add_ps(x, b.x)}; }
  Vec operator-(Vec b) const { return {_mm256_sub_ps(x, b.x)}; }
  Vec max(Vec b) const { return {_mm256_max_ps(x, b.x)}; }
  Vec keep(uint32_t m, float other) const {  // lane l keeps x where bit l of m is set
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m)), bits), bits);
    return {_mm256_blendv_ps(_mm256_set1_ps(other), x, _mm256_castsi256_ps(set))};
  }
  Vec pinned() const { return {pinned_register(x)}; }
  Vec exp() const {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(1.44269504089f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    const __m256 p = exp2_fraction(f, [](__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); },
                                   [](float c) { return _mm256_set1_ps(c); });
    // 2^n from n's bits in the exponent field (n >= -126 here: a normal number)
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return {_mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)))};
  }
};
#else
constexpr int L = 16;
constexpr int RB = 4;
struct Vec {
  float x[L];
  static Vec load(const float* p) { Vec v; std::memcpy(v.x, p, sizeof v.x); return v; }
  static Vec load_bf16(const uint16_t* p) {
    Vec v;
    for (int l = 0; l < L; ++l) {
      const uint32_t bits = static_cast<uint32_t>(p[l]) << 16;
      std::memcpy(&v.x[l], &bits, sizeof bits);
    }
    return v;
  }
  static Vec all(float s) { Vec v; for (int l = 0; l < L; ++l) v.x[l] = s; return v; }
  void store(float* p) const { std::memcpy(p, x, sizeof x); }
  Vec fma(Vec a, Vec b) const { Vec v; for (int l = 0; l < L; ++l) v.x[l] = x[l] + a.x[l] * b.x[l]; return v; }
  Vec operator*(Vec b) const { Vec v; for (int l = 0; l < L; ++l) v.x[l] = x[l] * b.x[l]; return v; }
  Vec operator+(Vec b) const { Vec v; for (int l = 0; l < L; ++l) v.x[l] = x[l] + b.x[l]; return v; }
  Vec operator-(Vec b) const { Vec v; for (int l = 0; l < L; ++l) v.x[l] = x[l] - b.x[l]; return v; }
  Vec max(Vec b) const { Vec v; for (int l = 0; l < L; ++l) v.x[l] = std::max(x[l], b.x[l]); return v; }
  Vec keep(uint32_t m, float other) const { Vec v; for (int l = 0; l < L; ++l) v.x[l] = (m >> l) & 1 ? x[l] : other; return v; }
  Vec exp() const { Vec v; for (int l = 0; l < L; ++l) v.x[l] = x[l] < -87.f ? 0.f : std::exp(x[l]); return v; }
  Vec pinned() const { return *this; }
};
#endif

// Whether the loops above run in vector registers here (AVX-512, or AVX2 with FMA)
constexpr bool VEC_REGISTERS =
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    true;
#else
    false;
#endif
