// Decode attention read straight from the paged KV cache, on the CPU (fp32).
//
// One query token per sequence attends over its whole context. The torch path
// (engine/attention/cpu.py) first gathers each sequence's blocks into a padded contiguous
// tensor and then runs SDPA over it: the KV bytes cross memory three times (read, write,
// read). Here each (sequence, KV head) task reads its K and V rows once, in place, through the
// block table; its g = Hq / Hkv query heads share every row it reads (exact GQA).
//
// Built on first use by engine/attention/cpu_kernel.py (torch.utils.cpp_extension); the torch
// path stays the fallback and the reference.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

// a . b over d floats.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t d) {
  int64_t x = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; x + 16 <= d; x += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + x), _mm256_loadu_ps(b + x), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + x + 8), _mm256_loadu_ps(b + x + 8), s1);
  }
  s = hsum(_mm256_add_ps(s0, s1));
#endif
  for (; x < d; ++x) s += a[x] * b[x];
  return s;
}

// acc[0:w] = sum_t p[t] * rows[t][0:w] for w <= 64 floats (registers hold the accumulator).
inline void weighted_sum(float* __restrict acc, const float* const* rows, const float* __restrict p, int64_t len,
                         int64_t off, int64_t w) {
#if defined(__AVX2__) && defined(__FMA__)
  if (w == 64) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t t = 0; t < len; ++t) {
      const float* v = rows[t] + off;
      if (t + 8 < len) {
        _mm_prefetch(reinterpret_cast<const char*>(rows[t + 8] + off), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(rows[t + 8] + off + 16), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(rows[t + 8] + off + 32), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(rows[t + 8] + off + 48), _MM_HINT_T0);
      }
      const __m256 pt = _mm256_set1_ps(p[t]);
      a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v), a0);
      a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8), a1);
      a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 16), a2);
      a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 24), a3);
      a4 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 32), a4);
      a5 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 40), a5);
      a6 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 48), a6);
      a7 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 56), a7);
    }
    _mm256_storeu_ps(acc, a0); _mm256_storeu_ps(acc + 8, a1); _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3); _mm256_storeu_ps(acc + 32, a4); _mm256_storeu_ps(acc + 40, a5);
    _mm256_storeu_ps(acc + 48, a6); _mm256_storeu_ps(acc + 56, a7);
    return;
  }
#endif
  for (int64_t x = 0; x < w; ++x) acc[x] = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    const float* v = rows[t] + off;
    const float pt = p[t];
    for (int64_t x = 0; x < w; ++x) acc[x] += pt * v[x];
  }
}

}  // namespace

// out[rows[i], h*g + j, :] = softmax(scale * q . K_i) V_i for sequence i, KV head h, j < g.
// query, out: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (contiguous);
// rows: [n] int64 (the token row of each sequence's query); block_tables: [n, max_blocks] int64;
// seq_lens: [n] int64 (context length including the new token, whose KV is already written).
void paged_decode(at::Tensor out, at::Tensor query, at::Tensor k_cache, at::Tensor v_cache,
                  at::Tensor rows, at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat,
              "paged_decode: float32 tensors only");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: query, out and the caches must be contiguous");
  TORCH_CHECK(rows.scalar_type() == at::kLong && block_tables.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "paged_decode: rows, block_tables and seq_lens must be int64 (block_tables contiguous)");
  const int64_t n = rows.size(0), hq = query.size(1), d = query.size(2);
  const int64_t bs = k_cache.size(1), hkv = k_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(hq % hkv == 0 && k_cache.size(3) == d, "paged_decode: head shapes do not match");
  const int64_t g = hq / hkv;
  const float sc = static_cast<float>(scale);
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sl[i] >= 1 && sl[i] <= max_blocks * bs, "paged_decode: seq_lens[", i, "]=", sl[i],
                " does not fit its block table");

  at::parallel_for(0, n * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s;                   // [g, L] scores, then unnormalised probabilities
    std::vector<const float*> krow, vrow;  // [L] this task's K and V rows in the cache
    std::vector<float> acc(d);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / hkv, h = w % hkv, len = sl[i];
      const int64_t* table = bt + i * max_blocks;
      const float* qh = q + (r[i] * hq + h * g) * d;  // query heads h*g .. h*g+g-1 share KV head h
      s.resize(g * len);
      krow.resize(len);
      vrow.resize(len);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t at = ((table[t / bs] * bs + t % bs) * hkv + h) * d;
        krow[t] = kc + at;
        vrow[t] = vc + at;
      }
      for (int64_t t = 0; t < len; ++t) {
        if (t + 8 < len) {  // rows are scattered over blocks: fetch ahead of the prefetcher
          for (int64_t x = 0; x < d; x += 16) __builtin_prefetch(krow[t + 8] + x);
        }
        for (int64_t j = 0; j < g; ++j) s[j * len + t] = dot(qh + j * d, krow[t], d) * sc;
      }
      for (int64_t j = 0; j < g; ++j) {
        float* sj = s.data() + j * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sj[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sj[t] = std::exp(sj[t] - m);
          sum += sj[t];
        }
        const float inv = 1.f / sum;
        float* oj = o + (r[i] * hq + h * g + j) * d;
        for (int64_t off = 0; off < d; off += 64) {
          const int64_t width = std::min<int64_t>(64, d - off);
          weighted_sum(acc.data(), vrow.data(), sj, len, off, width);
          for (int64_t x = 0; x < width; ++x) oj[off + x] = acc[x] * inv;
        }
      }
    }
  });
}

TORCH_LIBRARY(servetwin, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor rows, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(servetwin, CPU, m) { m.impl("paged_decode", &paged_decode); }
