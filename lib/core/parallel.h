#pragma once
/// Runs independent tasks on a few named threads owned by one call: the
/// caller's thread works too, the helpers are joined before it returns, and
/// an exception thrown by a task is rethrown in the caller. Tasks are handed
/// out in index order from one atomic counter, so the result of a reduction
/// that stores per-task partials and combines them by index afterwards does
/// not depend on the thread count.

#include <cstddef>
#include <functional>
#include <string>

namespace cfmo {

/// `requested` threads, or the machine's hardware threads when it is 0.
int resolve_threads(int requested);

/// Calls `task(i)` for every i in [0, count) on up to `threads` threads
/// (named "cfmo-" + `name`, at most 15 characters as Linux allows).
void parallel_for(size_t count, int threads, const std::string& name, const std::function<void(size_t)>& task);

}  // namespace cfmo
