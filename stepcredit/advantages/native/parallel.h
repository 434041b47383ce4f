// Running a kernel's independent pieces on XLA's CPU threads: the parts of a call, and
// the rows of a batch-major array cut into one part per thread.

#ifndef STEPCREDIT_NATIVE_PARALLEL_H_
#define STEPCREDIT_NATIVE_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace stepcredit {

// Runs work(part) for every part in [0, parts), on the calling thread and as many of
// XLA's threads as are free: each part is claimed once, by whichever thread comes first,
// so the call never waits for a task that has not started. A task that starts after
// every part is claimed touches nothing but the shared counters.
template <typename Work>
void InParallel(xla::ffi::ThreadPool& pool, int64_t parts, const Work& work) {
  struct Progress {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto progress = std::make_shared<Progress>();
  auto run = [progress, parts, &work] {
    for (int64_t part; (part = progress->next.fetch_add(1)) < parts;) {
      work(part);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t k = 1; k < parts; ++k) pool.Schedule([run] { run(); });
  run();
  while (progress->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

// The fewest elements a part of `ByRows` is worth handing to another thread for: below
// it, waking a thread costs more than it saves.
constexpr int64_t kElementsPerPart = int64_t{1} << 16;

// Runs work(b, rows) over rows [0, num_rows) of `row_length` elements each, `rows` an
// std::integral_constant: Block for each block of Block rows starting at b, then 1 for
// each row left over. The rows are cut into one part per thread of `pool` (fewer where a
// part would hold under kElementsPerPart elements), each part's first row a multiple of
// Block, so that only the last part has rows left over.
template <int64_t Block, typename Work>
void ByRows(xla::ffi::ThreadPool& pool, int64_t num_rows, int64_t row_length, const Work& work) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t parts = std::clamp<int64_t>(num_rows * row_length / kElementsPerPart, 1, threads);
  auto bound = [&](int64_t part) {
    return part == parts ? num_rows : part * num_rows / parts / Block * Block;
  };
  InParallel(pool, parts, [&](int64_t part) {
    const int64_t end = bound(part + 1);
    int64_t b = bound(part);
    for (; b + Block <= end; b += Block) work(b, std::integral_constant<int64_t, Block>());
    for (; b < end; ++b) work(b, std::integral_constant<int64_t, 1>());
  });
}

}  // namespace stepcredit

#endif  // STEPCREDIT_NATIVE_PARALLEL_H_
