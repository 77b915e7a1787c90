// Decode attention read straight from the paged KV cache, on the CPU (fp32).
//
// One query token per sequence attends over its whole context. The torch path
// (engine/attention/cpu.py) first gathers each sequence's blocks into a padded contiguous
// tensor and then runs SDPA over it: the KV bytes cross memory three times (read, write,
// read). Here each (sequence, KV head) task reads its K and V rows once, in place, through the
// block table; its g = Hq / Hkv query heads share every row it reads (exact GQA).
//
// With AVX-512, head_dim 64 (SmolLM2; other head dims take the AVX2 path) and up to 4
// query heads per KV head, decode_task64 does a task in three vector passes instead: K rows read
// once for all query heads, a vectorised exp, and V rows read once for all query heads (the AVX2
// path reads V once per query head).
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

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
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

#if defined(__AVX512F__)
// exp(x) for 16 floats (Cephes' expf polynomial, about 1 ulp; x clamped to +-88.38, where it
// underflows to 0 or saturates).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

// One (sequence, KV head) task with head_dim 64 and G query heads per KV head, in three passes
// over the context: scores (each K row read once for all G heads, the queries in registers),
// softmax with a vectorised exp, and one pass over V accumulating all G heads at once (each V
// row read once). o: the first of the G heads' output rows (consecutive, 64 floats apart).
template <int G>
void decode_task64(const float* __restrict qh, const float* const* krow, const float* const* vrow, int64_t len,
                   float sc, float* __restrict s, float* __restrict o) {
  __m512 q[G][4];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < 4; ++c) q[j][c] = _mm512_loadu_ps(qh + j * 64 + 16 * c);
  for (int64_t t = 0; t < len; ++t) {
    const float* k = krow[t];
    if (t + 8 < len) {  // rows are scattered over blocks: fetch ahead of the prefetcher
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(krow[t + 8] + 16 * c), _MM_HINT_T0);
    }
    const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                 k3 = _mm512_loadu_ps(k + 48);
    for (int j = 0; j < G; ++j) {
      __m512 a = _mm512_mul_ps(q[j][0], k0);
      a = _mm512_fmadd_ps(q[j][1], k1, a);
      a = _mm512_fmadd_ps(q[j][2], k2, a);
      a = _mm512_fmadd_ps(q[j][3], k3, a);
      s[j * len + t] = _mm512_reduce_add_ps(a) * sc;
    }
  }
  float inv[G];
  const int64_t full = len & ~int64_t(15);
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - full)) - 1u);
  for (int j = 0; j < G; ++j) {
    float* sj = s + j * len;
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < full; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sj + t));
    if (tail) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail, sj + full));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < full; t += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sj + t), m));
      _mm512_storeu_ps(sj + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (tail) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sj + full), m));
      _mm512_mask_storeu_ps(sj + full, tail, e);
      sum = _mm512_mask_add_ps(sum, tail, sum, e);
    }
    inv[j] = 1.f / _mm512_reduce_add_ps(sum);
  }
  __m512 acc[G][4];
  for (int j = 0; j < G; ++j)
    for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const float* v = vrow[t];
    if (t + 8 < len) {
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(vrow[t + 8] + 16 * c), _MM_HINT_T0);
    }
    const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                 v3 = _mm512_loadu_ps(v + 48);
    for (int j = 0; j < G; ++j) {
      const __m512 p = _mm512_set1_ps(s[j * len + t]);
      acc[j][0] = _mm512_fmadd_ps(p, v0, acc[j][0]);
      acc[j][1] = _mm512_fmadd_ps(p, v1, acc[j][1]);
      acc[j][2] = _mm512_fmadd_ps(p, v2, acc[j][2]);
      acc[j][3] = _mm512_fmadd_ps(p, v3, acc[j][3]);
    }
  }
  for (int j = 0; j < G; ++j) {
    const __m512 w = _mm512_set1_ps(inv[j]);
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + j * 64 + 16 * c, _mm512_mul_ps(acc[j][c], w));
  }
}

using Task64 = void (*)(const float*, const float* const*, const float* const*, int64_t, float, float*, float*);

inline Task64 task64_for(int64_t g, int64_t d) {
  if (d != 64) return nullptr;
  switch (g) {
    case 1: return decode_task64<1>;
    case 2: return decode_task64<2>;
    case 3: return decode_task64<3>;
    case 4: return decode_task64<4>;
    default: return nullptr;
  }
}
#endif

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

#if defined(__AVX512F__)
  const Task64 task64 = task64_for(g, d);
#endif
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
#if defined(__AVX512F__)
      if (task64 != nullptr) {
        task64(qh, krow.data(), vrow.data(), len, sc, s.data(), o + (r[i] * hq + h * g) * d);
        continue;
      }
#endif
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

// ------------------------------------------------------------------------------------------
// Fused elementwise ops of a Llama layer (fp32, CPU), used by engine/model/llama.py when this
// library is loaded: each replaces a chain of 3-10 torch ops (a dispatch, an allocation and a
// pass over memory each) with one pass. Rows are split over torch's OpenMP pool.

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) for 8 floats (Cephes' expf polynomial, as exp16 above).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, ": a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, width] with contiguous rows");
}

