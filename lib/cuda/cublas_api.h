#pragma once
/// cuBLAS, opened when the first CUDA context is made instead of linked:
/// libcublasLt's initialisers make about 210 MB resident in every process
/// that links it, and a CUDA build's CPU runs (and `--version`) must not pay
/// that. The handful of entry points the backend calls, resolved once.

#include "core/error.h"

#include <cublas_v2.h>

namespace cfmo::cuda {

struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  decltype(&cublasSgemv_v2) sgemv = nullptr;
};

/// The loaded API, or kInternal naming the library and the missing symbol.
/// Thread-safe; the library stays loaded for the life of the process.
Result<const CublasApi*> cublas_api();

}  // namespace cfmo::cuda
