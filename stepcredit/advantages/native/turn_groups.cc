// Group normalisation within (episode group, turn) segments, or within episode groups,
// of values or of their discounted returns: the CPU kernel behind
// `group._normalize_per_turn` (MT-GRPO's per-turn baseline), GTPO's and Kevin's turn
// returns, MT-GRPO's advantages and IGPO's.
//
// For row b of episode group e(b) and turn t, over the rows b' of e(b) valid at t:
//
//   out[b, t] = (x[b, t] - mean_{b'} x[b', t]) / (std_{b'} x[b', t] + eps)
//
// (over every valid (b', t') of e(b) when pooled), with x the values v or their
// discounted returns G_t = v_t + gamma G_{t+1} at valid turns (G passed on at invalid
// ones, 0 past T), and every convention of `group._normalize` (power-of-two scaled
// statistics, the std options, a singleton's raw rule, all-equal groups and invalid
// elements 0). MT-GRPO's mode adds the outcome term: the scores normalised within the
// episode group (as `grpo`), added with weight lam to the turn term at the credited
// turns (the last valid turn of a row credited or not) and alone at the other valid
// ones. IGPO's mode replaces each row's last valid value by the row's score and
// may discount after normalising instead of before: out_t = A_t + gamma out_{t+1} over the
// valid turns. XLA:CPU computes the returns in three passes and, per turn, transposes
// the values, ids and mask so that each segment's members are consecutive for the
// group kernel and the result back, passes that each cost more than the
// normalisation; here each episode group's rows are gathered once and every turn's
// statistics advance together along the row. Each per-turn segment sums its members in
// row order, as the group kernel sums them, so the two give the same float32 numbers;
// a pooled segment adds its per-turn sums in turn order, equal to the group kernel's
// element-order sums to float32 rounding.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "episode_rows.h"
#include "group_stats.h"
#include "simd.h"

namespace ffi = xla::ffi;
using namespace stepcredit;  // NOLINT: the shared helpers

