// Group normalisation in four passes over flat arrays: the CPU kernel behind
// `group._normalize`, which GRPO's family, GiGPO's step groups, MT-GRPO, GTPO,
// Kevin and IGPO share.
//
// For element i of group g = ids[i] (valid members only in every statistic):
//
//   s_g    = 2^-e_g, 2^e_g above the group's largest |v| (e_g clipped to
//            [-125, 126], as `group._group_stats` clips it)
//   mean_g = sum s_g v_i / n_g,   ss_g = sum (s_g v_i - mean_g)^2
//   std_g  = sqrt(ss_g / (n_g - 1)) / s_g  (unbiased; 0 when n_g < 2)
//          = sqrt(ss_g / n_g) / s_g        (biased)
//   out_i  = (v_i - mean_g / s_g) / (std_g + eps)   (0 where std_g + eps <= 0;
//            no division for std "none"; (v_i - mean_g / s_g) n_g / max(n_g - 1, 1)
//            for "leave_one_out"),
//            0 where the group's valid values are all equal, v_i (or
//            v_i / (1 + eps)) for a singleton under singleton "raw", and 0 at
//            invalid elements.
//
// Ids that change at nearly every element, in groups of several members (GiGPO's
// step groups: a few anchors per trajectory), have their valid elements first
// reordered group by group by a stable counting sort, so that each group's
// members are contiguous and their sums keep their order; the result is read
// back in the original order.
//
// XLA:CPU computes these statistics with six scatters and as many gathers over
// the B x T elements, each several times the cost of reading them. The sums
// run in element order, as XLA's scatter adds them, and every operation is the
// one `group._normalize` applies, without fused multiply-adds, so the two give
// the same float32 numbers. Ids outside [0, num_groups) are left out of the
// statistics and read the nearest group, as XLA's scatter and gather treat them.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "simd.h"
#include "group_stats.h"

namespace ffi = xla::ffi;
using namespace stepcredit;  // NOLINT: the shared vector helpers

namespace {

// A maximal stretch of equal ids.
struct Run {
  int64_t begin, end;
  int32_t slot;
};

// The sums advance kChunks chunks in lockstep, each a chain independent of the
// others. Chunks start near multiples of n / kChunks moved by kSkew elements
// each, since for power-of-two sizes the multiples would put every chunk's
// current element in one cache set.
constexpr int64_t kChunks = 8;
constexpr int64_t kSkew = 131;

// Count, max |v|, max and min of the valid elements of [begin, end) (order-free),
// eight at a time; a NaN is tracked apart and restored at the end.
void Extremes(const float* v, const uint8_t* valid, int64_t begin, int64_t end, Group& g) {
  const float inf = std::numeric_limits<float>::infinity();
  const f32x8 zeros = {0, 0, 0, 0, 0, 0, 0, 0};
  i32x8 count = {0, 0, 0, 0, 0, 0, 0, 0}, nan = count;
  f32x8 largest = zeros, high = zeros - inf, low = zeros + inf;
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    const i32x8 mask = LoadMask(valid + i);
    const f32x8 x = Load(v + i);
    count -= mask;
    nan |= mask & (x != x);
    const f32x8 magnitude = (f32x8)((i32x8)Keep(mask, x) & 0x7fffffff);
    largest = magnitude > largest ? magnitude : largest;
    high = (mask != 0) & (x > high) ? x : high;
    low = (mask != 0) & (x < low) ? x : low;
  }
  auto greater = [](f32x8 a, f32x8 b) { return a > b ? a : b; };
  auto less = [](f32x8 a, f32x8 b) { return a < b ? a : b; };
  int32_t total = Fold(count, [](i32x8 a, i32x8 b) { return a + b; });
  int32_t any_nan = Fold(nan, [](i32x8 a, i32x8 b) { return a | b; });
  float most = Fold(largest, greater), top = Fold(high, greater), bottom = Fold(low, less);
  for (; i < end; ++i) {
    if (!valid[i]) continue;
    ++total;
    any_nan |= v[i] != v[i];
    most = std::max(most, std::fabs(v[i]));
    top = std::max(top, v[i]);
    bottom = std::min(bottom, v[i]);
  }
  const float missing = std::numeric_limits<float>::quiet_NaN();
  g.count += static_cast<float>(total);
  g.largest = Max(g.largest, any_nan ? missing : most);
  g.high = Max(g.high, any_nan ? missing : top);
  g.low = Min(g.low, any_nan ? missing : bottom);
}