// One row of RMSNorm: o = w * (r / sqrt(mean(r^2) + eps)).
inline void rms_row(float* __restrict o, const float* __restrict r, const float* __restrict w, int64_t h, float eps) {
  int64_t i = 0;
  float ss = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= h; i += 16) {
    const __m256 x0 = _mm256_loadu_ps(r + i), x1 = _mm256_loadu_ps(r + i + 8);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    a1 = _mm256_fmadd_ps(x1, x1, a1);
  }
  ss = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < h; ++i) ss += r[i] * r[i];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vi = _mm256_set1_ps(inv);
  for (; i + 8 <= h; i += 8)
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(r + i), vi)));
#endif
  for (; i < h; ++i) o[i] = w[i] * (r[i] * inv);
}

}  // namespace

// out = RMSNorm(x) * weight, row by row. x, out: [T, H]; weight: [H].
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(out, "rms_norm: out");
  check_rows(x, "rms_norm: x");
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(out.size(0) == t && out.size(1) == h && weight.is_contiguous() && weight.numel() == h &&
                  weight.scalar_type() == at::kFloat, "rms_norm: shapes out [T, H], x [T, H], weight [H]");
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t so = out.stride(0), sx = x.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) rms_row(o + i * so, xp + i * sx, w, h, e);
  });
}

// residual += x, then out = RMSNorm(residual) * weight (the pre-norm residual stream, one pass).
void add_rms_norm(at::Tensor out, at::Tensor residual, at::Tensor x, at::Tensor weight, double eps) {
  check_rows(out, "add_rms_norm: out");
  check_rows(residual, "add_rms_norm: residual");
  check_rows(x, "add_rms_norm: x");
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(out.size(0) == t && out.size(1) == h && residual.size(0) == t && residual.size(1) == h &&
                  weight.is_contiguous() && weight.numel() == h && weight.scalar_type() == at::kFloat,
              "add_rms_norm: shapes out, residual, x [T, H], weight [H]");
  float* o = out.data_ptr<float>();
  float* r = residual.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t so = out.stride(0), sr = residual.stride(0), sx = x.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      float* ri = r + i * sr;
      const float* xi = xp + i * sx;
      for (int64_t j = 0; j < h; ++j) ri[j] += xi[j];
      rms_row(o + i * so, ri, w, h, e);
    }
  });
}

// out = silu(gate) * up for gate_up = [gate | up] ([T, 2I]); out: [T, I].
void silu_mul(at::Tensor out, at::Tensor gate_up) {
  check_rows(out, "silu_mul: out");
  check_rows(gate_up, "silu_mul: gate_up");
  const int64_t t = gate_up.size(0), n = out.size(1);
  TORCH_CHECK(out.size(0) == t && gate_up.size(1) == 2 * n, "silu_mul: out [T, I], gate_up [T, 2I]");
  float* o = out.data_ptr<float>();
  const float* g = gate_up.data_ptr<float>();
  const int64_t so = out.stride(0), sg = gate_up.stride(0);
  at::parallel_for(0, t, 4, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      float* oi = o + i * so;
      const float* gi = g + i * sg;
      const float* ui = gi + n;
      int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.0f);
      for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_loadu_ps(gi + j);
        const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)));
        _mm256_storeu_ps(oi + j, _mm256_mul_ps(_mm256_div_ps(x, den), _mm256_loadu_ps(ui + j)));
      }
#endif
      for (; j < n; ++j) oi[j] = gi[j] / (1.0f + std::exp(-gi[j])) * ui[j];
    }
  });
}

// Rotate-half RoPE (HF Llama): for each head of x [T, H, D] (rows of heads contiguous, any token
// stride), out = x * cos + rotate_half(x) * sin with cos, sin [T, D] (the two halves equal, as
// the model's cos_sin builds them); out: [T, H, D] contiguous.
void rope(at::Tensor out, at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat, "rope: float32 tensors");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && out.is_contiguous() &&
                  out.sizes() == x.sizes(), "rope: x [T, H, D] with contiguous heads, out like x and contiguous");
  const int64_t t = x.size(0), nh = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == t * d &&
                  sin.numel() == t * d, "rope: cos and sin [T, D] contiguous, D even");
  float* o = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t sx = x.stride(0);
  at::parallel_for(0, t, 16, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) {
      const float* c = cp + i * d;
      const float* s = sp + i * d;
      for (int64_t h = 0; h < nh; ++h) {
        const float* xi = xp + i * sx + h * d;
        float* oi = o + (i * nh + h) * d;
        for (int64_t j = 0; j < half; ++j) {
          const float a = xi[j], bb = xi[j + half];
          oi[j] = a * c[j] - bb * s[j];
          oi[j + half] = bb * c[j + half] + a * s[j + half];
        }
      }
    }
  });
}

TORCH_LIBRARY(servetwin, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor rows, "
        "Tensor block_tables, Tensor seq_lens, float scale) -> ()");
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual, Tensor x, Tensor weight, float eps) -> ()");
  m.def("silu_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rope(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(servetwin, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
}
