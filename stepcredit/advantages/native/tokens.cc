// Moving values between the step view [B, T] and the token view [B, N] along
// batch-major rows: the CPU kernels behind `broadcast_to_tokens` and
// `step_rewards_from_tokens` (tokens.py), where XLA:CPU runs a gather and a
// scatter over all B x N tokens at several times the cost of reading them.
//
//   broadcast:  out[b, n] = steps[b, clip(s, 0, T-1)] where s = step_index[b, n] >= 0, else 0
//               (with last_only, also 0 unless n is its step's last token: the next
//               token's index differs, or n ends the row)
//   sums:       out[b, t] = sum of tokens[b, n] over n with step_index[b, n] = t, in token
//               order, as XLA's scatter adds them (so the two give the same float32
//               numbers); indices outside [0, T) are left out.
//
// Sums keep each row's current step in a register and advance eight rows in
// lockstep, so their chains of additions are independent. A large batch's rows
// are shared among XLA's CPU threads.

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using stepcredit::ByRows;

namespace {

constexpr int64_t kRows = 8;

ffi::Error Broadcast(ffi::Buffer<ffi::F32> steps, ffi::Buffer<ffi::S32> step_index,
                     bool last_only, ffi::ResultBuffer<ffi::F32> out, ffi::ThreadPool pool) {
  const auto dims = steps.dimensions();
  const auto token_dims = step_index.dimensions();
  if (dims.size() == 0 || token_dims.size() == 0) {
    return ffi::Error::InvalidArgument("steps_to_tokens: arguments must be [..., T] and [..., N]");
  }
  const int64_t num_steps = dims.back(), length = token_dims.back();
  const int64_t num_rows = num_steps == 0 ? 0 : steps.element_count() / num_steps;
  if (step_index.element_count() != num_rows * length || num_steps == 0) {
    return ffi::Error::InvalidArgument("steps_to_tokens: arguments disagree in their rows");
  }
  const float* x = steps.typed_data();
  const int32_t* index = step_index.typed_data();
  float* y = out->typed_data();
  const int32_t top = static_cast<int32_t>(num_steps - 1);
  auto token = [&](const float* row, int64_t n, bool last) {
    const int32_t s = index[n];
    const float value = row[std::clamp<int32_t>(s, 0, top)];
    return s >= 0 && (last || !last_only) ? value : 0.0f;
  };
  ByRows<1>(pool, num_rows, length, [&](int64_t b, auto) {
    const float* row = x + b * num_steps;
    const int64_t begin = b * length, end = begin + length;
    // The row's last token apart, so that the loop's body has no test of the row's end:
    // 1.7 times as fast at B = 4096, N = 64.
    for (int64_t n = begin; n + 1 < end; ++n) y[n] = token(row, n, index[n + 1] != index[n]);
    if (length > 0) y[end - 1] = token(row, end - 1, true);
  });
  return ffi::Error::Success();
}

template <int64_t Rows>
void SumRows(const float* x, const int32_t* index, int64_t length, int64_t num_steps, float* y) {
  int32_t current[Rows];
  float sum[Rows];
  for (int64_t j = 0; j < Rows; ++j) {
    std::fill(y + j * num_steps, y + (j + 1) * num_steps, 0.0f);
    current[j] = -1;
    sum[j] = 0.0f;
  }
  for (int64_t n = 0; n < length; ++n) {
#pragma GCC unroll 8
    for (int64_t j = 0; j < Rows; ++j) {
      const int32_t s = index[j * length + n];
      if (__builtin_expect(s != current[j], 0)) {
        if (current[j] >= 0) y[j * num_steps + current[j]] = sum[j];
        current[j] = s >= 0 && s < num_steps ? s : -1;
        sum[j] = current[j] >= 0 ? y[j * num_steps + current[j]] : 0.0f;
      }
      if (current[j] >= 0) sum[j] += x[j * length + n];
    }
  }
  for (int64_t j = 0; j < Rows; ++j) {
    if (current[j] >= 0) y[j * num_steps + current[j]] = sum[j];
  }
}

ffi::Error Sums(ffi::Buffer<ffi::F32> tokens, ffi::Buffer<ffi::S32> step_index, int64_t num_steps,
                ffi::ResultBuffer<ffi::F32> out, ffi::ThreadPool pool) {
  const auto dims = tokens.dimensions();
  if (dims.size() == 0 || num_steps < 1) {
    return ffi::Error::InvalidArgument("tokens_to_steps: tokens must be [..., N], num_steps >= 1");
  }
  const int64_t length = dims.back();
  const int64_t num_rows = length == 0 ? 0 : tokens.element_count() / length;
  if (step_index.element_count() != tokens.element_count() ||
      out->element_count() != num_rows * num_steps) {
    return ffi::Error::InvalidArgument("tokens_to_steps: arguments disagree in shape");
  }
  const float* x = tokens.typed_data();
  const int32_t* index = step_index.typed_data();
  float* y = out->typed_data();
  ByRows<kRows>(pool, num_rows, length, [&](int64_t b, auto rows) {
    SumRows<decltype(rows)::value>(x + b * length, index + b * length, length, num_steps, y + b * num_steps);
  });
  if (length == 0) std::fill(y, y + out->element_count(), 0.0f);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditStepsToTokensF32, Broadcast,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // steps [..., T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // step_index [..., N]
                                  .Attr<bool>("last_only")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // [..., N]
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(StepcreditTokensToStepsF32, Sums,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // tokens [..., N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // step_index [..., N]
                                  .Attr<int64_t>("num_steps")
                                  .Ret<ffi::Buffer<ffi::F32>>()   // [..., T]
                                  .Ctx<ffi::ThreadPool>());
