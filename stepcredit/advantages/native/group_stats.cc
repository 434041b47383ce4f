// Group statistics and group normalisation in a few passes over the elements:
// the CPU kernels behind `group._group_stats` and `group._normalize` (GRPO,
// GiGPO, iStar and the other group estimators).
//
// For each group g of valid elements (ids outside [0, num_groups) are dropped
// from the sums and read the nearest group, as XLA's scatter and gather do):
//
//   e_g     = clip(frexp exponent of max |v|, -125, 126),  s_g = 2^-e_g
//   count_g = sum 1,   m_g = sum s_g v / max(count_g, 1)
//   sq_g    = sum (s_g v - m_g)^2
//   mean_g  = m_g / s_g
//   std_unbiased_g = sqrt(sq_g / max(count_g - 1, 1)) / s_g if count_g >= 2 else 0
//   std_biased_g   = sqrt(sq_g / max(count_g, 1)) / s_g
//   equal_g = max v <= min v   (every valid member equal; true when empty)
//
// `GroupStats` writes all but equal_g at every element; `GroupNormalize` writes
// `group._normalize`'s advantage (v - mean) / (std + eps) with its rules for
// all-equal and singleton groups, 0 where invalid. Sums run in float32 over
// runs of adjacent elements of a group, eight partial sums at a time: the
// pure-JAX path's numbers to float32 rounding. XLA:CPU instead runs a scatter
// and a gather per statistic, serial loops whose adds each wait on the last.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 8;

// Visits each run of consecutive elements [begin, end) with one id g in
// [0, used): `run(g, begin, end)`; ids outside are skipped. A group's rows are
// usually adjacent, so runs are long and each is reduced in vector registers,
// kLanes elements at a time (a sum through memory, element by element, waits
// on the previous element's add, as XLA:CPU's scatter does). When runs are
// short on average (GiGPO's step groups), finding them would mispredict a
// branch per element: each element is then its own run, and an id outside
// goes to the slot `dump`.
constexpr int64_t kShortRun = 2 * kLanes;

template <typename Run>
void ForRuns(const int32_t* id, int64_t n, int64_t used, bool by_element, int64_t dump, Run run) {
  if (by_element) {
    for (int64_t i = 0; i < n; ++i) run(id[i] >= 0 && id[i] < used ? id[i] : dump, i, i + 1);
    return;
  }
  int64_t i = 0;
  while (i < n) {
    const int32_t g = id[i];
    const int64_t begin = i;
    while (i < n && id[i] == g) ++i;
    if (g >= 0 && g < used) run(g, begin, i);
  }
}

// x where ok, else `otherwise`, by bit masks rather than a branch (random
// masks mispredict) or a select on a bool (which the compiler does not
// vectorise); NaN-safe, unlike a multiplication by the mask.
inline float Keep(float x, bool ok, float otherwise) {
  uint32_t xb, ob;
  std::memcpy(&xb, &x, 4);
  std::memcpy(&ob, &otherwise, 4);
  const uint32_t mask = 0u - static_cast<uint32_t>(ok);
  const uint32_t out = (xb & mask) | (ob & ~mask);
  float result;
  std::memcpy(&result, &out, 4);
  return result;
}

// Sums over [begin, end) in kLanes interleaved partial sums (vector
// registers), added pairwise at the end: as accurate as the element-order sum.
// Each element is read unconditionally and selected, so that the loops
// vectorise; kept out of line, where the compiler sees no aliasing.
float AddLanes(float* lanes) {
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int k = 0; k < width; ++k) lanes[k] += lanes[k + width];
  }
  return lanes[0];
}

// sum over valid i of v_i s.
__attribute__((noinline)) float ScaledSum(const float* v, const bool* ok, int64_t begin,
                                          int64_t end, float s) {
  float lanes[kLanes] = {}, rest = 0.0f;
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      lanes[k] += Keep(v[i + k] * s, ok[i + k], 0.0f);
    }
  }
  for (; i < end; ++i) {
    rest += Keep(v[i] * s, ok[i], 0.0f);
  }
  return AddLanes(lanes) + rest;
}

// sum over valid i of (v_i s - mean)^2.
__attribute__((noinline)) float SquaredDeviationSum(const float* v, const bool* ok,
                                                    int64_t begin, int64_t end, float s,
                                                    float mean) {
  float lanes[kLanes] = {}, rest = 0.0f;
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float d = v[i + k] * s - mean;
      lanes[k] += Keep(d * d, ok[i + k], 0.0f);
    }
  }
  for (; i < end; ++i) {
    const float d = v[i] * s - mean;
    rest += Keep(d * d, ok[i], 0.0f);
  }
  return AddLanes(lanes) + rest;
}

// The first pass's per-group values: max |v|, max v, min v over valid members,
// their count, and whether one is NaN.
struct Extremes {
  float largest = 0.0f, high = -std::numeric_limits<float>::infinity(),
        low = std::numeric_limits<float>::infinity();
  int32_t count = 0;
  bool nan = false;

