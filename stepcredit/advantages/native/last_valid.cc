// Each row's last valid position in one pass over batch-major [..., T] rows: the
// CPU kernel behind `mt_grpo.final_turns`, where XLA:CPU runs an argmax (a
// reduction over (value, index) pairs) and a comparison over the B x T elements.
//
//   last_t = mask_t and no mask_s for s > t in the row   (none in an all-False row)

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error LastValid(ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::PRED> out) {
  const auto dims = mask.dimensions();
  if (dims.size() == 0) return ffi::Error::InvalidArgument("final_turns: mask must be [..., T]");
  const int64_t n = mask.element_count(), length = dims.back();
  const int64_t rows = length == 0 ? 0 : n / length;
  const bool* valid = mask.typed_data();
  bool* last = out->typed_data();
  for (int64_t b = 0; b < rows; ++b) {
    bool later = false;  // a valid position after t in this row
    for (int64_t i = (b + 1) * length - 1; i >= b * length; --i) {
      last[i] = valid[i] & !later;
      later |= valid[i];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditLastValid, LastValid,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::PRED>>()   // mask [..., T]
                                  .Ret<ffi::Buffer<ffi::PRED>>()); // [..., T]
