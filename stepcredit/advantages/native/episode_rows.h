// What the kernels that work one episode group at a time share: the rows ordered by
// episode group, and the parts of them that XLA's CPU threads share (`InParallel`).

#ifndef STEPCREDIT_NATIVE_EPISODE_ROWS_H_
#define STEPCREDIT_NATIVE_EPISODE_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace stepcredit {

// Rows prefetched ahead of the one being gathered: rows ordered by episode group come
// in no order the hardware prefetcher follows.
constexpr int64_t kAhead = 4;

// The fewest rows a part is worth handing to another thread for.
constexpr int64_t kRowsPerPart = 512;

// The rows of `episode_ids` grouped by id, each group's rows in batch order: a counting
// sort over the ids' range where it is small, else a stable sort.
inline void SortRows(const int32_t* episode_ids, int64_t batch, std::vector<int32_t>& rows,
                     std::vector<int32_t>& starts) {
  rows.resize(batch);
  if (batch == 0) return;
  const auto [low, high] = std::minmax_element(episode_ids, episode_ids + batch);
  const int64_t range = static_cast<int64_t>(*high) - *low + 1;
  if (range <= 4 * batch + 64) {
    starts.assign(range + 1, 0);
    for (int64_t r = 0; r < batch; ++r) ++starts[episode_ids[r] - *low + 1];
    std::partial_sum(starts.begin(), starts.end(), starts.begin());
    for (int64_t r = 0; r < batch; ++r) rows[starts[episode_ids[r] - *low]++] = r;
  } else {
    std::iota(rows.begin(), rows.end(), 0);
    std::stable_sort(rows.begin(), rows.end(),
                     [&](int32_t x, int32_t y) { return episode_ids[x] < episode_ids[y]; });
  }
}

// The bounds of the parts of `rows` (ordered by `SortRows`): part p is
// rows[bounds[p], bounds[p + 1]), starting at the first episode group at or after an equal
// share of the rows, one part per thread of `pool` and at most one per kRowsPerPart rows.
// Sets *largest to the most rows an episode group has.
inline std::vector<int64_t> Parts(xla::ffi::ThreadPool& pool, const int32_t* episode_ids,
                                  const std::vector<int32_t>& rows, int64_t* largest) {
  const int64_t batch = static_cast<int64_t>(rows.size());
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t parts = std::clamp<int64_t>(batch / kRowsPerPart, 1, threads);
  std::vector<int64_t> bounds(parts + 1, batch);
  bounds[0] = 0;
  *largest = 0;
  for (int64_t first = 0, last, part = 1; first < batch; first = last) {
    for (last = first + 1; last < batch && episode_ids[rows[last]] == episode_ids[rows[first]];
         ++last) {
    }
    *largest = std::max(*largest, last - first);
    while (part < parts && last >= part * batch / parts) bounds[part++] = last;
  }
  return bounds;
}

// Orders the rows by episode group (`SortRows`) and runs work(rows, begin, end, largest)
// on each part of them (`Parts`), the parts shared among the threads of `pool`.
template <typename Work>
void ByEpisodeGroup(xla::ffi::ThreadPool& pool, const int32_t* episode_ids, int64_t batch,
                    const Work& work) {
  struct Sorting {
    std::vector<int32_t> rows, starts;
  };
  Sorting& sorting = PerThread<Sorting>();
  SortRows(episode_ids, batch, sorting.rows, sorting.starts);
  int64_t largest = 0;
  const std::vector<int64_t> bounds = Parts(pool, episode_ids, sorting.rows, &largest);
  InParallel(pool, static_cast<int64_t>(bounds.size()) - 1, [&](int64_t part) {
    work(sorting.rows, bounds[part], bounds[part + 1], largest);
  });
}

}  // namespace stepcredit

#endif  // STEPCREDIT_NATIVE_EPISODE_ROWS_H_