  void Add(float x, bool valid) {
    const float y = Keep(x, valid, 0.0f);
    nan |= y != y;
    largest = std::max(largest, std::fabs(y));
    high = std::max(high, Keep(x, valid, -std::numeric_limits<float>::infinity()));
    low = std::min(low, Keep(x, valid, std::numeric_limits<float>::infinity()));
    count += valid;
  }
};

// Extremes of [begin, end) merged into e, in kLanes lanes of each quantity.
__attribute__((noinline)) void AddExtremes(const float* v, const bool* ok, int64_t begin,
                                           int64_t end, Extremes& e) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  float largest[kLanes], high[kLanes], low[kLanes];
  int32_t count[kLanes] = {}, nan[kLanes] = {};
  for (int k = 0; k < kLanes; ++k) largest[k] = e.largest, high[k] = e.high, low[k] = e.low;
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const float x = v[i + k];
      const bool valid = ok[i + k];
      const float y = Keep(x, valid, 0.0f);
      nan[k] |= y != y;
      largest[k] = std::max(largest[k], std::fabs(y));
      high[k] = std::max(high[k], Keep(x, valid, -inf));
      low[k] = std::min(low[k], Keep(x, valid, inf));
      count[k] += valid;
    }
  }
  for (; i < end; ++i) e.Add(v[i], ok[i]);
  for (int k = 0; k < kLanes; ++k) {
    e.largest = std::max(e.largest, largest[k]), e.high = std::max(e.high, high[k]);
    e.low = std::min(e.low, low[k]), e.count += count[k], e.nan |= nan[k] != 0;
  }
}

inline float SafeSqrt(float x) { return x > 0.0f ? std::sqrt(x) : 0.0f; }

// Per-group statistics (the module comment's mean_g, std_g, count_g, equal_g).
struct Stats {
  std::vector<float> mean, std_unbiased, std_biased, count;
  std::vector<char> equal;
};

// Per-group statistics of groups 0 .. used - 1 (used = 1 + the largest id in
// range) and, at index used, those of an empty group: ids up to num_groups
// are possible but often far fewer occur (GiGPO's step groups), so the work
// and memory follow the ids that occur. Index used + 1 takes the writes of
// out-of-range ids when elements are visited one by one.
Stats Compute(const float* v, const int32_t* id, const bool* ok, int64_t n, int64_t num_groups) {
  // Two branch-free loops, so that they vectorise.
  const int32_t bound = static_cast<int32_t>(std::min<int64_t>(num_groups, INT32_MAX));
  int32_t top = -1;
  for (int64_t i = 0; i < n; ++i) top = std::max(top, id[i] < bound ? id[i] : -1);
  int64_t changes = 0;
  for (int64_t i = 1; i < n; ++i) changes += id[i] != id[i - 1];
  const int64_t used = static_cast<int64_t>(top) + 1;
  const bool by_element = n < kShortRun * (changes + 1);
  const int64_t dump = used + 1;
  num_groups = used + 2;
  std::vector<Extremes> extremes(num_groups);
  std::vector<float> scale(num_groups), total(num_groups, 0.0f), squares(num_groups, 0.0f);
  ForRuns(id, n, used, by_element, dump, [&](int32_t g, int64_t begin, int64_t end) {
    if (end - begin >= kShortRun) return AddExtremes(v, ok, begin, end, extremes[g]);
    for (int64_t i = begin; i < end; ++i) extremes[g].Add(v[i], ok[i]);
  });
  for (int64_t g = 0; g < num_groups; ++g) {
    int exponent = 0;  // XLA's frexp of NaN and inf
    const Extremes& e = extremes[g];
    if (!e.nan && std::isfinite(e.largest)) std::frexp(e.largest, &exponent);
    scale[g] = std::ldexp(1.0f, -std::clamp(exponent, -125, 126));
  }
  ForRuns(id, n, used, by_element, dump, [&](int32_t g, int64_t begin, int64_t end) {
    const float s = scale[g];
    if (end - begin >= kShortRun) {
      total[g] += ScaledSum(v, ok, begin, end, s);
      return;
    }
    for (int64_t i = begin; i < end; ++i) total[g] += Keep(v[i] * s, ok[i], 0.0f);
  });
  for (int64_t g = 0; g < num_groups; ++g) {  // the scaled mean m_g
    total[g] = extremes[g].nan ? std::numeric_limits<float>::quiet_NaN()
                               : total[g] / std::max(static_cast<float>(extremes[g].count), 1.0f);
  }
  ForRuns(id, n, used, by_element, dump, [&](int32_t g, int64_t begin, int64_t end) {
    const float s = scale[g], mean = total[g];
    if (end - begin >= kShortRun) {
      squares[g] += SquaredDeviationSum(v, ok, begin, end, s, mean);
      return;
    }
    for (int64_t i = begin; i < end; ++i) {
      const float d = v[i] * s - mean;
      squares[g] += Keep(d * d, ok[i], 0.0f);
    }
  });
  Stats stats{std::vector<float>(num_groups), std::vector<float>(num_groups),
              std::vector<float>(num_groups), std::vector<float>(num_groups),
              std::vector<char>(num_groups)};
  for (int64_t g = 0; g < num_groups; ++g) {
    const Extremes& e = extremes[g];
    const float c = static_cast<float>(e.count);
    const float var_unbiased = c >= 2.0f ? squares[g] / std::max(c - 1.0f, 1.0f) : 0.0f;
    stats.mean[g] = total[g] / scale[g];
    stats.std_unbiased[g] = SafeSqrt(var_unbiased) / scale[g];
    stats.std_biased[g] = SafeSqrt(squares[g] / std::max(c, 1.0f)) / scale[g];
    stats.count[g] = c;
    stats.equal[g] = !e.nan && e.high <= e.low;
  }
  return stats;
}

