// When this process started, for a joiner's first_step_s.
#include "commands.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace cfmo::train_tool {

std::chrono::steady_clock::time_point process_started() {
  const auto now = std::chrono::steady_clock::now();
  std::ifstream stat_file("/proc/self/stat");
  std::ifstream uptime_file("/proc/uptime");
  std::string stat;
  std::getline(stat_file, stat);
  double uptime = 0;
  uptime_file >> uptime;
  const size_t close = stat.rfind(')');  // the command name may hold spaces
  if (close == std::string::npos || uptime <= 0) return now;
  std::istringstream fields(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
    if (i < 22) continue;
    const double started_s = std::strtod(field.c_str(), nullptr) / static_cast<double>(::sysconf(_SC_CLK_TCK));
    const double age = std::clamp(uptime - started_s, 0.0, 3600.0);
    return now - std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(age));
  }
  return now;
}

}  // namespace cfmo::train_tool
