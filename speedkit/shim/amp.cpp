// Autocast state (at::autocast keeps one enabled flag and one dtype per device type, thread-local) and
// the GradScaler's fused unscale + inf check.
#include "shim.h"

#include <ATen/Functions.h>
#include <ATen/autocast_mode.h>

extern "C" {

int sk_autocast_get(int device_type, int* enabled, int* dtype) {
  SK_TRY({
    const auto dt = static_cast<c10::DeviceType>(device_type);
    *enabled = at::autocast::is_autocast_enabled(dt) ? 1 : 0;
    *dtype = static_cast<int>(at::autocast::get_autocast_dtype(dt));
  })
}

int sk_autocast_set(int device_type, int enabled, int dtype) {
  SK_TRY({
    const auto dt = static_cast<c10::DeviceType>(device_type);
    at::autocast::set_autocast_dtype(dt, static_cast<c10::ScalarType>(dtype));
    at::autocast::set_autocast_enabled(dt, enabled != 0);
  })
}

int sk_autocast_increment_nesting(int* depth) { SK_TRY(*depth = at::autocast::increment_nesting()) }

int sk_autocast_decrement_nesting(int* depth) { SK_TRY(*depth = at::autocast::decrement_nesting()) }

int sk_autocast_clear_cache(void) { SK_TRY(at::autocast::clear_cache()) }

// torch._amp_foreach_non_finite_check_and_unscale_: grads *= inv_scale; found_inf = 1 if any non-finite.
int sk_amp_unscale_(const sk_tensor* grads, int64_t n, sk_tensor found_inf, sk_tensor inv_scale) {
  SK_TRY({
    auto list = sk::tensor_list(grads, n);
    at::_amp_foreach_non_finite_check_and_unscale_(list, *found_inf, *inv_scale);
  })
}

}  // extern "C"
