#include "cuda/devices.h"

#include <algorithm>

#if CFMO_HAVE_CUDA
#include "cuda/runtime.h"
#endif

namespace cfmo::cuda {

tensor::Device device_for_rank(const tensor::Device& device, int local_rank) {
  if (!device.is_cuda() || device.index >= 0) return device;
  const int local = std::max(0, local_rank);
  int count = 1;
#if CFMO_HAVE_CUDA
  count = std::max(1, cuda::device_count());
#endif
  return tensor::Device{tensor::DeviceKind::kCuda, local % count};
}

bool cuda_built() { return CFMO_HAVE_CUDA != 0; }

Status check_device(const tensor::Device& device, std::string_view flag) {
  if (!device.is_cuda()) return {};
#if CFMO_HAVE_CUDA
  return cuda::check_device(device.index < 0 ? 0 : device.index, flag, device.to_string());
#else
  return make_error(ErrorKind::kUsage,
                    "{} {}: no CUDA device: this build has no CUDA backend (configure with meson -Dcuda=enabled "
                    "where the CUDA toolkit is installed)",
                    flag, device.to_string());
#endif
}

std::string device_description(const tensor::Device& device) {
  if (!device.is_cuda()) return "cpu";
#if CFMO_HAVE_CUDA
  return cuda::describe_device(device.index < 0 ? 0 : device.index);
#else
  return device.to_string();
#endif
}

}  // namespace cfmo::cuda
