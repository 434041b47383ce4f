// GiGPO's family in one kernel: the CPU kernel behind `gigpo`, `ecpo` and `hgpo`.
//
// For row b of episode group e(b), with valid steps t (mask), weights w_d over
// depths d in [min_depth, D]:
//
//   S_b      = sum_t r_t over the valid steps, in step order (or the given episode score)
//   A^E_b    = S_b normalised over the rows of e(b) with a valid step (as
//              `group._normalize`, with the given singleton rule)
//   R_t      = r_t + gamma R_{t+1} at valid steps, R_{t+1} at invalid ones (0 past T)
//   G_d(b,t) = the valid steps (b', t') of e(b) with anchors[b', t' - k] = anchors[b, t - k]
//              for k < d (a position before its row's start counting as one more,
//              distinct state); G_0 is every valid step of e(b)
//   live_d   = live_{d-1} and at least two members of G_d that are live_{d-1}
//              (live_{min_depth - 1}: every valid step)
//   A_d      = (R - mean) / (std + eps) over the live members of G_d (as
//              `group._normalize` with singleton "zero")
//   A^S      = sum_d w_d A_d [live_d] / sum_d w_d [live_d]    (0 where no depth is live)
//   out      = A^E + omega A^S                 (GiGPO: D = min_depth = 1, w_1 = 1; HGPO)
//            = A^E + (omega n / max(n + kappa, tiny)) A^S      (ECPO, n = |G_1|)
//
// and 0 at invalid steps. XLA:CPU builds the step groups with a hash of every
// (episode group, history) pair over the whole batch and normalises them with
// scatters and gathers, a dozen passes over B x T per depth; here each episode
// group is gathered once (its rows, stably ordered) and its step groups are found
// with a small hash table and normalised while its elements sit in the first-level
// cache, the episode groups shared among XLA's threads. Every statistic is summed
// in element order and each operation rounded as in the XLA computation (a fused
// multiply-add where XLA:CPU fuses one); only the episode score S_b is summed in
// step order where XLA:CPU adds in a tree, so with given episode scores the two
// agree bit for bit and without them to float32 rounding.

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

// Dense ids of 64-bit keys, numbered in the order of their first occurrence, by open
// addressing (Fibonacci hashing: the top bits of key times 2^64 / golden ratio). A slot
// belongs to the current round only if its stamp is the round's, so a new round (one
// depth of one episode group) starts without clearing the table.
class KeyTable {
  struct Slot {
    uint64_t key;
    uint32_t stamp;
    int32_t id;
  };

 public:
  // One round: the table's fields copied into the caller's registers (the table itself
  // lives in thread-local storage, whose address a loop would otherwise recompute).
  class Round {
   public:
    Round(Slot* slots, uint64_t mask, int32_t shift, uint32_t stamp)
        : slots_(slots), mask_(mask), shift_(shift), stamp_(stamp) {}
    int32_t Id(uint64_t key) {
      uint64_t at = (key * 0x9e3779b97f4a7c15ULL) >> shift_;
      while (slots_[at].stamp == stamp_ && slots_[at].key != key) at = (at + 1) & mask_;
      Slot& slot = slots_[at];
      if (slot.stamp != stamp_) slot = Slot{key, stamp_, next_++};
      return slot.id;
    }
    int32_t size() const { return next_; }

   private:
    Slot* slots_;
    uint64_t mask_;
    int32_t shift_;
    uint32_t stamp_;
    int32_t next_ = 0;
  };

  void Reserve(int64_t keys) {
    int32_t bits = 4;
    while ((uint64_t{1} << bits) < 2 * static_cast<uint64_t>(keys)) ++bits;
    if (static_cast<int64_t>(slots_.size()) < (int64_t{1} << bits)) {
      slots_.assign(uint64_t{1} << bits, Slot{0, 0, 0});
    }
    for (shift_ = 64, bits = 0; (uint64_t{1} << bits) < slots_.size(); ++bits) --shift_;
  }
  Round NewRound() {
    if (++stamp_ == 0) {  // the stamp wrapped: old stamps could match again
      std::fill(slots_.begin(), slots_.end(), Slot{0, 0, 0});
      stamp_ = 1;
    }
    return Round(slots_.data(), slots_.size() - 1, shift_, stamp_);
  }

 private:
  std::vector<Slot> slots_;
  int32_t shift_ = 60;
  uint32_t stamp_ = 0;
};

struct Options {
  float gamma, omega, kappa;
  bool shrink, given_scores, singleton_raw;
  int32_t std_mode;
  float eps, one_plus_eps;
  int64_t min_depth;
  const float* depth_weights;  // [max_depth + 1]
  int64_t max_depth;
};