// Visits every element once: chunk c is [start[c], start[c + 1]); the chunks
// advance one element each in lockstep, then each finishes its remainder in
// order. Each chunk keeps the state of its current run of equal ids in
// registers: begin(state, id) loads it, add(state, i) adds element i,
// end(state, id) stores it back, so a run costs no memory round trip per
// element. Within a chunk, elements are visited in order.
template <int64_t Chunks, typename State, typename Begin, typename Add, typename End>
void Lockstep(const int32_t* id, const int64_t* start, Begin begin, Add add, End end) {
  State state[Chunks];
  int32_t current[Chunks];
  int64_t common = start[1] - start[0];
  for (int64_t c = 0; c < Chunks; ++c) {
    common = std::min(common, start[c + 1] - start[c]);
    current[c] = id[start[c]];
    begin(state[c], current[c]);
  }
  auto step = [&](int64_t c, int64_t i) {
    if (__builtin_expect(id[i] != current[c], 0)) {
      end(state[c], current[c]);
      current[c] = id[i];
      begin(state[c], current[c]);
    }
    add(state[c], i);
  };
  for (int64_t k = 0; k < common; ++k) {
#pragma GCC unroll 8
    for (int64_t c = 0; c < Chunks; ++c) step(c, start[c] + k);
  }
  for (int64_t c = 0; c < Chunks; ++c) {
    for (int64_t i = start[c] + common; i < start[c + 1]; ++i) step(c, i);
    end(state[c], current[c]);
  }
}

struct Sum {
  float sum, scale, mean;
};

// Sums of the scaled values, then of their squared deviations, in element order
// per group. `at(id)` is the group an id accumulates into.
template <int64_t Chunks, typename At>
void Sums(const float* v, const uint8_t* valid, const int32_t* id, const int64_t* start, At at,
          const std::vector<int32_t>& touched, Group* groups) {
  Lockstep<Chunks, Sum>(
      id, start, [&](Sum& state, int32_t g) { state = {at(g).total, at(g).scale, 0.0f}; },
      [&](Sum& state, int64_t i) { state.sum += Keep(valid[i], v[i] * state.scale); },
      [&](const Sum& state, int32_t g) { at(g).total = state.sum; });
  for (int32_t g : touched) groups[g].total = groups[g].total / std::max(groups[g].count, 1.0f);
  Lockstep<Chunks, Sum>(
      id, start,
      [&](Sum& state, int32_t g) { state = {at(g).squares, at(g).scale, at(g).total}; },
      [&](Sum& state, int64_t i) {
        const float deviation = Keep(valid[i], v[i] * state.scale - state.mean);
        state.sum += deviation * deviation;
      },
      [&](const Sum& state, int32_t g) { at(g).squares = state.sum; });
}

