#include "core/parallel.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace cfmo {

int resolve_threads(int requested) {
  if (requested > 0) return requested;
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware > 0 ? static_cast<int>(hardware) : 1;
}

void parallel_for(size_t count, int threads, const std::string& name, const std::function<void(size_t)>& task) {
  const size_t workers = std::min<size_t>(count, static_cast<size_t>(std::max(resolve_threads(threads), 1)));
  if (workers <= 1) {
    for (size_t i = 0; i < count; ++i) task(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;  // guards first_error
  std::exception_ptr first_error;
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < count && !failed.load(); i = next.fetch_add(1)) {
      try {
        task(i);
      } catch (...) {  // handed to the caller below, never swallowed
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        failed.store(true);
      }
    }
  };
  const std::string thread_name = ("cfmo-" + name).substr(0, 15);
  std::vector<std::thread> helpers;
  helpers.reserve(workers - 1);
  for (size_t t = 1; t < workers; ++t) {
    helpers.emplace_back(work);
    pthread_setname_np(helpers.back().native_handle(), thread_name.c_str());
  }
  work();
  for (auto& helper : helpers) helper.join();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace cfmo