// The valid steps of the episode group being normalised, one array per field, row by
// row: the valid steps of its k-th row are [first[k], first[k + 1]).
struct Elements {
  std::vector<int32_t> index, key, anchor;  // b T + t, the group at the current depth, a
  std::vector<float> value, total, weight;  // R, sum_d w_d A_d, sum_d w_d
  std::vector<int32_t> rows, first;  // b, and where its steps start
  std::vector<float> scores, episode;  // S_b, then A^E_b
  void Reserve(int64_t n, int64_t num_rows) {
    if (static_cast<int64_t>(index.size()) < n) {
      for (auto* v : {&index, &key, &anchor}) v->resize(n);
      for (auto* v : {&value, &total, &weight}) v->resize(n);
    }
    if (static_cast<int64_t>(rows.size()) < num_rows + 1) {
      for (auto* v : {&rows, &first}) v->resize(num_rows + 1);
      for (auto* v : {&scores, &episode}) v->resize(num_rows + 1);
    }
  }
};

struct Buffers {
  Elements elements;
  std::vector<Group> groups;
  std::vector<int32_t> listed;  // the ids of the groups whose statistics are finished
  KeyTable table;
};

// A^E of the episode group's rows: their scores normalised over the rows with a valid
// step (0 at the others), in row order.
void EpisodeAdvantages(const Options& o, int64_t num_rows, Elements& el) {
  auto has_steps = [&](int64_t k) { return el.first[k + 1] > el.first[k]; };
  const Group group = NormalizedGroup(
      num_rows, [&](int64_t k) { return el.scores[k]; }, has_steps, o.std_mode, o.eps,
      o.singleton_raw);
  const float raw_divisor = o.std_mode == kNone ? 1.0f : o.one_plus_eps;
  for (int64_t k = 0; k < num_rows; ++k) {
    el.episode[k] =
        has_steps(k) ? Advantage(group, group.scale, o.std_mode, raw_divisor, el.scores[k]) : 0.0f;
  }
}