// A gather's index: negative ids count from the end, then clamp; a group that
// does not occur reads the empty group's slot of `stats` (next to last).
inline int64_t ReadIndex(int32_t id, int64_t num_groups, const Stats& stats) {
  const int64_t g = std::clamp<int64_t>(id < 0 ? id + num_groups : id, 0, num_groups - 1);
  return std::min<int64_t>(g, stats.count.size() - 2);
}

ffi::Error CheckSizes(int64_t n, int64_t ids, int64_t valid, int64_t num_groups) {
  if (ids != n || valid != n || num_groups < 1) {
    return ffi::Error::InvalidArgument("group_stats: values, ids and valid disagree in size");
  }
  return ffi::Error::Success();
}

ffi::Error GroupStats(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> ids,
                      ffi::Buffer<ffi::PRED> valid, int64_t num_groups,
                      ffi::ResultBuffer<ffi::F32> mean, ffi::ResultBuffer<ffi::F32> std_unbiased,
                      ffi::ResultBuffer<ffi::F32> std_biased, ffi::ResultBuffer<ffi::F32> count) {
  const int64_t n = values.element_count();
  ffi::Error error = CheckSizes(n, ids.element_count(), valid.element_count(), num_groups);
  if (error.failure()) return error;
  const int32_t* id = ids.typed_data();
  const Stats stats = Compute(values.typed_data(), id, valid.typed_data(), n, num_groups);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = ReadIndex(id[i], num_groups, stats);
    mean->typed_data()[i] = stats.mean[g];
    std_unbiased->typed_data()[i] = stats.std_unbiased[g];
    std_biased->typed_data()[i] = stats.std_biased[g];
    count->typed_data()[i] = stats.count[g];
  }
  return ffi::Error::Success();
}

// std: 0 unbiased, 1 biased, 2 none; raw_singleton: a one-member group keeps
// v / raw_divisor (raw_divisor = 1 + eps, or 1 under std "none").
ffi::Error GroupNormalize(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> ids,
                          ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::F32> eps_buffer,
                          ffi::Buffer<ffi::F32> raw_divisor_buffer, int64_t num_groups,
                          int64_t std_kind, bool raw_singleton,
                          ffi::ResultBuffer<ffi::F32> advantages) {
  const int64_t n = values.element_count();
  ffi::Error error = CheckSizes(n, ids.element_count(), valid.element_count(), num_groups);
  if (error.failure()) return error;
  const float* v = values.typed_data();
  const int32_t* id = ids.typed_data();
  const bool* ok = valid.typed_data();
  const float eps = eps_buffer.typed_data()[0], raw_divisor = raw_divisor_buffer.typed_data()[0];
  const Stats stats = Compute(v, id, ok, n, num_groups);
  const std::vector<float>& stds = std_kind == 0 ? stats.std_unbiased : stats.std_biased;
  float* out = advantages->typed_data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = ReadIndex(id[i], num_groups, stats);
    const float centered = v[i] - stats.mean[g];
    float a = centered;
    if (std_kind != 2) {
      const float scale = stds[g] + eps;
      a = scale > 0.0f ? centered / scale : 0.0f;
    }
    if (stats.equal[g]) a = 0.0f;
    if (raw_singleton && stats.count[g] == 1.0f) a = v[i] / raw_divisor;
    out[i] = ok[i] ? a : 0.0f;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditGroupStatsF32, GroupStats,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values [n]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // ids [n]
                                  .Arg<ffi::Buffer<ffi::PRED>>()   // valid [n]
                                  .Attr<int64_t>("num_groups")
                                  .Ret<ffi::Buffer<ffi::F32>>()    // mean [n]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // std_unbiased [n]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // std_biased [n]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // count [n]

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditGroupNormalizeF32, GroupNormalize,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // values [n]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // ids [n]
                                  .Arg<ffi::Buffer<ffi::PRED>>()   // valid [n]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // eps []
                                  .Arg<ffi::Buffer<ffi::F32>>()    // raw_divisor []
                                  .Attr<int64_t>("num_groups")
                                  .Attr<int64_t>("std_kind")
                                  .Attr<bool>("raw_singleton")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // advantages [n]
