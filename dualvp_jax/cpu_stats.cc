// The row sums of dualvp.spec.block_sums on the CPU, as one XLA FFI custom
// call (dualvp_jax.cpu_kernel builds and registers it; the op's forward calls
// it through dualvp_jax.function._shard_stats).
//
// Why it exists: XLA:CPU runs every row reduction as a library call over a
// materialised input, so the masked forward with the entropy makes four
// passes over the logits and writes three float32 [rows, V_local] buffers
// (docs/measurements.md). Here each row takes two passes that read the
// logits (and the mask) and write nothing of their size: one for the max,
// one that forms each exponential once and accumulates every sum from it.
//
// What it computes, per row of z [N, V] (float32 or bfloat16) with the
// optional keep mask k [N, V] (bool), d = (z - m) / tau, m = max z (shifted
// by 0 where m = -inf), exactly what spec.block_sums returns:
//   out[r] = (m, s = sum e^d, t = sum_{e^d > 0} e^d d, sk = sum_k max(e^d, tiny))
// with t = 0 without the entropy, sk = 0 without a mask, s = 0 under a mask
// without the entropy. A row holding a NaN or +inf gets NaN in all four: its
// s is NaN in the spec too, and under a mask the NaN sk marks it
// (spec.marked_rows) for the caller to compute again with kept_shift="kept",
// whose results for such rows then are the XLA path's. It restates no more
// than that: the marking, the target logit, the dropped target and the
// merges stay in the spec (spec.stats_from_sums).
//
// Precision: each sum is accumulated in float32 vector lanes over blocks of
// BLOCK columns, and the blocks' sums in float64 (float32 lane sums over a
// whole row were 10-50x further from float64 than XLA's own reductions; see
// row_sums for the compensated s). e^d comes from a Cephes-style float32
// polynomial (within 0.99 ulp of float64 over [-20, 0], no bias), valid for
// d <= 0, which d always is; d < -87.3 gives 0 (below float32's smallest
// normal number, the floor that sk applies anyway). At T = 2048 the sums
// were within 7.2e-8 of float64 (relative), XLA's within 1.8e-7.
//
// Threads: the rows are split into bands claimed from an atomic counter by
// the calling thread and by tasks scheduled on XLA's intra-op thread pool
// (the FFI ThreadPool): the caller always makes progress by itself, so the
// call cannot deadlock when the pool is busy (several host devices).
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t BLOCK = 512;  // columns per float32 partial sum
constexpr int64_t BAND = 4;     // rows per claim of a thread
constexpr int LANES = 64;       // float32 partial sums per statistic

inline float load(const float* p, int64_t j) { return p[j]; }

inline float load(const uint16_t* p, int64_t j) {
  // bfloat16 is the upper half of a float32.
  const uint32_t bits = static_cast<uint32_t>(p[j]) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// e^x for x <= 0 (x < -87.3 gives 0): Cephes' expf range reduction and
// polynomial, rounding by the 1.5 * 2^23 trick so that loops vectorise.
inline float exp_nonpositive(float x) {
  const bool under = x < -87.3f;
  x = under ? -87.3f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = static_cast<int32_t>(n + 127.0f) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return under ? 0.0f : p * scale;
}

struct Terms {
  float e, ed, ek;
};

// One column's terms of the sums: e = e^d, e d (0 where e = 0) and the kept
// term max(e, tiny) (0 where not kept).
template <typename In, bool KEEP, bool ENT, bool TAU>
inline Terms terms(const In* __restrict z, const uint8_t* __restrict k, int64_t j, float shift, float tau) {
  float d = load(z, j) - shift;
  if (TAU) d = d / tau;
  const float e = exp_nonpositive(d);
  constexpr float tiny = 1.17549435e-38f;  // float32's smallest normal number
  return {e, ENT ? (e > 0.0f ? e * d : 0.0f) : 0.0f, KEEP ? static_cast<float>(k[j] != 0) * (e > tiny ? e : tiny) : 0.0f};
}

inline void kahan(float& sum, float& c, float x) {
  const float y = x - c;
  const float u = sum + y;
  c = (u - sum) - y;
  sum = u;
}

// One row. KEEP: a mask is given; ENT: the entropy's t (and, under a mask,
// s) are wanted; TAU: the temperature is not 1.
template <typename In, bool KEEP, bool ENT, bool TAU>
void row_sums(const In* __restrict z, const uint8_t* __restrict k, int64_t v, float tau, float* __restrict out) {
  float m = -INFINITY;
  int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
  for (int64_t j = 0; j < v; ++j) {
    const float x = load(z, j);
    m = x > m ? x : m;
    bad |= x != x;
  }
  if (bad || m == INFINITY) {
    out[0] = out[1] = out[2] = out[3] = NAN;
    return;
  }
  const float shift = m == -INFINITY ? 0.0f : m;
  constexpr bool S = ENT || !KEEP;
  // Explicit lanes (four AVX-512 vectors: as many as the mask's bytes fill
  // one vector, so that the lane loop vectorises with them), summed into
  // float64 after each block (BLOCK / LANES = 8 additions per lane): no
  // float32 horizontal sum. s is also compensated (Kahan) within its lanes:
  // the lane holding the row's largest term (e = 1) would otherwise round
  // every later addition at its scale (s at 2-4x XLA's error against float64;
  // compensated, at the float32 result's own rounding). t and sk were
  // already there without it, and compensating them cost 1.2-1.7x the time.
  double s = 0.0, t = 0.0, sk = 0.0;
  for (int64_t b = 0; b < v; b += BLOCK) {
    const int64_t n = v - b < BLOCK ? v - b : BLOCK;
    const In* __restrict zb = z + b;
    const uint8_t* __restrict kb = KEEP ? k + b : nullptr;
    float as[LANES] = {}, cs[LANES] = {}, at[LANES] = {}, ak[LANES] = {};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
#pragma omp simd
      for (int l = 0; l < LANES; ++l) {
        const Terms r = terms<In, KEEP, ENT, TAU>(zb, kb, j + l, shift, tau);
        if (S) kahan(as[l], cs[l], r.e);
        if (ENT) at[l] += r.ed;
        if (KEEP) ak[l] += r.ek;
      }
    }
    for (int l = 0; j + l < n; ++l) {  // the last columns, one per lane
      const Terms r = terms<In, KEEP, ENT, TAU>(zb, kb, j + l, shift, tau);
      if (S) kahan(as[l], cs[l], r.e);
      if (ENT) at[l] += r.ed;
      if (KEEP) ak[l] += r.ek;
    }
    for (int l = 0; l < LANES; ++l) {
      s += static_cast<double>(as[l]) - static_cast<double>(cs[l]);
      t += at[l];
      sk += ak[l];
    }
  }
  out[0] = m;
  out[1] = S ? static_cast<float>(s) : 0.0f;
  out[2] = ENT ? static_cast<float>(t) : 0.0f;
  out[3] = KEEP ? static_cast<float>(sk) : 0.0f;
}

