// What the kernels share: per-thread buffers, eight-lane float vectors, and the
// loads, selects and reductions over them (GCC and Clang vector extensions, which
// compile to whatever vector instructions -march=native offers).

#ifndef STEPCREDIT_NATIVE_SIMD_H_
#define STEPCREDIT_NATIVE_SIMD_H_

#include <cstdint>
#include <cstring>

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

}  // namespace stepcredit

#endif  // STEPCREDIT_NATIVE_SIMD_H_
