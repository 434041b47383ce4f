// IGPO's information gain in two passes over batch-major [..., T] rows: the CPU
// kernel behind `igpo.information_gain`.
//
// With b_t the belief at turn t (exp of the answer's mean log-prob for the
// probability gain, the log-prob itself for the log-probability gain):
//
//   IG_t = b_{t'} - b_t   at a valid turn t whose row has a later valid turn t'
//                         (the first after t),
//   IG_t = 0              at a row's last valid turn and at invalid turns.
//
// XLA:CPU runs this as the next-valid recurrence, an argmax for each row's last
// valid turn and the element-wise steps between, each a pass over the B x T
// elements. Here the beliefs take one vectorised pass and the gains one pass per
// row. The exponential is `Exp` (simd.h), so with the probability gain the result
// equals the XLA path's to float32 rounding, not bit for bit; the log-probability
// gain is the same subtraction, bit for bit. A NaN log-prob at a valid turn gives
// NaN at that turn and at the valid turn before it, as in the XLA path.

#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "simd.h"

namespace ffi = xla::ffi;
using namespace stepcredit;  // NOLINT: the shared vector helpers

namespace {

ffi::Error InformationGain(ffi::Buffer<ffi::F32> answer_logp, ffi::Buffer<ffi::PRED> mask,
                           bool probability, ffi::ResultBuffer<ffi::F32> out) {
  const auto dims = answer_logp.dimensions();
  if (dims.size() == 0 || mask.element_count() != answer_logp.element_count()) {
    return ffi::Error::InvalidArgument("information_gain: answer_logp and mask must be [..., T]");
  }
  const int64_t n = answer_logp.element_count(), length = dims.back();
  const int64_t rows = length == 0 ? 0 : n / length;
  const float* logp = answer_logp.typed_data();
  const bool* valid = mask.typed_data();
  float* gain = out->typed_data();

  // The beliefs, in a per-thread buffer padded to whole vectors.
  std::vector<float>& kept = PerThread<std::vector<float>>();
  const int64_t padded = (n + kLanes - 1) / kLanes * kLanes;
  kept.resize(padded);
  float* belief = kept.data();
  std::memcpy(belief, logp, n * sizeof(float));
  std::memset(belief + n, 0, (padded - n) * sizeof(float));
  if (probability) {
    for (int64_t i = 0; i < padded; i += kLanes) {
      const f32x8 b = Exp(Load(belief + i));
      std::memcpy(belief + i, &b, sizeof b);
    }
  }
  for (int64_t b = 0; b < rows; ++b) {
    float next = 0.0f;
    bool later = false;  // a valid turn after t in this row
    for (int64_t i = (b + 1) * length - 1; i >= b * length; --i) {
      gain[i] = valid[i] & later ? next - belief[i] : 0.0f;
      next = valid[i] ? belief[i] : next;
      later |= valid[i];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditInformationGainF32, InformationGain,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // answer_logp [..., T]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [..., T]
                                  .Attr<bool>("probability")
                                  .Ret<ffi::Buffer<ffi::F32>>()); // [..., T]
