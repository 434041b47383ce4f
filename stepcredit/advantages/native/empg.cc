// EMPG's entropy modulation in four passes over batch-major [B, T] arrays: the CPU
// kernel behind `empg.empg` on one device.
//
// Over the valid steps (mask true), with H the step entropy and A the advantage
// (per step, or per row when A holds B values):
//
//   H~ = (H - min H) / (max H - min H + eps)
//   g  = exp(-k H~) / mean exp(-k H~),     f = exp(-k_future H~)
//   A' = g A + zeta f[next valid step of the row]   (no bonus on a row's last one)
//   out = A' - mean A' (center) or A', and 0 at invalid steps.
//
// XLA:CPU runs these as about twenty kernels over the B x T elements (five
// reductions, the next-valid recurrence and the element-wise steps between),
// each a round trip through memory and, above a few ten thousand elements, a
// hand-off to its thread pool. Here the two exponentials and the statistics
// take two vectorised passes, the bonus one pass per row, the centring one more.
// The exponential is a degree-6 polynomial after range reduction (within three
// units in the last place of the exact value over [-87, 88.5]), and the sums run
// in double, so the result equals the XLA path's to float32 rounding, not bit for
// bit. A NaN entropy at a valid step makes every valid output NaN, as XLA's min
// and max propagate it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "simd.h"

namespace ffi = xla::ffi;
using namespace stepcredit;  // NOLINT: the shared vector helpers

