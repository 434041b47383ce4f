// Masked GAE over batch-major rows in one pass: the CPU kernel behind
// `step_gae(..., method="native")` and `token_gae(..., method="native")`.
//
// Per row, backwards in time, with z = gamma V + gamma lam A carried through
// masked positions (the one-recurrence form of stepcredit/advantages/gae.py):
//
//   A_t = r_t - V_t + z_{t+1},   R_t = r_t + z_{t+1}         (0 where masked)
//   z_t = x_t + c_t z_{t+1},     x_t = gamma lam r_t + gamma (1 - lam) V_t,
//                                c_t = gamma lam             (valid t)
//   z_t = z_{t+1}                                            (masked t)
//   z_T = gamma * bootstrap_value.
//
// Eight time steps at a time are solved in SIMD registers by recursive
// doubling (three shifts), so the only serial dependency left is one
// multiply-add per eight steps; two rows are interleaved to hide its latency, and
// a large batch's rows are shared among XLA's CPU threads.
// Masked inputs may hold NaN: they are cleared with bit masks, never multiplied.

#include <sys/mman.h>

#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using stepcredit::ByRows;

namespace {

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

constexpr int kLanes = 8;
constexpr int kRows = 2;

struct Coefficients {
  float gamma, decay, value_weight;  // gamma, gamma lam, gamma (1 - lam)
};

struct Row {
  const float* rewards;
  const float* values;
  const bool* mask;
  float* advantages;
  float* returns;
  float z;
};

// Lane k of the result is lane k + S of `a`, `fill` past the last lane.
// (__builtin_shufflevector is clang's and GCC >= 12's; older GCC has __builtin_shuffle.)
template <int S>
inline f32x8 ShiftDown(f32x8 a, f32x8 fill) {
#if defined(__clang__) || __GNUC__ >= 12
  return __builtin_shufflevector(a, fill, S, S + 1, S + 2, S + 3, S + 4, S + 5, S + 6, S + 7);
#else
  const i32x8 lanes = {S, S + 1, S + 2, S + 3, S + 4, S + 5, S + 6, S + 7};
  return __builtin_shuffle(a, fill, lanes);
#endif
}
inline f32x8 Keep(i32x8 valid, f32x8 a) { return (f32x8)(valid & (i32x8)a); }

inline void Step(Row& row, int64_t t, const Coefficients& k) {
  if (!row.mask[t]) {
    row.advantages[t] = 0.0f;
    row.returns[t] = 0.0f;
    return;
  }
  const float r = row.rewards[t], v = row.values[t];
  row.advantages[t] = r - v + row.z;
  row.returns[t] = r + row.z;
  row.z = k.decay * r + k.value_weight * v + k.decay * row.z;
}

// Steps t .. t + 7 of one row.
inline void Block(Row& row, int64_t t, const Coefficients& k) {
  const f32x8 zeros = {0, 0, 0, 0, 0, 0, 0, 0};
  const f32x8 ones = zeros + 1.0f;
  f32x8 r, v;
  u8x8 mask_bytes;
  std::memcpy(&r, row.rewards + t, sizeof r);
  std::memcpy(&v, row.values + t, sizeof v);
  std::memcpy(&mask_bytes, row.mask + t, sizeof mask_bytes);
  // Compare bytes, then widen: GCC turns this order into one sign extension,
  // and the opposite order into eight scalar inserts.
  const i32x8 valid = __builtin_convertvector((i8x8)(mask_bytes != 0), i32x8);
  // After the doubling, x_k + c_k z solves the block from lane k to its end.
  f32x8 x = Keep(valid, k.decay * r + k.value_weight * v);
  f32x8 c = valid ? k.decay + zeros : ones;
  x += c * ShiftDown<1>(x, zeros);
  c *= ShiftDown<1>(c, ones);
  x += c * ShiftDown<2>(x, zeros);
  c *= ShiftDown<2>(c, ones);
  x += c * ShiftDown<4>(x, zeros);
  c *= ShiftDown<4>(c, ones);
  const f32x8 z = x + c * row.z;
  const f32x8 z_next = ShiftDown<1>(z, zeros + row.z);
  const f32x8 advantages = Keep(valid, r - v + z_next);
  const f32x8 returns = Keep(valid, r + z_next);
  std::memcpy(row.advantages + t, &advantages, sizeof advantages);
  std::memcpy(row.returns + t, &returns, sizeof returns);
  row.z = z[0];
}

template <int N>
void Rows(Row* rows, int64_t length, const Coefficients& k) {
  int64_t t = length;
  while (t % kLanes != 0) {
    --t;
    for (int j = 0; j < N; ++j) Step(rows[j], t, k);
  }
  for (t -= kLanes; t >= 0; t -= kLanes) {
    for (int j = 0; j < N; ++j) Block(rows[j], t, k);
  }
}

// XLA:CPU maps large outputs afresh on every call; faulting them in 4 KiB
// pages costs more than the kernel, so ask for huge pages, as NumPy does.
void AdviseHugePages(void* data, int64_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < static_cast<int64_t>(2 * kHuge)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

ffi::Error MaskedGae(ffi::Buffer<ffi::F32> rewards, ffi::Buffer<ffi::F32> values,
                     ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::F32> bootstrap_value,
                     float gamma, float lam, ffi::ResultBuffer<ffi::F32> advantages,
                     ffi::ResultBuffer<ffi::F32> returns, ffi::ThreadPool pool) {
  const auto dims = rewards.dimensions();
  if (dims.size() == 0) return ffi::Error::InvalidArgument("masked_gae: rewards must be [..., T]");
  const int64_t length = dims.back();
  const int64_t num_rows = bootstrap_value.element_count();
  if (rewards.element_count() != num_rows * length ||
      values.element_count() != rewards.element_count() ||
      mask.element_count() != rewards.element_count()) {
    return ffi::Error::InvalidArgument("masked_gae: inputs disagree in shape");
  }
  AdviseHugePages(advantages->typed_data(), advantages->size_bytes());
  AdviseHugePages(returns->typed_data(), returns->size_bytes());
  const Coefficients k{gamma, gamma * lam, gamma - gamma * lam};
  auto row = [&](int64_t b) {
    const int64_t offset = b * length;
    return Row{rewards.typed_data() + offset,     values.typed_data() + offset,
               mask.typed_data() + offset,        advantages->typed_data() + offset,
               returns->typed_data() + offset,    gamma * bootstrap_value.typed_data()[b]};
  };
  ByRows<kRows>(pool, num_rows, length, [&](int64_t b, auto count) {
    constexpr int n = decltype(count)::value;
    Row rows[n];
    for (int j = 0; j < n; ++j) rows[j] = row(b + j);
    Rows<n>(rows, length, k);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditMaskedGaeF32, MaskedGae,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // rewards [..., T]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // values [..., T]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [..., T]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bootstrap_value [...]
                                  .Attr<float>("gamma")
                                  .Attr<float>("lam")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // advantages
                                  .Ret<ffi::Buffer<ffi::F32>>()   // returns
                                  .Ctx<ffi::ThreadPool>());
