// A measurement prototype, not part of any package: the masked statistics of
// spec.block_stats(kept_shift="max", with_entropy=True), (m, s, t, sk), for
// float32 rows [N, V] with a bool keep mask, as one XLA FFI custom call: per
// row, one pass for the max and one pass that forms e = exp(z - m) once and
// accumulates s, t and sk from it (what XLA:CPU cannot do: it runs each row
// reduction as a library call over a materialised input). It restates the
// spec's formulas (no target logit, no temperature, no NaN marking): it
// exists to measure what a custom CPU kernel would give dualvp_jax
// (benchmarks/ffi_stats_prototype.py; docs/measurements.md, sixteenth
// session), not to be used.
//
// Build: g++ -O3 -march=native -fopenmp -shared -fPIC -std=c++17 \
//          -I$(python -c "import jax.ffi; print(jax.ffi.include_dir())") \
//          ffi_stats_prototype.cc -o libffi_stats_prototype.so
#include <cmath>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// e^x for x <= 0: Cephes' single-precision range reduction and polynomial,
// with the rounding done by the 1.5 * 2^23 trick so that the loop vectorises.
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
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
  return p * scale;
}

static ffi::Error StatsImpl(ffi::Buffer<ffi::F32> z, ffi::Buffer<ffi::PRED> keep, ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = z.dimensions()[0], v = z.dimensions()[1];
  const float* __restrict zp = z.typed_data();
  const uint8_t* __restrict kp = reinterpret_cast<const uint8_t*>(keep.typed_data());
  float* __restrict o = out->typed_data();
  const float tiny = 1.17549435e-38f;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    const float* __restrict zr = zp + r * v;
    const uint8_t* __restrict kr = kp + r * v;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < v; ++j) m = zr[j] > m ? zr[j] : m;
    const float shift = m == -INFINITY ? 0.0f : m;
    // float lane sums (the loop's vector lanes, then their sum): see the
    // script for their error against float64
    float s = 0.0f, t = 0.0f, sk = 0.0f;
#pragma omp simd reduction(+ : s, t, sk)
    for (int64_t j = 0; j < v; ++j) {
      const float d = zr[j] - shift;
      const float e = d < -87.0f ? 0.0f : exp_nonpositive(d);
      s += e;
      t += e > 0.0f ? e * d : 0.0f;
      sk += kr[j] ? (e > tiny ? e : tiny) : 0.0f;
    }
    o[r * 4 + 0] = m;
    o[r * 4 + 1] = s;
    o[r * 4 + 2] = t;
    o[r * 4 + 3] = sk;
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaskedStats, StatsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
