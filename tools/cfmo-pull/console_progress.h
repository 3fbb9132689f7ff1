#pragma once
// cfmo-pull's progress on stderr: on a terminal one line per layer, redrawn
// in place (as docker pull does); elsewhere a plain line per event, so a log
// or CI output reads top to bottom. Notes (a spilled layer, a mirror given
// up) are printed in both modes unless quiet.
#include "../common/terminal.h"
#include "core/progress.h"
#include "oci/hot_set.h"
#include "oci/pull.h"
#include "oci/pull_config.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace cfmo::pull_tool {

class ConsoleProgress final : public oci::PullSink {
 public:
  enum class Mode { kTty, kPlain, kNone };
  ConsoleProgress(const char* tool, Mode mode, bool notes) : tool_(tool), mode_(mode), notes_(notes) {}

  /// The mode --progress asked for: auto is redrawn lines on a terminal, plain lines elsewhere.
  static Mode mode_for(oci::ProgressMode progress) {
    switch (progress) {
      case oci::ProgressMode::kAuto:
        return ::isatty(STDERR_FILENO) != 0 ? Mode::kTty : Mode::kPlain;
      case oci::ProgressMode::kTty:
        return Mode::kTty;
      case oci::ProgressMode::kPlain:
        return Mode::kPlain;
      case oci::ProgressMode::kNone:
        break;
    }
    return Mode::kNone;
  }

  void on_plan(const oci::PullState& state) override {
    std::lock_guard lock(mutex_);
    rows_.clear();
    int64_t hot_bytes = 0;
    size_t hot = 0;
    for (size_t i = 0; i < state.layers.size(); ++i) {
      const auto& l = state.layers[i];
      Row row;
      row.digest = l.blob.digest.substr(7, 12);
      row.size = l.blob.size;
      row.hot = l.hot;
      row.memory = l.location == oci::Placement::kMemory;
      row.status = l.status == oci::LayerStatus::kFetched   ? "present"
                   : l.status == oci::LayerStatus::kSkipped ? "skipped"
                                                            : "waiting";
      if (l.hot) {
        ++hot;
        hot_bytes += l.blob.size;
      }
      rows_.push_back(std::move(row));
    }
    if (mode_ == Mode::kPlain) {
      fmt::print(stderr, "{}: {}: {} layer(s), {} hot ({}), cold layers {}\n", tool_, state.image, state.layers.size(),
                 hot, oci::human_bytes(hot_bytes), state.cold);
    }
    draw(true);
  }

  void on_layer_start(size_t layer) override {
    std::lock_guard lock(mutex_);
    if (layer >= rows_.size()) return;
    rows_[layer].status = "";
    draw(false);
  }

  void on_layer_bytes(size_t layer, int64_t bytes) override {
    std::lock_guard lock(mutex_);
    if (layer >= rows_.size()) return;
    rows_[layer].bytes = bytes;
    draw(false);
  }

  void on_layer_done(size_t layer, const oci::LayerReport& report) override {
    std::lock_guard lock(mutex_);
    if (layer >= rows_.size()) return;
    auto& row = rows_[layer];
    row.bytes = report.state == "failed" ? row.bytes : report.size;
    row.status = report.state == "failed" ? "failed" : fmt::format("{} in {:.2f} s", report.state, report.seconds);
    if (mode_ == Mode::kPlain) {
      fmt::print(stderr, "{}: layer {} {} {} ({}, {}) {}\n", tool_, layer, row.digest, oci::human_bytes(report.size),
                 report.hot ? "hot" : "cold", report.location, row.status);
    }
    draw(true);
  }

  void on_ready(double seconds) override {
    std::lock_guard lock(mutex_);
    if (mode_ == Mode::kPlain) fmt::print(stderr, "{}: ready in {:.2f} s\n", tool_, seconds);
    if (mode_ == Mode::kTty) {
      ready_ = fmt::format("ready in {:.2f} s", seconds);
      draw(true);
    }
  }

  void on_note(const std::string& message) override {
    std::lock_guard lock(mutex_);
    if (!notes_) return;
    if (mode_ == Mode::kTty && drawn_ > 0) {
      // The note goes above the block, which is drawn again below it.
      fmt::print(stderr, "\033[{}A\r\033[J", drawn_);
      drawn_ = 0;
    }
    fmt::print(stderr, "{}: {}\n", tool_, message);
    draw(true);
  }

 private:
  struct Row {
    std::string digest;
    int64_t size = 0;
    int64_t bytes = 0;
    bool hot = false;
    bool memory = false;
    std::string status;  ///< empty while it downloads
  };

  static int columns() { return tool::terminal_columns(STDERR_FILENO); }

  /// Redraws the block (tty only), at most ten times a second unless `force`.
  void draw(bool force) {
    if (mode_ != Mode::kTty || rows_.empty()) return;
    const auto now = std::chrono::steady_clock::now();
    if (!force && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    const int width = columns() - 1;
    std::string out;
    if (drawn_ > 0) out += fmt::format("\033[{}A", drawn_);
    for (size_t i = 0; i < rows_.size(); ++i) {
      const auto& r = rows_[i];
      const std::string label =
          fmt::format("{:>3} {} {} {:<6}", i, r.digest, r.hot ? "hot " : "cold", r.memory ? "memory" : "disk");
      std::string line;
      if (r.status.empty()) {
        ProgressState state;
        state.label = label;
        state.fraction = r.size > 0 ? static_cast<double>(r.bytes) / static_cast<double>(r.size) : 1;
        state.metrics = fmt::format("{} / {}", oci::human_bytes(r.bytes), oci::human_bytes(r.size));
        line = render_progress(state, width);
      } else {
        line = fmt::format("{}  {}  {}", label, oci::human_bytes(r.size), r.status);
        line.resize(std::min(line.size(), static_cast<size_t>(std::max(width, 0))));
      }
      out += "\r\033[2K" + line + "\n";
    }
    int lines = static_cast<int>(rows_.size());
    if (!ready_.empty()) {
      out += "\r\033[2K" + ready_ + "\n";
      ++lines;
    }
    std::fwrite(out.data(), 1, out.size(), stderr);
    std::fflush(stderr);
    drawn_ = lines;
  }

  const char* tool_;
  Mode mode_;
  bool notes_;
  std::mutex mutex_;  ///< guards everything below: the observer is called from the download threads
  std::vector<Row> rows_;
  std::string ready_;
  int drawn_ = 0;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace cfmo::pull_tool