// Normalises one episode group's n elements at every depth and writes their advantages.
// A group that is a singleton at depth d holds a single step at every deeper depth (the
// keys refine each other), so the statistics may run over every element: a group of
// steps that are no longer live is a singleton, whose statistics nothing reads.
void EpisodeGroup(const Options& o, const int32_t* anchors, int64_t steps, Buffers& kept,
                  int64_t num_rows, bool any_nan, float* out) {
  Elements& el = kept.elements;
  const int64_t n = el.first[num_rows];
  int32_t* const index = el.index.data();
  int32_t* const key = el.key.data();
  const float* const value = el.value.data();
  float* const total = el.total.data();
  float* const weight = el.weight.data();
  Group* const groups = kept.groups.data();
  int32_t* const listed = kept.listed.data();
  const float inf = std::numeric_limits<float>::infinity();
  const float tiny = std::numeric_limits<float>::min();
  const float raw_divisor = 1.0f;  // unused: singleton="zero"
  const bool single = o.min_depth == o.max_depth;  // w = 1: A^S is A_d itself
  // out[e] = episode advantage of e's row + times(e) x term(e), row by row.
  auto write = [&](auto times, auto term) {
    for (int64_t k = 0; k < num_rows; ++k) {
      const float episode = el.episode[k];
      for (int64_t e = el.first[k]; e < el.first[k + 1]; ++e) {
        out[index[e]] = MultiplyAdd(times(e), term(e), episode);
      }
    }
  };
  if (!single) {
    std::fill(total, total + n, 0.0f);
    std::fill(weight, weight + n, 0.0f);
  }
  for (int64_t depth = o.min_depth; depth <= o.max_depth; ++depth) {
    // The depth's key: (the depth - 1 key, the anchor depth - 1 steps back or "none").
    KeyTable::Round table = kept.table.NewRound();
    if (depth == 0) {
      std::fill(key, key + n, 0);
    } else if (depth == 1) {  // the step's own anchor, gathered with its reward
      const int32_t* const anchor = el.anchor.data();
      for (int64_t e = 0; e < n; ++e) key[e] = table.Id(static_cast<uint32_t>(anchor[e]));
    } else {
      const int64_t lag = depth - 1;
      for (int64_t k = 0; k < num_rows; ++k) {
        const int64_t row_start = el.rows[k] * steps;
        for (int64_t e = el.first[k]; e < el.first[k + 1]; ++e) {
          const bool exists = index[e] - row_start >= lag;
          const uint64_t anchor = exists ? static_cast<uint32_t>(anchors[index[e] - lag]) : 0;
          const uint64_t previous = static_cast<uint32_t>(key[e]);
          key[e] = table.Id((previous << 33) | (uint64_t{!exists} << 32) | anchor);
        }
      }
    }
    const int32_t num_keys = depth == 0 ? static_cast<int32_t>(n > 0) : table.size();
    std::fill(groups, groups + num_keys, Group{0.0f, 0.0f, -inf, inf, 0.0f, 0.0f, 1.0f, 0, 0});
    if (any_nan) {  // max and min that keep a NaN
      for (int64_t e = 0; e < n; ++e) {
        Group& group = groups[key[e]];
        const float v = value[e];
        group.count += 1.0f;
        group.largest = Max(group.largest, std::fabs(v));
        group.high = Max(group.high, v);
        group.low = Min(group.low, v);
      }
    } else {
      for (int64_t e = 0; e < n; ++e) {
        Group& group = groups[key[e]];
        const float v = value[e];
        group.count += 1.0f;
        group.largest = std::fabs(v) > group.largest ? std::fabs(v) : group.largest;
        group.high = v > group.high ? v : group.high;
        group.low = v < group.low ? v : group.low;
      }
    }
    // The groups whose statistics are read: every one at a single depth (a singleton's
    // advantage, 0 or a NaN, is written), only those with two members or more across
    // depths (a singleton's member adds nothing). Deeper histories leave most groups
    // singletons, and their divisions and square roots would cost more than the sums.
    int32_t num_listed = 0;
    for (int32_t g = 0; g < num_keys; ++g) {
      groups[g].scale = ScaleOf(groups[g].largest);
      listed[num_listed] = g;
      num_listed += single || groups[g].count >= 2.0f;
    }
    if (num_listed == 0 && !single) break;  // nothing deeper is live either
    for (int64_t e = 0; e < n; ++e) {
      Group& group = groups[key[e]];
      group.total += value[e] * group.scale;
    }
    for (int32_t i = 0; i < num_listed; ++i) {
      Group& group = groups[listed[i]];
      group.total = group.total / std::max(group.count, 1.0f);
    }
    for (int64_t e = 0; e < n; ++e) {
      Group& group = groups[key[e]];
      const float deviation = value[e] * group.scale - group.total;
      group.squares += deviation * deviation;
    }
    for (int32_t i = 0; i < num_listed; ++i) Finish(o.std_mode, o.eps, false, groups[listed[i]]);
    auto advantage = [&](int64_t e) {
      const Group& group = groups[key[e]];
      return Advantage(group, group.scale, o.std_mode, raw_divisor, value[e]);
    };
    if (single && o.shrink) {
      return write(
          [&](int64_t e) {
            const float count = groups[key[e]].count;
            return o.omega * (count / std::max(count + o.kappa, tiny));
          },
          advantage);
    }
    if (single) return write([&](int64_t) { return o.omega; }, advantage);
    const float w = o.depth_weights[depth];
    // Selected, not branched on: whether a step's group is live is as good as random.
    for (int64_t e = 0; e < n; ++e) {
      const bool live = groups[key[e]].count >= 2.0f;
      const float added = MultiplyAdd(w, advantage(e), total[e]);
      total[e] = live ? added : total[e];
      weight[e] = live ? weight[e] + w : weight[e];
    }
  }
  write([&](int64_t) { return o.omega; },
        [&](int64_t e) { return weight[e] > 0.0f ? total[e] / weight[e] : 0.0f; });
}

// The episode groups whose first rows lie in rows[begin, end), in full.
void EpisodeGroups(const float* rewards, const int32_t* anchors, const int32_t* episode_ids,
                   const uint8_t* valid, const float* scores, const Options& o, int64_t steps,
                   const std::vector<int32_t>& rows, int64_t begin, int64_t end,
                   int64_t largest, float* out) {
  const int64_t batch = static_cast<int64_t>(rows.size());
  Buffers& kept = PerThread<Buffers>();
  kept.elements.Reserve(largest * steps, largest);
  if (static_cast<int64_t>(kept.groups.size()) < largest * steps) {
    kept.groups.resize(largest * steps);
    kept.listed.resize(largest * steps);
  }
  kept.table.Reserve(largest * steps);
  Elements& el = kept.elements;
  // The buffers' addresses in registers: a store through a vector's element could, as far
  // as the compiler knows, move the vector's own pointer.
  int32_t* __restrict const index = el.index.data();
  int32_t* __restrict const anchor = el.anchor.data();
  float* __restrict const value = el.value.data();
  for (int64_t first = begin, last; first < end; first = last) {
    const int32_t id = episode_ids[rows[first]];
    int32_t count = 0;
    bool any_nan = false;
    for (last = first; last < batch && episode_ids[rows[last]] == id; ++last) {
      // The rows come in no order the hardware prefetcher follows.
      if (last + kAhead < batch) {
        const int64_t ahead = rows[last + kAhead] * steps;
        __builtin_prefetch(rewards + ahead);
        __builtin_prefetch(anchors + ahead);
        __builtin_prefetch(valid + ahead);
      }
      const int64_t k = last - first;
      const int32_t row = rows[last];
      const int32_t offset = row * static_cast<int32_t>(steps);
      el.rows[k] = row;
      el.first[k] = count;
      float score = 0.0f;
      for (int32_t t = 0; t < steps; ++t) {
        // Written at every step, kept at the valid ones: no branch on the mask.
        const float reward = Keep(valid[offset + t], rewards[offset + t]);
        index[count] = offset + t;
        anchor[count] = anchors[offset + t];
        value[count] = reward;
        score += reward;
        out[offset + t] = 0.0f;
        count += valid[offset + t] != 0;
      }
      el.scores[k] = o.given_scores ? scores[row] : score;
      // R over the row's valid steps, last to first: an invalid step passes R on
      // unchanged (1 R + 0), so skipping it changes no bit.
      float carry = 0.0f;
      for (int32_t e = count - 1; e >= el.first[k]; --e) {
        carry = MultiplyAdd(o.gamma, carry, value[e]);
        value[e] = carry;
        any_nan |= carry != carry;
      }
    }
    el.first[last - first] = count;
    EpisodeAdvantages(o, last - first, el);
    EpisodeGroup(o, anchors, steps, kept, last - first, any_nan, out);
  }
}

