#include "cuda/cublas_api.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

namespace {

bool cublas_mapped() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("libcublas") != std::string::npos) return true;
  }
  return false;
}

// Linking cuBLAS made every process of a CUDA build 210 MB resident before
// main(); it must load only when a CUDA context asks for it.
TEST(CublasApi, LoadsOnFirstUseAndResolvesEveryEntryPoint) {
  EXPECT_FALSE(cublas_mapped());
  const auto api = cfmo::cuda::cublas_api();
  ASSERT_TRUE(api) << api.error().message;
  EXPECT_TRUE(cublas_mapped());
  const cfmo::cuda::CublasApi& a = **api;
  EXPECT_NE(a.create, nullptr);
  EXPECT_NE(a.destroy, nullptr);
  EXPECT_NE(a.set_stream, nullptr);
  EXPECT_NE(a.set_math_mode, nullptr);
  EXPECT_NE(a.status_string, nullptr);
  EXPECT_NE(a.sgemm, nullptr);
  EXPECT_NE(a.sgemv, nullptr);
  EXPECT_STRNE(a.status_string(CUBLAS_STATUS_NOT_INITIALIZED), "");
  // A second call returns the same table, not a second load.
  EXPECT_EQ(*cfmo::cuda::cublas_api(), *api);
}

}  // namespace