using RowFn = void (*)(const void*, const uint8_t*, int64_t, float, float*);

template <typename In, bool KEEP, bool ENT, bool TAU>
void row_erased(const void* z, const uint8_t* k, int64_t v, float tau, float* out) {
  row_sums<In, KEEP, ENT, TAU>(static_cast<const In*>(z), k, v, tau, out);
}

template <typename In>
RowFn pick(bool keep, bool ent, bool tau) {
  const int i = (keep ? 4 : 0) | (ent ? 2 : 0) | (tau ? 1 : 0);
  static constexpr RowFn table[8] = {
      row_erased<In, false, false, false>, row_erased<In, false, false, true>,
      row_erased<In, false, true, false>,  row_erased<In, false, true, true>,
      row_erased<In, true, false, false>,  row_erased<In, true, false, true>,
      row_erased<In, true, true, false>,   row_erased<In, true, true, true>,
  };
  return table[i];
}

struct Work {
  RowFn fn;
  const char* z;
  const uint8_t* k;
  int64_t rows, v, zstride;
  float tau;
  float* out;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Claims bands of rows until none is left.
  void run() {
    for (;;) {
      const int64_t r0 = next.fetch_add(BAND, std::memory_order_relaxed);
      if (r0 >= rows) return;
      const int64_t r1 = r0 + BAND < rows ? r0 + BAND : rows;
      for (int64_t r = r0; r < r1; ++r) {
        fn(z + r * zstride, k ? k + r * v : nullptr, v, tau, out + 4 * r);
      }
      done.fetch_add(r1 - r0, std::memory_order_release);
    }
  }
};

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer z, ffi::AnyBuffer keep, ffi::Result<ffi::Buffer<ffi::F32>> out,
                bool has_keep, bool with_entropy, float tau) {
  const auto dims = z.dimensions();
  if (dims.size() < 1) return ffi::Error::InvalidArgument("dualvp cpu_stats: z needs a column axis");
  const int64_t v = dims.back();
  const int64_t rows = v == 0 ? 0 : static_cast<int64_t>(z.element_count()) / v;
  float* o = out->typed_data();
  if (v == 0) {
    // No column: the statistics of an empty block (max -inf, sums 0).
    const int64_t n = static_cast<int64_t>(out->element_count()) / 4;
    for (int64_t r = 0; r < n; ++r) {
      o[4 * r] = -INFINITY;
      o[4 * r + 1] = o[4 * r + 2] = o[4 * r + 3] = 0.0f;
    }
    return ffi::Error::Success();
  }
  RowFn fn;
  int64_t width;
  switch (z.element_type()) {
    case ffi::F32:
      fn = pick<float>(has_keep, with_entropy, tau != 1.0f);
      width = 4;
      break;
    case ffi::BF16:
      fn = pick<uint16_t>(has_keep, with_entropy, tau != 1.0f);
      width = 2;
      break;
    default:
      return ffi::Error::InvalidArgument("dualvp cpu_stats: z must be float32 or bfloat16");
  }
  if (has_keep && keep.element_type() != ffi::PRED) {
    return ffi::Error::InvalidArgument("dualvp cpu_stats: keep must be bool");
  }
  auto work = std::make_shared<Work>();
  work->fn = fn;
  work->z = static_cast<const char*>(z.untyped_data());
  work->k = has_keep ? static_cast<const uint8_t*>(keep.untyped_data()) : nullptr;
  work->rows = rows;
  work->v = v;
  work->zstride = v * width;
  work->tau = tau;
  work->out = o;
  // Helpers: at most one per pool thread, and none for a single band. Each
  // holds the work alive; one that starts after the rows are all claimed
  // returns at once.
  const int64_t bands = (rows + BAND - 1) / BAND;
  int64_t helpers = pool.num_threads();
  helpers = helpers < bands - 1 ? helpers : bands - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  // Bands claimed by a helper may still be running.
  while (work->done.load(std::memory_order_acquire) < rows) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DualvpCpuStats, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("has_keep")
                                  .Attr<bool>("with_entropy")
                                  .Attr<float>("tau"));