void AnchorGroups(ffi::ThreadPool& pool, const float* rewards, const int32_t* anchors,
                  const int32_t* episode_ids, const uint8_t* valid, const float* scores,
                  const Options& o, int64_t batch, int64_t steps, float* out) {
  ByEpisodeGroup(pool, episode_ids, batch,
                 [&](const std::vector<int32_t>& rows, int64_t begin, int64_t end,
                     int64_t largest) {
                   EpisodeGroups(rewards, anchors, episode_ids, valid, scores, o, steps, rows,
                                 begin, end, largest, out);
                 });
}

ffi::Error AnchorGroupsF32(ffi::Buffer<ffi::F32> rewards, ffi::Buffer<ffi::S32> anchors,
                           ffi::Buffer<ffi::S32> episode_ids, ffi::Buffer<ffi::PRED> valid,
                           ffi::Buffer<ffi::F32> episode_scores,
                           ffi::Buffer<ffi::F32> depth_weights, float gamma, float omega,
                           float kappa, bool shrink, bool given_scores, int32_t std_mode,
                           float eps, float one_plus_eps, bool singleton_raw, int64_t min_depth,
                           ffi::ResultBuffer<ffi::F32> out, ffi::ThreadPool pool) {
  const auto dims = rewards.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("anchor_groups: rewards must be [B, T]");
  const int64_t batch = dims[0], steps = dims[1];
  const int64_t n = batch * steps;
  if (anchors.element_count() != n || valid.element_count() != n ||
      out->element_count() != n || episode_ids.element_count() != batch ||
      episode_scores.element_count() != batch) {
    return ffi::Error::InvalidArgument("anchor_groups: inputs disagree in shape");
  }
  const int64_t max_depth = depth_weights.element_count() - 1;
  if (max_depth < 1 || min_depth < 0 || min_depth > max_depth) {
    return ffi::Error::InvalidArgument("anchor_groups: need 0 <= min_depth <= max_depth, 1 <= max_depth");
  }
  if (n >= (int64_t{1} << 31) - steps) {
    return ffi::Error::InvalidArgument("anchor_groups: B x T must be below 2^31");
  }
  if (shrink && min_depth != max_depth) {
    return ffi::Error::InvalidArgument("anchor_groups: kappa needs a single depth");
  }
  const Options options{gamma,    omega, kappa,        shrink,    given_scores,
                        singleton_raw, std_mode, eps, one_plus_eps, min_depth,
                        depth_weights.typed_data(), max_depth};
  // bool has no vector type: the mask is read as bytes.
  AnchorGroups(pool, rewards.typed_data(), anchors.typed_data(), episode_ids.typed_data(),
               reinterpret_cast<const uint8_t*>(valid.typed_data()), episode_scores.typed_data(),
               options, batch, steps, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditAnchorGroupsF32, AnchorGroupsF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // step rewards [B, T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // anchors [B, T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // episode ids [B]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [B, T]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // episode scores [B]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // depth weights [D + 1]
                                  .Attr<float>("gamma")
                                  .Attr<float>("omega")
                                  .Attr<float>("kappa")
                                  .Attr<bool>("shrink")
                                  .Attr<bool>("given_scores")
                                  .Attr<int32_t>("std")
                                  .Attr<float>("eps")
                                  .Attr<float>("one_plus_eps")
                                  .Attr<bool>("singleton_raw")
                                  .Attr<int64_t>("min_depth")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // advantages [B, T]
                                  .Ctx<ffi::ThreadPool>());
