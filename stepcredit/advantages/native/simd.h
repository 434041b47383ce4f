// What the kernels share: per-thread buffers, eight-lane float vectors, and the
// loads, selects, reductions and exponential over them (GCC and Clang vector extensions, which
// compile to whatever vector instructions -march=native offers).

#ifndef STEPCREDIT_NATIVE_SIMD_H_
#define STEPCREDIT_NATIVE_SIMD_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace stepcredit {

// Buffers kept between calls, one set per thread (a fresh allocation this size
// costs more in page faults than the kernel does). A kernel reaches them once per
// call, through a reference: in a shared library every use of a thread_local
// variable is a call into the dynamic linker, which made the kernel half as slow.
template <typename T>
T& PerThread() {
  thread_local T value;
  return value;
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
constexpr int64_t kLanes = 8;

// max and min that keep a NaN, as XLA's do; `|`, not `||`, so that they compile to
// a compare and a blend: a new extreme comes at random, and a mispredicted branch
// costs more than the rest of the element's work.
inline float Max(float a, float b) { return (a > b) | (a != a) ? a : b; }
inline float Min(float a, float b) { return (a < b) | (a != a) ? a : b; }

inline f32x8 Load(const float* x) {
  f32x8 out;
  std::memcpy(&out, x, sizeof out);
  return out;
}
// All ones where the mask byte is set: compare bytes, then widen (one sign extension).
inline i32x8 LoadMask(const uint8_t* valid) {
  u8x8 bytes;
  std::memcpy(&bytes, valid, sizeof bytes);
  return __builtin_convertvector((i8x8)(bytes != 0), i32x8);
}
inline f32x8 Keep(i32x8 mask, f32x8 x) { return (f32x8)(mask & (i32x8)x); }
// x where the byte is set, else 0, without a branch: the mask is random, and a
// mispredicted branch per element would cost more than the rest of a pass.
inline float Keep(uint8_t valid, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits &= 0u - static_cast<uint32_t>(valid != 0);
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// op over the eight lanes of x, by three shuffles (runs of eight elements spend more
// in this reduction than in the pass over them).
template <typename Vector, typename Op>
auto Fold(Vector x, Op op) {
#if defined(__clang__) || __GNUC__ >= 12
  x = op(x, __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3));
  x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5));
  x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6));
#else
  const Vector lanes = x;
  for (int k = 1; k < kLanes; ++k) {
    Vector lane = lanes;
    for (int j = 0; j < kLanes; ++j) lane[j] = lanes[k];
    x = op(x, lane);
  }
#endif
  return x[0];
}

// y = a b + c, rounded once where the CPU fuses multiply-adds, as XLA:CPU compiles it.
inline float MultiplyAdd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

inline f32x8 Splat(float x) { return f32x8{x, x, x, x, x, x, x, x}; }

// sqrt lane by lane, each correctly rounded as the scalar sqrt is (one vector instruction
// where the compiler need not set errno: -fno-math-errno).
inline f32x8 Sqrt(f32x8 x) {
  for (int k = 0; k < kLanes; ++k) x[k] = std::sqrt(x[k]);
  return x;
}

// exp(x), eight lanes (within three units in the last place of the exact value over
// [-87, 88.5]): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor
// polynomial to degree 6 (relative error below 2e-7 on that range), times 2^n
// through the exponent bits. Below -87.3 it gives 0 (where float32's normal range
// ends), above 88.7 infinity, and NaN for NaN.
inline f32x8 Exp(f32x8 x) {
  const f32x8 kLog2e = Splat(1.44269504088896341f);
  const f32x8 kLn2Hi = Splat(0.693359375f);  // 9 bits: n * kLn2Hi is exact
  const f32x8 kLn2Lo = Splat(-2.12194440054690583e-4f);  // ln 2 - kLn2Hi
  const f32x8 kRound = Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const f32x8 low = Splat(-87.3f), high = Splat(88.7f);
  const f32x8 clamped = x < low ? low : (x > high ? high : x);
  const f32x8 n = (clamped * kLog2e + kRound) - kRound;
  const f32x8 r = (clamped - n * kLn2Hi) - n * kLn2Lo;
  f32x8 p = Splat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const f32x8 scaled = (f32x8)((i32x8)p + (__builtin_convertvector(n, i32x8) << 23));
  const f32x8 bounded = x < low ? Splat(0.0f)
                                : (x > high ? Splat(std::numeric_limits<float>::infinity()) : scaled);
  return x != x ? x : bounded;
}

}  // namespace stepcredit

#endif  // STEPCREDIT_NATIVE_SIMD_H_
