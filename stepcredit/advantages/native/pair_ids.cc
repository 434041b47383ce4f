// Dense ids of int32 pairs in one pass: the CPU kernel behind GiGPO's step
// groups (a step group is an (episode group, anchor) pair).
//
//   ids[i] = the number of distinct pairs among (first[j], second[j]) that
//            first occur before the first occurrence of (first[i], second[i])
//
// so equal pairs share an id and the ids are dense in [0, number of pairs).
// A sort finds the same classes in O(n log n) with a comparator call per
// comparison, which on XLA:CPU costs tens of times the memory traffic; an
// open-addressing hash table (linear probing, at most half full) costs a few
// nanoseconds per element.

#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The finaliser of MurmurHash3: every input bit reaches every output bit, so
// the low bits used as the slot are well spread even for consecutive ids.
inline uint64_t Mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

ffi::Error PairIds(ffi::Buffer<ffi::S32> first, ffi::Buffer<ffi::S32> second,
                   ffi::ResultBuffer<ffi::S32> ids) {
  const int64_t n = first.element_count();
  if (second.element_count() != n || ids->element_count() != n) {
    return ffi::Error::InvalidArgument("pair_ids: first, second and ids must have equal sizes");
  }
  uint64_t capacity = 16;
  while (capacity < 2 * static_cast<uint64_t>(n)) capacity <<= 1;
  const uint64_t slot_mask = capacity - 1;
  // Kept between calls (grown, never shrunk): a fresh table this size costs more in
  // page faults than the pass over the pairs does. Only `slots` needs clearing.
  thread_local std::vector<uint64_t> key_table;
  thread_local std::vector<int32_t> slot_table;
  if (key_table.size() < capacity) key_table.resize(capacity);
  slot_table.assign(capacity, -1);
  uint64_t* keys = key_table.data();
  int32_t* slots = slot_table.data();
  const int32_t* a = first.typed_data();
  const int32_t* b = second.typed_data();
  int32_t* out = ids->typed_data();
  int32_t next = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(a[i])) << 32) |
                         static_cast<uint32_t>(b[i]);
    uint64_t slot = Mix(key) & slot_mask;
    while (slots[slot] >= 0 && keys[slot] != key) slot = (slot + 1) & slot_mask;
    if (slots[slot] < 0) {
      slots[slot] = next++;
      keys[slot] = key;
    }
    out[i] = slots[slot];
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditPairIdsS32, PairIds,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // first [n]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // second [n]
                                  .Ret<ffi::Buffer<ffi::S32>>()); // ids [n]