// Column k of the 8 x 8 tile whose rows are r[0..7]: the tile transposed.
inline void Transpose(f32x8 r[kLanes]) {
#if defined(__clang__) || __GNUC__ >= 12
  f32x8 t[kLanes], u[kLanes];
  for (int j = 0; j < 4; ++j) {
    t[2 * j] = __builtin_shufflevector(r[2 * j], r[2 * j + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * j + 1] = __builtin_shufflevector(r[2 * j], r[2 * j + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int j = 0; j < 2; ++j) {
    for (int h = 0; h < 2; ++h) {
      const f32x8 a = t[4 * j + h], b = t[4 * j + h + 2];
      u[4 * j + 2 * h] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13);
      u[4 * j + 2 * h + 1] = __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    }
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = __builtin_shufflevector(u[k], u[k + 4], 0, 1, 2, 3, 8, 9, 10, 11);
    r[k + 4] = __builtin_shufflevector(u[k], u[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  }
#else
  f32x8 c[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    for (int j = 0; j < kLanes; ++j) c[k][j] = r[j][k];
  }
  for (int k = 0; k < kLanes; ++k) r[k] = c[k];
#endif
}

// One pass of in-order sums over the runs of kChunks = 8 chunks (chunk c holds
// runs [first[c], first[c + 1])), the chunks as the lanes of a vector: while
// every chunk's current run has 8 elements left, the 8 x 8 tile of their
// contributions row(c, i) is transposed and its columns added in order, so each
// lane still adds its elements one after the other. begin(c, g) gives a run's
// starting sum (and sets lane c's parameters), end(g, sum) stores it; one(c, i)
// is the contribution of a single element.
template <typename Begin, typename Row, typename One, typename End>
void TiledPass(const Run* runs, const int64_t* first, Begin begin, Row row, One one, End end) {
  static_assert(kChunks == kLanes, "one lane per chunk");
  int64_t r[kLanes], p[kLanes];
  f32x8 acc;
  for (int64_t c = 0; c < kLanes; ++c) {
    r[c] = first[c];
    p[c] = runs[r[c]].begin;
    acc[c] = begin(c, runs[r[c]].slot);
  }
  bool running = true;
  while (running) {
    int64_t left = runs[r[0]].end - p[0];
    for (int64_t c = 1; c < kLanes; ++c) left = std::min(left, runs[r[c]].end - p[c]);
    for (; left >= kLanes; left -= kLanes) {
      f32x8 tile[kLanes];
      for (int64_t c = 0; c < kLanes; ++c) {
        tile[c] = row(c, p[c]);
        p[c] += kLanes;
      }
      Transpose(tile);
      for (int64_t k = 0; k < kLanes; ++k) acc += tile[k];
    }
    for (; left > 0; --left) {
      for (int64_t c = 0; c < kLanes; ++c) acc[c] += one(c, p[c]++);
    }
    for (int64_t c = 0; c < kLanes; ++c) {
      if (p[c] != runs[r[c]].end) continue;
      end(runs[r[c]].slot, acc[c]);
      if (++r[c] == first[c + 1]) {
        running = false;
      } else {
        p[c] = runs[r[c]].begin;
        acc[c] = begin(c, runs[r[c]].slot);
      }
    }
  }
  for (int64_t c = 0; c < kLanes; ++c) {  // the chunks still running, in order
    while (r[c] < first[c + 1]) {
      float sum = acc[c];
      for (; p[c] < runs[r[c]].end; ++p[c]) sum += one(c, p[c]);
      end(runs[r[c]].slot, sum);
      if (++r[c] < first[c + 1]) {
        p[c] = runs[r[c]].begin;
        acc[c] = begin(c, runs[r[c]].slot);
      }
    }
  }
}

// `Sums` for long runs in kChunks chunks of runs, by `TiledPass`.
void TiledSums(const float* v, const uint8_t* valid, const Run* runs, const int64_t* first,
               const std::vector<int32_t>& touched, Group* groups) {
  float scale[kLanes], mean[kLanes];
  TiledPass(
      runs, first,
      [&](int64_t c, int32_t g) {
        scale[c] = groups[g].scale;
        return groups[g].total;
      },
      [&](int64_t c, int64_t i) { return Keep(LoadMask(valid + i), Load(v + i) * scale[c]); },
      [&](int64_t c, int64_t i) { return Keep(valid[i], v[i] * scale[c]); },
      [&](int32_t g, float sum) { groups[g].total = sum; });
  for (int32_t g : touched) groups[g].total = groups[g].total / std::max(groups[g].count, 1.0f);
  TiledPass(
      runs, first,
      [&](int64_t c, int32_t g) {
        scale[c] = groups[g].scale;
        mean[c] = groups[g].total;
        return groups[g].squares;
      },
      [&](int64_t c, int64_t i) {
        const f32x8 deviation = Keep(LoadMask(valid + i), Load(v + i) * scale[c] - mean[c]);
        return deviation * deviation;
      },
      [&](int64_t c, int64_t i) {
        const float deviation = Keep(valid[i], v[i] * scale[c] - mean[c]);
        return deviation * deviation;
      },
      [&](int32_t g, float sum) { groups[g].squares = sum; });
}

// `Sums` for ids that change at nearly every element: each element adds into its
// group in memory; the chunks' chains are still independent.
template <int64_t Chunks, typename At>
void DirectSums(const float* v, const uint8_t* valid, const int32_t* id, const int64_t* start,
                At at, const std::vector<int32_t>& touched, Group* groups) {
  auto lockstep = [&](auto add) {
    int64_t common = start[1] - start[0];
    for (int64_t c = 0; c < Chunks; ++c) common = std::min(common, start[c + 1] - start[c]);
    for (int64_t k = 0; k < common; ++k) {
#pragma GCC unroll 8
      for (int64_t c = 0; c < Chunks; ++c) add(start[c] + k);
    }
    for (int64_t c = 0; c < Chunks; ++c) {
      for (int64_t i = start[c] + common; i < start[c + 1]; ++i) add(i);
    }
  };
  lockstep([&](int64_t i) {
    Group& g = at(id[i]);
    g.total += Keep(valid[i], v[i] * g.scale);
  });
  for (int32_t g : touched) groups[g].total = groups[g].total / std::max(groups[g].count, 1.0f);
  lockstep([&](int64_t i) {
    Group& g = at(id[i]);
    const float deviation = Keep(valid[i], v[i] * g.scale - g.total);
    g.squares += deviation * deviation;
  });
}

// out[i] for the elements of one run, eight at a time: (v - mean) factor / divisor
// (rule 2, a positive divisor), v / raw_divisor (rule 1) or 0; 0 at invalid
// elements. factor is 1 but for leave-one-out (x 1 and / 1 leave x as it is).
void Output(const float* v, const uint8_t* valid, int64_t begin, int64_t end, float mean,
            float factor, float divisor, float rule, float raw_divisor, float* out) {
  if (rule == 0.0f || (rule == 2.0f && !(divisor > 0.0f))) {
    std::fill(out + begin, out + end, 0.0f);
    return;
  }
  // Normalised, or raw: y = (x - shift) times / by.
  const bool normalised = rule == 2.0f;
  const float shift = normalised ? mean : 0.0f, times = normalised ? factor : 1.0f;
  const float by = normalised ? divisor : raw_divisor;
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    const f32x8 y = Keep(LoadMask(valid + i), (Load(v + i) - shift) * times / by);
    std::memcpy(out + i, &y, sizeof y);
  }
  for (; i < end; ++i) out[i] = Keep(valid[i], (v[i] - shift) * times / by);
}

// Group normalisation of n >= 1 elements in the order given. With `long_runs` (runs of
// equal ids are long, or each group's members are contiguous however few) a run keeps
// its group in registers; without, each element accumulates into memory.
void NormalizeInOrder(const float* v, const int32_t* id, const uint8_t* valid, int64_t n,
                      int64_t num_groups, int32_t std_mode, float eps, float one_plus_eps,
                      bool singleton_raw, bool long_runs, float* result) {
  struct Buffers {
    std::vector<Group> groups;
    std::vector<Run> runs;
    std::vector<int32_t> touched;
    uint64_t epoch = 0;
  };
  Buffers& kept = PerThread<Buffers>();
  std::vector<Run>& runs = kept.runs;
  std::vector<int32_t>& touched = kept.touched;
  const uint64_t epoch = ++kept.epoch;
  // Ids outside [0, num_groups) accumulate into one more group, never read.
  if (static_cast<int64_t>(kept.groups.size()) <= num_groups) {
    kept.groups.resize(num_groups + 1, Group{0, 0, 0, 0, 0, 0, 0, 0, 0});
  }
  Group* const groups = kept.groups.data();
  auto slot_of = [&](int32_t g) {
    return g >= 0 && g < num_groups ? g : static_cast<int32_t>(num_groups);
  };
  // Count, extremes and scale, and where each group's last element is.
  runs.clear();
  touched.clear();
  const float inf = std::numeric_limits<float>::infinity();
  auto meet = [&](int32_t slot) -> Group& {
    Group& group = groups[slot];
    if (__builtin_expect(group.epoch != epoch, 0)) {
      group = Group{0.0f, 0.0f, -inf, inf, 0.0f, 0.0f, 1.0f, 0, epoch};
      touched.push_back(slot);
    }
    return group;
  };
  if (long_runs) {
    for (int64_t begin = 0, end; begin < n; begin = end) {
      for (end = begin + 1; end < n && id[end] == id[begin]; ++end) {
      }
      runs.push_back({begin, end, slot_of(id[begin])});
      Group& group = meet(runs.back().slot);
      Extremes(v, valid, begin, end, group);
      group.last = end - 1;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      Group& group = meet(slot_of(id[i]));
      group.last = i;
      if (!valid[i]) continue;
      group.count += 1.0f;
      group.largest = Max(group.largest, std::fabs(v[i]));
      group.high = Max(group.high, v[i]);
      group.low = Min(group.low, v[i]);
    }
  }
  // Chunk c is [start[c], start[c + 1]), cut only where every group met so far
  // has ended, so that no group spans two chunks and each group's sums keep
  // their order. Without such cuts the sums run in one chunk.
  int64_t start[kChunks + 1];
  start[0] = 0;
  int64_t chunk = 1, reach = -1;
  auto cut = [&](int64_t i, int32_t slot) {  // after element i, the last of its run
    reach = std::max(reach, groups[slot].last);
    if (reach == i && chunk < kChunks && i + 1 >= chunk * (n / kChunks) + chunk * kSkew) {
      start[chunk++] = i + 1;
    }
  };
  if (long_runs) {
    for (const Run& run : runs) cut(run.end - 1, run.slot);
  } else {
    for (int64_t i = 0; i < n; ++i) cut(i, slot_of(id[i]));
  }
  bool chunked = chunk == kChunks;
  for (int64_t c = 1; c < kChunks && chunked; ++c) chunked = start[c] > start[c - 1];
  chunked &= start[kChunks - 1] < n;
  start[kChunks] = n;
  for (int32_t g : touched) groups[g].scale = ScaleOf(groups[g].largest);
  auto at = [&](int32_t g) -> Group& { return groups[slot_of(g)]; };
  const int64_t whole[2] = {0, n};
  if (long_runs && chunked) {
    int64_t first[kChunks + 1];  // each chunk's first run
    for (int64_t c = 0, r = 0; c <= kChunks; ++c) {
      while (r < static_cast<int64_t>(runs.size()) && runs[r].begin < start[c]) ++r;
      first[c] = r;
    }
    TiledSums(v, valid, runs.data(), first, touched, groups);
  } else if (long_runs) {
    Sums<1>(v, valid, id, whole, at, touched, groups);
  } else if (chunked) {
    DirectSums<kChunks>(v, valid, id, start, at, touched, groups);
  } else {
    DirectSums<1>(v, valid, id, whole, at, touched, groups);
  }
  for (int32_t g : touched) Finish(std_mode, eps, singleton_raw, groups[g]);
  // Out-of-range ids read the nearest group, as XLA's gather clamps them; a group
  // that holds no element reads as all equal (0).
  const float raw_divisor = std_mode == kNone || std_mode == kLeaveOneOut ? 1.0f : one_plus_eps;
  auto read = [&](int32_t id) -> std::pair<const Group*, float> {
    const Group& g = groups[std::clamp<int64_t>(id, 0, num_groups - 1)];
    return {&g, g.epoch == epoch ? g.scale : 0.0f};
  };
  if (long_runs) {
    for (const Run& run : runs) {
      const auto [g, rule] = read(id[run.begin]);
      const float factor = std_mode == kLeaveOneOut ? g->count : 1.0f;
      Output(v, valid, run.begin, run.end, g->total, factor, g->squares, rule, raw_divisor,
             result);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const auto [g, rule] = read(id[i]);
    result[i] = Keep(valid[i], Advantage(*g, rule, std_mode, raw_divisor, v[i]));
  }
}

// The fewest valid members per group, on average, for which reordering pays: below
// it (mostly singletons) the elements add into their groups in place.
constexpr int64_t kGroupedMembers = 2;

// Group normalisation, ids that change at almost every element included. Where
// the ids change at nearly every element but each group has several valid
// members, the valid elements are first reordered group by group, stably (a
// counting sort), so that each group is one run whose sums keep their element
// order; the result is read back in the original order, 0 at invalid elements.
// Leaving the invalid elements out changes no sum: they add +0, which leaves a
// partial sum as it is unless it is -0, and a sum of -0 terms only is a group
// whose valid values all equal -0, which gives 0 either way.
void Normalize(const float* v, const int32_t* id, const uint8_t* valid, int64_t n,
               int64_t num_groups, int32_t std_mode, float eps, float one_plus_eps,
               bool singleton_raw, float* result) {
  if (n == 0) return;
  auto normalize = [&](const float* v, const int32_t* id, const uint8_t* valid, int64_t n,
                       bool long_runs, float* out) {
    NormalizeInOrder(v, id, valid, n, num_groups, std_mode, eps, one_plus_eps, singleton_raw,
                     long_runs, out);
  };
  int64_t num_runs = 1;
  for (int64_t i = 1; i < n; ++i) num_runs += id[i] != id[i - 1];
  if (n >= 4 * num_runs) return normalize(v, id, valid, n, true, result);
  struct Buffers {
    // Per slot: the call that last met it, then its valid members' count, then the
    // position of its next valid member in the grouped order.
    std::vector<uint64_t> met_in;
    std::vector<int32_t> cursor, met, place, grouped_ids;
    std::vector<float> grouped_values, grouped_result;
    std::vector<uint8_t> grouped_valid;
    uint64_t epoch = 0;
  };
  Buffers& kept = PerThread<Buffers>();
  const uint64_t epoch = ++kept.epoch;
  if (static_cast<int64_t>(kept.cursor.size()) <= num_groups) {
    kept.cursor.resize(num_groups + 1);
    kept.met_in.resize(num_groups + 1);
  }
  uint64_t* const met_in = kept.met_in.data();
  int32_t* const cursor = kept.cursor.data();
  std::vector<int32_t>& met = kept.met;
  auto slot_of = [&](int32_t g) {
    return g >= 0 && g < num_groups ? g : static_cast<int32_t>(num_groups);
  };
  met.clear();
  int64_t members = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!valid[i]) continue;
    const int32_t slot = slot_of(id[i]);
    if (__builtin_expect(met_in[slot] != epoch, 0)) {
      met_in[slot] = epoch;
      cursor[slot] = 0;
      met.push_back(slot);
    }
    ++cursor[slot];
    ++members;
  }
  if (members < kGroupedMembers * static_cast<int64_t>(met.size())) {
    return normalize(v, id, valid, n, false, result);
  }
  int32_t position = 0;
  for (int32_t slot : met) position += std::exchange(cursor[slot], position);
  // One more slot, holding 0, that the invalid elements read back.
  for (auto* buffer : {&kept.place, &kept.grouped_ids}) buffer->resize(n + 1);
  for (auto* buffer : {&kept.grouped_values, &kept.grouped_result}) buffer->resize(n + 1);
  kept.grouped_valid.assign(members, 1);
  int32_t* const place = kept.place.data();
  int32_t* const grouped_ids = kept.grouped_ids.data();
  float* const grouped_values = kept.grouped_values.data();
  float* const grouped_result = kept.grouped_result.data();
  for (int64_t i = 0; i < n; ++i) {
    if (!valid[i]) {
      place[i] = static_cast<int32_t>(members);
      continue;
    }
    const int32_t at = cursor[slot_of(id[i])]++;
    place[i] = at;
    grouped_values[at] = v[i];
    grouped_ids[at] = id[i];
  }
  if (members > 0) {
    normalize(grouped_values, grouped_ids, kept.grouped_valid.data(), members, true,
              grouped_result);
  }
  grouped_result[members] = 0.0f;
  for (int64_t i = 0; i < n; ++i) result[i] = grouped_result[place[i]];
}

ffi::Error GroupNormalize(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> ids,
                          ffi::Buffer<ffi::PRED> valid, int64_t num_groups, int32_t std_mode,
                          float eps, float one_plus_eps, bool singleton_raw,
                          ffi::ResultBuffer<ffi::F32> out) {
  const int64_t n = values.element_count();
  if (ids.element_count() != n || valid.element_count() != n || out->element_count() != n) {
    return ffi::Error::InvalidArgument("group_normalize: values, ids and valid must have equal sizes");
  }
  if (num_groups < 1) return ffi::Error::InvalidArgument("group_normalize: num_groups must be >= 1");
  // bool has no vector type: the mask is read as bytes.
  Normalize(values.typed_data(), ids.typed_data(),
            reinterpret_cast<const uint8_t*>(valid.typed_data()), n, num_groups, std_mode, eps,
            one_plus_eps, singleton_raw, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditGroupNormalizeF32, GroupNormalize,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // values
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ids, the shape of values
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid, the shape of values
                                  .Attr<int64_t>("num_groups")
                                  .Attr<int32_t>("std")
                                  .Attr<float>("eps")
                                  .Attr<float>("one_plus_eps")
                                  .Attr<bool>("singleton_raw")
                                  .Ret<ffi::Buffer<ffi::F32>>()); // advantages