namespace {

// Sums of floats run in eight float lanes for kBlock elements, then in double,
// so that no lane adds up more than kBlock / 8 terms in float.
constexpr int64_t kBlock = 1024;

float Sum(f32x8 x) { return Fold(x, [](f32x8 a, f32x8 b) { return a + b; }); }

ffi::Error Empg(ffi::Buffer<ffi::F32> advantages, ffi::Buffer<ffi::F32> entropy,
                ffi::Buffer<ffi::PRED> mask, float k, float k_future, float zeta, float eps,
                bool center, ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = entropy.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("empg: entropy must be [B, T]");
  const int64_t rows = dims[0], length = dims[1], n = rows * length;
  const bool per_row = advantages.element_count() == rows;
  if (!per_row && advantages.element_count() != n) {
    return ffi::Error::InvalidArgument("empg: advantages must be [B] or [B, T]");
  }
  // The vector passes run over whole blocks of eight: the arrays are copied, padded
  // with invalid steps, into per-thread buffers.
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  struct Buffers {
    std::vector<float> entropy, advantages, modulated, bonus;
    std::vector<uint8_t> valid;
  };
  Buffers& kept = PerThread<Buffers>();
  for (auto* buffer : {&kept.entropy, &kept.advantages, &kept.modulated, &kept.bonus}) {
    buffer->resize(padded);
    std::fill(buffer->begin() + n, buffer->end(), 0.0f);
  }
  kept.valid.resize(padded);
  std::fill(kept.valid.begin() + n, kept.valid.end(), 0);
  float* h = kept.entropy.data();
  float* a = kept.advantages.data();  // one per step
  float* y = kept.modulated.data();
  float* bonus = kept.bonus.data();
  uint8_t* valid = kept.valid.data();
  std::memcpy(h, entropy.typed_data(), n * sizeof(float));
  std::memcpy(valid, mask.typed_data(), n);
  if (per_row) {
    for (int64_t b = 0; b < rows; ++b) {
      std::fill(a + b * length, a + (b + 1) * length, advantages.typed_data()[b]);
    }
  } else {
    std::memcpy(a, advantages.typed_data(), n * sizeof(float));
  }

  const float inf = std::numeric_limits<float>::infinity();
  i32x8 count = {0, 0, 0, 0, 0, 0, 0, 0}, nan = count;
  f32x8 low = Splat(inf), high = Splat(-inf);
  for (int64_t i = 0; i < padded; i += kLanes) {
    const i32x8 keep = LoadMask(valid + i);
    const f32x8 x = Load(h + i);
    count -= keep;
    nan |= keep & (x != x);
    low = keep & (x < low) ? x : low;
    high = keep & (x > high) ? x : high;
  }
  const int64_t total = Fold(count, [](i32x8 p, i32x8 q) { return p + q; });
  if (total == 0) {
    std::memset(out->typed_data(), 0, n * sizeof(float));
    return ffi::Error::Success();
  }
  float lowest = Fold(low, [](f32x8 p, f32x8 q) { return p < q ? p : q; });
  float highest = Fold(high, [](f32x8 p, f32x8 q) { return p > q ? p : q; });
  if (Fold(nan, [](i32x8 p, i32x8 q) { return p | q; })) {
    lowest = highest = std::numeric_limits<float>::quiet_NaN();
  }
  const f32x8 shift = Splat(lowest), range = Splat(highest - lowest + eps);
  const f32x8 zeros = Splat(0.0f);

  // y holds exp(-k H~) and bonus zeta exp(-k_future H~) until the next pass.
  double scale_sum = 0.0;
  for (int64_t begin = 0; begin < padded; begin += kBlock) {
    const int64_t end = std::min(begin + kBlock, padded);
    f32x8 block = zeros;
    for (int64_t i = begin; i < end; i += kLanes) {
      const i32x8 keep = LoadMask(valid + i);
      const f32x8 normalised = Keep(keep, (Load(h + i) - shift) / range);
      const f32x8 scale = Exp(-k * normalised);
      const f32x8 clarity = zeta * Exp(-k_future * normalised);
      std::memcpy(bonus + i, &clarity, sizeof clarity);
      std::memcpy(y + i, &scale, sizeof scale);
      block += Keep(keep, scale);
    }
    scale_sum += Sum(block);
  }
  const float mean_scale = static_cast<float>(scale_sum / static_cast<double>(total));

  const f32x8 mean_scales = Splat(mean_scale);
  for (int64_t i = 0; i < padded; i += kLanes) {
    const i32x8 keep = LoadMask(valid + i);
    const f32x8 modulated = Load(y + i) / mean_scales * Keep(keep, Load(a + i));
    std::memcpy(y + i, &modulated, sizeof modulated);
  }
  // zeta f of each row's next valid step, carried back along the row.
  for (int64_t b = 0; b < rows; ++b) {
    float next = 0.0f;
    for (int64_t i = (b + 1) * length - 1; i >= b * length; --i) {
      y[i] = Keep(valid[i], y[i] + next);
      next = valid[i] ? bonus[i] : next;
    }
  }
  double modulated_sum = 0.0;
  if (center) {
    for (int64_t begin = 0; begin < padded; begin += kBlock) {
      const int64_t end = std::min(begin + kBlock, padded);
      f32x8 block = zeros;
      for (int64_t i = begin; i < end; i += kLanes) block += Load(y + i);
      modulated_sum += Sum(block);
    }
  }
  const f32x8 mean = Splat(static_cast<float>(modulated_sum / static_cast<double>(total)));
  float* result = out->typed_data();
  for (int64_t i = 0; i + kLanes <= n; i += kLanes) {
    const f32x8 centred = Keep(LoadMask(valid + i), Load(y + i) - mean);
    std::memcpy(result + i, &centred, sizeof centred);
  }
  for (int64_t i = n / kLanes * kLanes; i < n; ++i) result[i] = Keep(valid[i], y[i] - mean[0]);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditEmpgF32, Empg,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // advantages [B] or [B, T]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // entropy [B, T]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [B, T]
                                  .Attr<float>("k")
                                  .Attr<float>("k_future")
                                  .Attr<float>("zeta")
                                  .Attr<float>("eps")
                                  .Attr<bool>("center")
                                  .Ret<ffi::Buffer<ffi::F32>>()); // [B, T]
