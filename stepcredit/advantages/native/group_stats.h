// One group's statistics and the advantage they give an element, as `group._normalize`
// computes them: shared by the group kernel (`group_normalize.cc`) and the anchor-group
// kernel (`anchor_groups.cc`). A source that includes this header compiles without fused
// multiply-adds (`fp-contract=off`), so that every operation rounds as XLA's does.

#ifndef STEPCREDIT_NATIVE_GROUP_STATS_H_
#define STEPCREDIT_NATIVE_GROUP_STATS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd.h"

namespace stepcredit {

// kLeaveOneOut: (v - mean) n / max(n - 1, 1), RLOO's centring (no std, no eps).
enum Std : int32_t { kUnbiased = 0, kBiased = 1, kNone = 2, kLeaveOneOut = 3 };

// A group's accumulators. `epoch` names the call that last reset it, so a call
// resets only the groups it meets, when it first meets them.
struct Group {
  float count, largest, high, low;  // largest: max |v|
  float total, squares, scale;
  int64_t last;  // the index of its last element
  uint64_t epoch;
};

// 2^-e for the exponent e of frexp(largest) (largest = m 2^e, m in [0.5, 1)), e
// clipped to [-125, 126]; e = 0 for 0, an infinity or a NaN. Read off the float's
// bits: frexp and ldexp are library calls, a sixth of the kernel's time where
// groups have a few members each.
inline float ScaleOf(float largest) {
  uint32_t bits;
  std::memcpy(&bits, &largest, sizeof bits);
  const int32_t biased = static_cast<int32_t>((bits >> 23) & 0xff);
  // A subnormal's exponent is below -125 and clips to it.
  const int32_t exponent = largest == 0.0f || biased == 0xff ? 0
                           : biased == 0                    ? -125
                                                             : std::clamp(biased - 126, -125, 126);
  const uint32_t scale_bits = static_cast<uint32_t>(127 - exponent) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return scale;
}

// Once `total` holds the mean of the scaled values and `squares` the sum of their squared
// deviations: `total` becomes the mean, `squares` the divisor (1 for std "none": x / 1 is
// x; n - 1 for leave-one-out, whose factor is `count`), `scale` the output's rule: 0 all
// equal (or no valid member), 1 a singleton kept raw, 2 normalised.
inline void Finish(int32_t std_mode, float eps, bool singleton_raw, Group& group) {
  const float variance =
      std_mode == kUnbiased
          ? (group.count >= 2.0f ? group.squares / std::max(group.count - 1.0f, 1.0f) : 0.0f)
          : group.squares / std::max(group.count, 1.0f);
  const float root = variance > 0.0f ? std::sqrt(variance) : 0.0f;
  group.total = group.total / group.scale;
  group.squares = std_mode == kLeaveOneOut ? std::max(group.count - 1.0f, 1.0f)
                  : std_mode == kNone      ? 1.0f
                                           : root / group.scale + eps;
  group.scale = singleton_raw && group.count == 1.0f ? 1.0f : group.high <= group.low ? 0.0f : 2.0f;
}

// The advantage of a valid element of value v in a finished group, under the group's rule.
inline float Advantage(const Group& group, float rule, int32_t std_mode, float raw_divisor,
                       float v) {
  const float factor = std_mode == kLeaveOneOut ? group.count : 1.0f;
  const float quotient = group.squares > 0.0f ? (v - group.total) * factor / group.squares : 0.0f;
  return rule == 2.0f ? quotient : rule == 1.0f ? v / raw_divisor : 0.0f;
}

// One group of n values normalised in order, value(k) for k in [0, n), valid(k) whether k
// counts: the finished group (`Finish`), whose `scale` holds the rule for `Advantage`.
template <typename Value, typename Valid>
Group NormalizedGroup(int64_t n, const Value& value, const Valid& valid, int32_t std_mode,
                      float eps, bool singleton_raw) {
  const float inf = std::numeric_limits<float>::infinity();
  Group group{0.0f, 0.0f, -inf, inf, 0.0f, 0.0f, 1.0f, 0, 0};
  for (int64_t k = 0; k < n; ++k) {
    if (!valid(k)) continue;
    const float v = value(k);
    group.count += 1.0f;
    group.largest = Max(group.largest, std::fabs(v));
    group.high = Max(group.high, v);
    group.low = Min(group.low, v);
  }
  group.scale = ScaleOf(group.largest);
  for (int64_t k = 0; k < n; ++k) {
    if (valid(k)) group.total += value(k) * group.scale;
  }
  group.total = group.total / std::max(group.count, 1.0f);
  for (int64_t k = 0; k < n; ++k) {
    if (!valid(k)) continue;
    const float deviation = value(k) * group.scale - group.total;
    group.squares += deviation * deviation;
  }
  Finish(std_mode, eps, singleton_raw, group);
  return group;
}

}  // namespace stepcredit

#endif  // STEPCREDIT_NATIVE_GROUP_STATS_H_
