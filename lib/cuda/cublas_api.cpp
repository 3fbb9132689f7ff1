#include "cuda/cublas_api.h"

#include <dlfcn.h>

#include <string>

namespace cfmo::cuda {
namespace {

template <typename F>
bool resolve(void* lib, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(lib, name));
  return out != nullptr;
}

Result<CublasApi> load() {
  // The soname of the headers we compiled against; dlopen searches the
  // executable's RUNPATH, where the build put the toolkit's lib directory.
  const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return make_error(ErrorKind::kInternal, "cuBLAS: cannot load {}: {}", soname, dlerror());
  CublasApi api;
  const char* missing = nullptr;
  if (!resolve(lib, "cublasCreate_v2", api.create)) missing = "cublasCreate_v2";
  if (!resolve(lib, "cublasDestroy_v2", api.destroy)) missing = "cublasDestroy_v2";
  if (!resolve(lib, "cublasSetStream_v2", api.set_stream)) missing = "cublasSetStream_v2";
  if (!resolve(lib, "cublasSetMathMode", api.set_math_mode)) missing = "cublasSetMathMode";
  if (!resolve(lib, "cublasGetStatusString", api.status_string)) missing = "cublasGetStatusString";
  if (!resolve(lib, "cublasSgemm_v2", api.sgemm)) missing = "cublasSgemm_v2";
  if (!resolve(lib, "cublasSgemv_v2", api.sgemv)) missing = "cublasSgemv_v2";
  if (missing != nullptr) return make_error(ErrorKind::kInternal, "cuBLAS: {} lacks {}", soname, missing);
  return api;
}

}  // namespace

Result<const CublasApi*> cublas_api() {
  static const Result<CublasApi> loaded = load();  // a thread-safe static initialisation
  if (!loaded) return loaded.error();
  return &*loaded;
}

}  // namespace cfmo::cuda
