// Group normalisation within (episode group, turn) segments, or within episode groups,
// of values or of their discounted returns: the CPU kernel behind
// `group._normalize_per_turn` (MT-GRPO's per-turn baseline) and GTPO's and Kevin's
// turn returns.
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
// ones. XLA:CPU computes the returns in three passes and, per turn, transposes
// the values, ids and mask so that each segment's members are consecutive for the
// group kernel and the result back, passes that each cost more than the
// normalisation; here each episode group's rows are gathered once and every turn's
// statistics advance together along the row. Each segment sums its members in row
// order (pooled: row by row, turn by turn), as the group kernel sums them, so the two
// give the same float32 numbers.

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

struct Options {
  int32_t std_mode;
  float eps, one_plus_eps;
  bool singleton_raw;
  bool pooled;   // one segment per episode group, all turns together
  bool returns;  // normalise the discounted returns of the values
  float gamma;
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

// Every turn's statistics, one array per field, so that a pass over a row advances all
// of them in vector registers.
struct Turns {
  std::vector<float> returns;  // the episode group's rows' G, row by row
  std::vector<float> outcome;  // per row
  std::vector<uint8_t> credited;  // row by row
  std::vector<float> count, largest, high, low, total, squares, scale, divisor, factor, rule;
  void Reset(int64_t steps) {
    const float inf = std::numeric_limits<float>::infinity();
    for (auto* field : {&count, &largest, &total, &squares}) field->assign(steps, 0.0f);
    high.assign(steps, -inf);
    low.assign(steps, inf);
    for (auto* field : {&scale, &divisor, &factor, &rule}) field->resize(steps);
  }
};

// Each turn's mean, divisor, rule and factor (`Finish`) from group(t), its statistics.
template <typename GroupOf>
void Finished(const Options& o, int64_t steps, Turns& turns, const GroupOf& group_of) {
  for (int64_t t = 0; t < steps; ++t) {
    Group group = group_of(t);
    Finish(o.std_mode, o.eps, o.singleton_raw, group);
    turns.total[t] = group.total;
    turns.divisor[t] = group.squares;
    turns.rule[t] = group.scale;
    turns.factor[t] = o.std_mode == kLeaveOneOut ? group.count : 1.0f;
  }
}

// The per-turn segments' sums, every turn of a row in vector registers; `pass(visit)`
// visits the episode group's rows in order.
template <typename Pass>
void PerTurn(const Options& o, int64_t steps, const Pass& pass, Turns& turns) {
  float* __restrict count = turns.count.data();
  float* __restrict largest = turns.largest.data();
  float* __restrict total = turns.total.data();
  float* __restrict squares = turns.squares.data();
  float* __restrict scale = turns.scale.data();
  for (int64_t t = 0; t < steps; ++t) scale[t] = ScaleOf(largest[t]);
    // An invalid element adds +0, which changes no sum (see group_normalize.cc).
  pass([&](const float* x, const uint8_t* m, float*, int64_t) {
    Lanes(steps, [&](int64_t t) {
      const f32x8 sum = Load(total + t) + Keep(LoadMask(m + t), Load(x + t) * Load(scale + t));
      std::memcpy(total + t, &sum, sizeof sum);
    }, [&](int64_t t) { total[t] += Keep(m[t], x[t] * scale[t]); });
  });
  for (int64_t t = 0; t < steps; ++t) total[t] = total[t] / std::max(count[t], 1.0f);
  pass([&](const float* x, const uint8_t* m, float*, int64_t) {
    Lanes(steps, [&](int64_t t) {
      const f32x8 deviation =
          Keep(LoadMask(m + t), Load(x + t) * Load(scale + t) - Load(total + t));
      const f32x8 sum = Load(squares + t) + deviation * deviation;
      std::memcpy(squares + t, &sum, sizeof sum);
    }, [&](int64_t t) {
      const float deviation = Keep(m[t], x[t] * scale[t] - total[t]);
      squares[t] += deviation * deviation;
    });
  });
  Finished(o, steps, turns, [&](int64_t t) {
    return Group{count[t], largest[t], turns.high[t], turns.low[t], total[t], squares[t],
                 scale[t], 0, 0};
  });
}

// One segment for the whole episode group: the turns' count and extremes folded, the
// sums in element order (row by row, turn by turn), as the group kernel adds them.
template <typename Pass>
void Pooled(const Options& o, int64_t steps, const Pass& pass, Turns& turns) {
  const float inf = std::numeric_limits<float>::infinity();
  Group group{0.0f, 0.0f, -inf, inf, 0.0f, 0.0f, 1.0f, 0, 0};
  for (int64_t t = 0; t < steps; ++t) {
    group.count += turns.count[t];
    group.largest = Max(group.largest, turns.largest[t]);
    group.high = Max(group.high, turns.high[t]);
    group.low = Min(group.low, turns.low[t]);
  }
  group.scale = ScaleOf(group.largest);
  pass([&](const float* x, const uint8_t* m, float*, int64_t) {
    for (int64_t t = 0; t < steps; ++t) group.total += Keep(m[t], x[t] * group.scale);
  });
  group.total = group.total / std::max(group.count, 1.0f);
  pass([&](const float* x, const uint8_t* m, float*, int64_t) {
    for (int64_t t = 0; t < steps; ++t) {
      const float deviation = Keep(m[t], x[t] * group.scale - group.total);
      group.squares += deviation * deviation;
    }
  });
  Finished(o, steps, turns, [&](int64_t) { return group; });
}

// MT-GRPO's outcome advantages of rows[first, last) (their scores normalised together,
// as `grpo`) and the turns that earn turn credit.
void Outcome(const Options& o, int64_t steps, const uint8_t* valid,
             const std::vector<int32_t>& rows, int64_t first, int64_t last, Turns& turns) {
  const Group group = NormalizedGroup(
      last - first, [&](int64_t k) { return o.scores[rows[first + k]]; },
      [](int64_t) { return true; }, o.std_mode, o.eps, false);
  turns.outcome.resize(last - first);
  turns.credited.resize((last - first) * steps);
  for (int64_t r = first; r < last; ++r) {
    turns.outcome[r - first] =
        Advantage(group, group.scale, o.std_mode, 1.0f, o.scores[rows[r]]);
    const uint8_t* in = valid + rows[r] * steps;
    uint8_t* credited = turns.credited.data() + (r - first) * steps;
    int64_t final_turn = -1;
    for (int64_t t = 0; t < steps; ++t) {
      credited[t] = in[t] != 0;
      final_turn = in[t] ? t : final_turn;
    }
    if (!o.credit_final && final_turn >= 0) credited[final_turn] = 0;
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
    turns.Reset(steps);
    if (o.returns) {
      // G_t = r_t + gamma G_{t+1} at valid turns; an invalid turn passes G on (1 G + 0).
      turns.returns.resize((last - first) * steps);
      for (int64_t r = first; r < last; ++r) {
        const int64_t offset = rows[r] * steps;
        float* const g = turns.returns.data() + (r - first) * steps;
        float carry = 0.0f;
        for (int64_t t = steps - 1; t >= 0; --t) {
          if (valid[offset + t]) carry = MultiplyAdd(o.gamma, carry, v[offset + t]);
          g[t] = carry;
        }
      }
    }
    if (o.outcome) Outcome(o, steps, valid, rows, first, last, turns);
    float* __restrict count = turns.count.data();
    float* __restrict largest = turns.largest.data();
    float* __restrict high = turns.high.data();
    float* __restrict low = turns.low.data();
    // Each pass visits the rows in order, all turns of a row together: each segment's
    // members come in row order.
    auto pass = [&](auto visit) {
      for (int64_t r = first; r < last; ++r) {
        if (r + kAhead < last) {
          __builtin_prefetch(v + rows[r + kAhead] * steps);
          __builtin_prefetch(valid + rows[r + kAhead] * steps);
        }
        const int64_t offset = rows[r] * steps;
        const int64_t at = (r - first) * steps;
        const float* x = o.returns ? turns.returns.data() + at : v + offset;
        visit(x, o.outcome ? turns.credited.data() + at : valid + offset, out + offset, r);
      }
    };
    int32_t any_nan = 0;
    pass([&](const float* x, const uint8_t* m, float*, int64_t) {
      Lanes(steps, [&](int64_t t) {
        const i32x8 in = LoadMask(m + t);
        const f32x8 value = Load(x + t);
        const f32x8 magnitude = (f32x8)((i32x8)value & 0x7fffffff);
        const f32x8 n = Load(count + t) + Keep(in, Splat(1.0f));
        const f32x8 most = Load(largest + t), top = Load(high + t), bottom = Load(low + t);
        const f32x8 new_most = (in != 0) & (magnitude > most) ? magnitude : most;
        const f32x8 new_top = (in != 0) & (value > top) ? value : top;
        const f32x8 new_bottom = (in != 0) & (value < bottom) ? value : bottom;
        any_nan |= Fold(in & (value != value), [](i32x8 a, i32x8 b) { return a | b; });
        std::memcpy(count + t, &n, sizeof n);
        std::memcpy(largest + t, &new_most, sizeof new_most);
        std::memcpy(high + t, &new_top, sizeof new_top);
        std::memcpy(low + t, &new_bottom, sizeof new_bottom);
      }, [&](int64_t t) {
        if (!m[t]) return;
        any_nan |= x[t] != x[t];
        count[t] += 1.0f;
        largest[t] = std::fabs(x[t]) > largest[t] ? std::fabs(x[t]) : largest[t];
        high[t] = x[t] > high[t] ? x[t] : high[t];
        low[t] = x[t] < low[t] ? x[t] : low[t];
      });
    });
    if (any_nan) {  // again, with a max and min that keep a NaN
      std::fill(largest, largest + steps, 0.0f);
      pass([&](const float* x, const uint8_t* m, float*, int64_t) {
        for (int64_t t = 0; t < steps; ++t) {
          if (!m[t]) continue;
          largest[t] = Max(largest[t], std::fabs(x[t]));
          high[t] = Max(high[t], x[t]);
          low[t] = Min(low[t], x[t]);
        }
      });
    }
    if (o.pooled) {
      Pooled(o, steps, pass, turns);
    } else {
      PerTurn(o, steps, pass, turns);
    }
    const float* __restrict mean = turns.total.data();
    const float* __restrict divisor = turns.divisor.data();
    const float* __restrict factor = turns.factor.data();
    const float* __restrict rule = turns.rule.data();
    // `Advantage`, with selects.
    const f32x8 zeros = Splat(0.0f);
    pass([&](const float* x, const uint8_t* m, float* y, int64_t r) {
      Lanes(steps, [&](int64_t t) {
        const f32x8 value = Load(x + t), by = Load(divisor + t), kind = Load(rule + t);
        const f32x8 quotient = by > 0.0f ? (value - Load(mean + t)) * Load(factor + t) / by : zeros;
        const f32x8 advantage = kind == 2.0f ? quotient : kind == 1.0f ? value / raw_divisor : zeros;
        const f32x8 kept = Keep(LoadMask(m + t), advantage);
        std::memcpy(y + t, &kept, sizeof kept);
      }, [&](int64_t t) {
        const float quotient =
            divisor[t] > 0.0f ? (x[t] - mean[t]) * factor[t] / divisor[t] : 0.0f;
        const float advantage = rule[t] == 2.0f ? quotient
                                : rule[t] == 1.0f ? x[t] / raw_divisor
                                                  : 0.0f;
        y[t] = Keep(m[t], advantage);
      });
      if (!o.outcome) return;
      const float outcome = turns.outcome[r - first];
      const uint8_t* in = valid + rows[r] * steps;
      for (int64_t t = 0; t < steps; ++t) {
        y[t] = Keep(in[t], m[t] ? y[t] + o.lam * outcome : outcome);
      }
    });
  }
}

ffi::Error TurnGroupsF32(ffi::Buffer<ffi::F32> values, ffi::Buffer<ffi::S32> episode_ids,
                         ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::F32> scores,
                         int32_t std_mode, float eps, float one_plus_eps, bool singleton_raw,
                         bool pooled, bool returns, float gamma, bool outcome, bool credit_final,
                         float lam, ffi::ResultBuffer<ffi::F32> out, ffi::ThreadPool pool) {
  const auto dims = values.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("turn_groups: values must be [B, T]");
  const int64_t batch = dims[0], steps = dims[1];
  if (valid.element_count() != batch * steps || out->element_count() != batch * steps ||
      episode_ids.element_count() != batch || scores.element_count() != batch) {
    return ffi::Error::InvalidArgument("turn_groups: inputs disagree in shape");
  }
  const Options options{std_mode, eps,   one_plus_eps, singleton_raw, pooled, returns,
                        gamma,    outcome, credit_final, lam,          scores.typed_data()};
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
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scores [B] (outcome)
                                  .Attr<int32_t>("std")
                                  .Attr<float>("eps")
                                  .Attr<float>("one_plus_eps")
                                  .Attr<bool>("singleton_raw")
                                  .Attr<bool>("pooled")
                                  .Attr<bool>("returns")
                                  .Attr<float>("gamma")
                                  .Attr<bool>("outcome")
                                  .Attr<bool>("credit_final")
                                  .Attr<float>("lam")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // advantages [B, T]
                                  .Ctx<ffi::ThreadPool>());