namespace {

enum Discount : int32_t { kNoDiscount = 0, kBefore = 1, kAfter = 2 };

struct Options {
  int32_t std_mode;
  float eps, one_plus_eps;
  bool singleton_raw;
  bool pooled;   // one segment per episode group, all turns together
  // kBefore: normalise the discounted returns of the values; kAfter: discount the
  // normalised values (each with gamma, over the valid turns).
  int32_t discount;
  float gamma;
  bool final_scores;  // IGPO: each row's last valid value is its score
  // MT-GRPO: out = turn + lam outcome at credited turns (every valid one, or all but each
  // row's last with credit_final false), outcome at the other valid turns, outcome the
  // scores normalised within the episode group.
  bool outcome, credit_final;
  float lam;
  const float* scores;
};

// vector(t) for t = 0, 8, ... while eight turns remain, then scalar(t) for each of the rest.
template <typename Vector, typename Scalar>
inline void Lanes(int64_t steps, Vector vector, Scalar scalar) {
  int64_t t = 0;
  for (; t + kLanes <= steps; t += kLanes) vector(t);
  for (; t < steps; ++t) scalar(t);
}

// The rows of one episode group as the passes read them, in order: row k's values (v, or
// v rewritten: its returns, IGPO's final score), the mask its statistics count (valid, or
// MT-GRPO's credited turns) and its output.
struct Rows {
  std::vector<const float*> x;
  std::vector<const uint8_t*> m;
  std::vector<float*> y;
};

// Every turn's statistics, one array per field. A pass runs over blocks of eight turns
// and, within a block, over the rows in order with its accumulators in vector
// registers: each turn's sums run in row order.
struct Turns {
  std::vector<float> values;  // the episode group's rows' values as normalised, row by row
  std::vector<float> outcome;  // per row
  std::vector<uint8_t> credited;  // row by row
  std::vector<float> count, largest, high, low, total, squares, scale, divisor, factor, rule;
  Rows rows;
  void Resize(int64_t steps, int64_t num_rows) {
    for (auto* field : {&count, &largest, &high, &low, &total, &squares, &scale, &divisor,
                        &factor, &rule}) {
      field->resize(steps);
    }
    rows.x.resize(num_rows);
    rows.m.resize(num_rows);
    rows.y.resize(num_rows);
  }
};

inline void Store(float* x, f32x8 value) { std::memcpy(x, &value, sizeof value); }

// std::max(x, 1.0f), lane by lane.
inline f32x8 AtLeastOne(f32x8 x) { return x < 1.0f ? Splat(1.0f) : x; }

// Each turn's count and extremes (max |x| in `largest`), NaN kept as XLA's max and min keep it.
void Extremes(int64_t steps, int64_t num_rows, const Rows& rows, Turns& turns) {
  const float inf = std::numeric_limits<float>::infinity();
  int32_t any_nan = 0;
  Lanes(steps, [&](int64_t t) {
    f32x8 n = Splat(0.0f), most = Splat(0.0f), top = Splat(-inf), bottom = Splat(inf);
    i32x8 nan = {};
    for (int64_t k = 0; k < num_rows; ++k) {
      const i32x8 in = LoadMask(rows.m[k] + t);
      const f32x8 value = Load(rows.x[k] + t);
      const f32x8 magnitude = (f32x8)((i32x8)value & 0x7fffffff);
      n = n + Keep(in, Splat(1.0f));
      most = (in != 0) & (magnitude > most) ? magnitude : most;
      top = (in != 0) & (value > top) ? value : top;
      bottom = (in != 0) & (value < bottom) ? value : bottom;
      nan |= in & (value != value);
    }
    Store(turns.count.data() + t, n);
    Store(turns.largest.data() + t, most);
    Store(turns.high.data() + t, top);
    Store(turns.low.data() + t, bottom);
    any_nan |= Fold(nan, [](i32x8 a, i32x8 b) { return a | b; });
  }, [&](int64_t t) {
    float n = 0.0f, most = 0.0f, top = -inf, bottom = inf;
    for (int64_t k = 0; k < num_rows; ++k) {
      if (!rows.m[k][t]) continue;
      const float value = rows.x[k][t];
      any_nan |= value != value;
      n += 1.0f;
      most = std::fabs(value) > most ? std::fabs(value) : most;
      top = value > top ? value : top;
      bottom = value < bottom ? value : bottom;
    }
    turns.count[t] = n;
    turns.largest[t] = most;
    turns.high[t] = top;
    turns.low[t] = bottom;
  });
  if (!any_nan) return;
  // Again, with a max and min that keep a NaN.
  for (int64_t t = 0; t < steps; ++t) {
    turns.largest[t] = 0.0f;
    for (int64_t k = 0; k < num_rows; ++k) {
      if (!rows.m[k][t]) continue;
      const float value = rows.x[k][t];
      turns.largest[t] = Max(turns.largest[t], std::fabs(value));
      turns.high[t] = Max(turns.high[t], value);
      turns.low[t] = Min(turns.low[t], value);
    }
  }
}

// total[t] = sum over the rows of x[t] scale[t] at valid turns, then squares[t] = sum of
// (x[t] scale[t] - mean[t])^2, in row order. An invalid element adds +0, which changes
// no sum (see group_normalize.cc).
void ScaledTotals(int64_t steps, int64_t num_rows, const Rows& rows,
                  const float* __restrict scale, float* __restrict total) {
  Lanes(steps, [&](int64_t t) {
    const f32x8 by = Load(scale + t);
    f32x8 sum = Splat(0.0f);
    for (int64_t k = 0; k < num_rows; ++k) {
      sum = sum + Keep(LoadMask(rows.m[k] + t), Load(rows.x[k] + t) * by);
    }
    Store(total + t, sum);
  }, [&](int64_t t) {
    float sum = 0.0f;
    for (int64_t k = 0; k < num_rows; ++k) sum += Keep(rows.m[k][t], rows.x[k][t] * scale[t]);
    total[t] = sum;
  });
}

void SquaredDeviations(int64_t steps, int64_t num_rows, const Rows& rows,
                       const float* __restrict scale, const float* __restrict mean,
                       float* __restrict squares) {
  Lanes(steps, [&](int64_t t) {
    const f32x8 by = Load(scale + t), centre = Load(mean + t);
    f32x8 sum = Splat(0.0f);
    for (int64_t k = 0; k < num_rows; ++k) {
      const f32x8 deviation = Keep(LoadMask(rows.m[k] + t), Load(rows.x[k] + t) * by - centre);
      sum = sum + deviation * deviation;
    }
    Store(squares + t, sum);
  }, [&](int64_t t) {
    float sum = 0.0f;
    for (int64_t k = 0; k < num_rows; ++k) {
      const float deviation = Keep(rows.m[k][t], rows.x[k][t] * scale[t] - mean[t]);
      sum += deviation * deviation;
    }
    squares[t] = sum;
  });
}

// Each turn's mean, divisor, rule and factor from its statistics: `Finish`, eight turns
// at a time (the same operations, correctly rounded lane by lane, so the same bits).
void Finished(const Options& o, int64_t steps, Turns& turns) {
  Lanes(steps, [&](int64_t t) {
    const f32x8 n = Load(turns.count.data() + t), squares = Load(turns.squares.data() + t);
    const f32x8 scale = Load(turns.scale.data() + t);
    const f32x8 variance = o.std_mode == kUnbiased
                               ? (n >= 2.0f ? squares / AtLeastOne(n - 1.0f) : Splat(0.0f))
                               : squares / AtLeastOne(n);
    const f32x8 root = variance > 0.0f ? Sqrt(variance) : Splat(0.0f);
    const f32x8 divisor = o.std_mode == kLeaveOneOut ? AtLeastOne(n - 1.0f)
                          : o.std_mode == kNone      ? Splat(1.0f)
                                                     : root / scale + o.eps;
    const i32x8 raw = o.singleton_raw ? (n == 1.0f) : i32x8{};
    const f32x8 spread = Load(turns.high.data() + t) <= Load(turns.low.data() + t)
                             ? Splat(0.0f) : Splat(2.0f);
    Store(turns.total.data() + t, Load(turns.total.data() + t) / scale);
    Store(turns.divisor.data() + t, divisor);
    Store(turns.rule.data() + t, raw != 0 ? Splat(1.0f) : spread);
    Store(turns.factor.data() + t, o.std_mode == kLeaveOneOut ? n : Splat(1.0f));
  }, [&](int64_t t) {
    Group group{turns.count[t], turns.largest[t], turns.high[t], turns.low[t],
                turns.total[t], turns.squares[t], turns.scale[t], 0, 0};
    Finish(o.std_mode, o.eps, o.singleton_raw, group);
    turns.total[t] = group.total;
    turns.divisor[t] = group.squares;
    turns.rule[t] = group.scale;
    turns.factor[t] = o.std_mode == kLeaveOneOut ? group.count : 1.0f;
  });
}

// The per-turn segments' statistics.
void PerTurn(const Options& o, int64_t steps, int64_t num_rows, Turns& turns) {
  float* const total = turns.total.data();
  float* const scale = turns.scale.data();
  for (int64_t t = 0; t < steps; ++t) scale[t] = ScaleOf(turns.largest[t]);
  ScaledTotals(steps, num_rows, turns.rows, scale, total);
  for (int64_t t = 0; t < steps; ++t) total[t] = total[t] / std::max(turns.count[t], 1.0f);
  SquaredDeviations(steps, num_rows, turns.rows, scale, total, turns.squares.data());
  Finished(o, steps, turns);
}

// One segment for the whole episode group: the turns' statistics folded in turn order.
// Its sums are therefore the per-turn sums added in turn order, not its elements added
// one by one in row order: equal to the group kernel's to float32 rounding, and
// computed in vector registers where the element order is one dependent chain.
void Pooled(const Options& o, int64_t steps, int64_t num_rows, Turns& turns) {
  const float inf = std::numeric_limits<float>::infinity();
  Group group{0.0f, 0.0f, -inf, inf, 0.0f, 0.0f, 1.0f, 0, 0};
  for (int64_t t = 0; t < steps; ++t) {
    group.count += turns.count[t];
    group.largest = Max(group.largest, turns.largest[t]);
    group.high = Max(group.high, turns.high[t]);
    group.low = Min(group.low, turns.low[t]);
  }
  group.scale = ScaleOf(group.largest);
  std::fill(turns.scale.begin(), turns.scale.end(), group.scale);
  ScaledTotals(steps, num_rows, turns.rows, turns.scale.data(), turns.total.data());
  for (int64_t t = 0; t < steps; ++t) group.total += turns.total[t];
  group.total = group.total / std::max(group.count, 1.0f);
  std::fill(turns.total.begin(), turns.total.end(), group.total);
  SquaredDeviations(steps, num_rows, turns.rows, turns.scale.data(), turns.total.data(),
                    turns.squares.data());
  for (int64_t t = 0; t < steps; ++t) group.squares += turns.squares[t];
  Finish(o.std_mode, o.eps, o.singleton_raw, group);
  std::fill(turns.total.begin(), turns.total.end(), group.total);
  std::fill(turns.divisor.begin(), turns.divisor.end(), group.squares);
  std::fill(turns.rule.begin(), turns.rule.end(), group.scale);
  std::fill(turns.factor.begin(), turns.factor.end(),
            o.std_mode == kLeaveOneOut ? group.count : 1.0f);
}

// MT-GRPO's outcome advantages of rows[first, last) (their scores normalised together,
// as `grpo`) and the turns that earn turn credit.
void Outcome(const Options& o, int64_t steps, const uint8_t* valid,
             const std::vector<int32_t>& rows, int64_t first, int64_t last, Turns& turns) {
  const Group group = NormalizedGroup(
      last - first, [&](int64_t k) { return o.scores[rows[first + k]]; },
      [](int64_t) { return true; }, o.std_mode, o.eps, false);
  for (int64_t r = first; r < last; ++r) {
    turns.outcome[r - first] =
        Advantage(group, group.scale, o.std_mode, 1.0f, o.scores[rows[r]]);
    const uint8_t* in = valid + rows[r] * steps;
    uint8_t* credited = turns.credited.data() + (r - first) * steps;
    std::memcpy(credited, in, steps);
    if (o.credit_final) continue;
    int64_t final_turn = steps - 1;
    while (final_turn >= 0 && !in[final_turn]) --final_turn;
    if (final_turn >= 0) credited[final_turn] = 0;
  }
}

// The episode groups whose first rows lie in rows[begin, end), in full.
void TurnGroups(const float* v, const uint8_t* valid, const int32_t* episode_ids,
                const Options& o, int64_t steps, const std::vector<int32_t>& rows,
                int64_t begin, int64_t end, float* out) {
  const int64_t batch = static_cast<int64_t>(rows.size());
  Turns& turns = PerThread<Turns>();
  const float raw_divisor = o.std_mode == kNone || o.std_mode == kLeaveOneOut ? 1.0f
                                                                             : o.one_plus_eps;
  for (int64_t first = begin, last; first < end; first = last) {
    const int32_t id = episode_ids[rows[first]];
    for (last = first + 1; last < batch && episode_ids[rows[last]] == id; ++last) {
    }
    const int64_t num_rows = last - first;
    turns.Resize(steps, num_rows);
    const bool rewritten = o.discount == kBefore || o.final_scores;
    if (rewritten) turns.values.resize(num_rows * steps);
    if (o.outcome) {
      turns.outcome.resize(num_rows);
      turns.credited.resize(num_rows * steps);
    }
    Rows& view = turns.rows;
    for (int64_t k = 0; k < num_rows; ++k) {
      if (first + k + kAhead < batch) {
        __builtin_prefetch(v + rows[first + k + kAhead] * steps);
        __builtin_prefetch(valid + rows[first + k + kAhead] * steps);
      }
      const int64_t offset = rows[first + k] * steps;
      view.x[k] = rewritten ? turns.values.data() + k * steps : v + offset;
      view.m[k] = o.outcome ? turns.credited.data() + k * steps : valid + offset;
      view.y[k] = out + offset;
    }
    for (int64_t k = 0; rewritten && k < num_rows; ++k) {
      const int64_t offset = rows[first + k] * steps;
      float* const x = turns.values.data() + k * steps;
      std::memcpy(x, v + offset, steps * sizeof(float));
      if (o.final_scores) {
        int64_t final_turn = steps - 1;
        while (final_turn >= 0 && !valid[offset + final_turn]) --final_turn;
        if (final_turn >= 0) x[final_turn] = o.scores[rows[first + k]];
      }
      if (o.discount != kBefore) continue;
      // G_t = x_t + gamma G_{t+1} at valid turns; an invalid turn passes G on (1 G + 0).
      float carry = 0.0f;
      for (int64_t t = steps - 1; t >= 0; --t) {
        if (valid[offset + t]) carry = MultiplyAdd(o.gamma, carry, x[t]);
        x[t] = carry;
      }
    }
    if (o.outcome) Outcome(o, steps, valid, rows, first, last, turns);
    Extremes(steps, num_rows, view, turns);
    if (o.pooled) {
      Pooled(o, steps, num_rows, turns);
    } else {
      PerTurn(o, steps, num_rows, turns);
    }
    const float* __restrict mean = turns.total.data();
    const float* __restrict divisor = turns.divisor.data();
    const float* __restrict factor = turns.factor.data();
    const float* __restrict rule = turns.rule.data();
    // `Advantage`, with selects.
    const f32x8 zeros = Splat(0.0f);
    for (int64_t k = 0; k < num_rows; ++k) {
      const float* const x = view.x[k];
      const uint8_t* const m = view.m[k];
      float* const y = view.y[k];
      Lanes(steps, [&](int64_t t) {
        const f32x8 value = Load(x + t), by = Load(divisor + t), kind = Load(rule + t);
        const f32x8 quotient = by > 0.0f ? (value - Load(mean + t)) * Load(factor + t) / by : zeros;
        const f32x8 advantage = kind == 2.0f ? quotient : kind == 1.0f ? value / raw_divisor : zeros;
        Store(y + t, Keep(LoadMask(m + t), advantage));
      }, [&](int64_t t) {
        const float quotient =
            divisor[t] > 0.0f ? (x[t] - mean[t]) * factor[t] / divisor[t] : 0.0f;
        const float advantage = rule[t] == 2.0f ? quotient
                                : rule[t] == 1.0f ? x[t] / raw_divisor
                                                  : 0.0f;
        y[t] = Keep(m[t], advantage);
      });
      const uint8_t* const in = valid + rows[first + k] * steps;
      if (o.outcome) {
        const float outcome = turns.outcome[k];
        const float credit = o.lam * outcome;
        Lanes(steps, [&](int64_t t) {
          const f32x8 sum = LoadMask(m + t) != 0 ? Load(y + t) + credit : Splat(outcome);
          Store(y + t, Keep(LoadMask(in + t), sum));
        }, [&](int64_t t) { y[t] = Keep(in[t], m[t] ? y[t] + credit : outcome); });
      }
      if (o.discount != kAfter) continue;
      float carry = 0.0f;  // y is 0 at invalid turns, which pass the sum on
      for (int64_t t = steps - 1; t >= 0; --t) {
        if (in[t]) carry = MultiplyAdd(o.gamma, carry, y[t]);
        y[t] = Keep(in[t], carry);
      }
    }
  }
}

ffi::Error TurnGroupsF32(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> episode_ids,
                         ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::F32> scores,
                         int32_t std_mode, float eps, float one_plus_eps, bool singleton_raw,
                         bool pooled, int32_t discount, float gamma, bool final_scores,
                         bool outcome, bool credit_final,
                         float lam, ffi::ResultBuffer<ffi::F32> out, ffi::ThreadPool pool) {
  const auto dims = values.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("turn_groups: values must be [B, T]");
  const int64_t batch = dims[0], steps = dims[1];
  if (valid.element_count() != batch * steps || out->element_count() != batch * steps ||
      episode_ids.element_count() != batch || scores.element_count() != batch) {
    return ffi::Error::InvalidArgument("turn_groups: inputs disagree in shape");
  }
  if (discount < kNoDiscount || discount > kAfter || (final_scores && outcome)) {
    return ffi::Error::InvalidArgument("turn_groups: unknown discount, or two uses of scores");
  }
  const Options options{std_mode, eps,          one_plus_eps, singleton_raw,
                        pooled,   discount,     gamma,        final_scores,
                        outcome,  credit_final, lam,          scores.typed_data()};
  ByEpisodeGroup(pool, episode_ids.typed_data(), batch,
                 [&](const std::vector<int32_t>& rows, int64_t begin, int64_t end, int64_t) {
                   // bool has no vector type: the mask is read as bytes.
                   TurnGroups(values.typed_data(),
                              reinterpret_cast<const uint8_t*>(valid.typed_data()),
                              episode_ids.typed_data(), options, steps, rows, begin, end,
                              out->typed_data());
                 });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditTurnGroupsF32, TurnGroupsF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // values [B, T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // episode ids [B]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // valid [B, T]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scores [B] (outcome, final_scores)
                                  .Attr<int32_t>("std")
                                  .Attr<float>("eps")
                                  .Attr<float>("one_plus_eps")
                                  .Attr<bool>("singleton_raw")
                                  .Attr<bool>("pooled")
                                  .Attr<int32_t>("discount")
                                  .Attr<float>("gamma")
                                  .Attr<bool>("final_scores")
                                  .Attr<bool>("outcome")
                                  .Attr<bool>("credit_final")
                                  .Attr<float>("lam")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // advantages [B, T]
                                  .Ctx<ffi::ThreadPool>());
