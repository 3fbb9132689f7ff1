#pragma once
// cfmo-train's view of a run's progress on stderr.

#include "core/progress.h"
#include "train/trainer.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace cfmo::train_tool {

/// Progress on stderr: a redrawn bar on a terminal, plain lines elsewhere.
class ConsoleObserver final : public train::TrainObserver {
 public:
  ConsoleObserver(bool tty, bool quiet) : tty_(tty), quiet_(quiet) {}

  void on_step(const train::StepEvent& e) override {
    if (quiet_) return;
    if (tty_) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_draw_ < std::chrono::milliseconds(100) && e.fraction < 1.0) return;
      last_draw_ = now;
      ProgressState state{e.fraction, e.eta_s, fmt::format("epoch {} step {}", e.epoch + 1, e.step),
                          fmt::format("loss {:.4f}  {} samples/s", e.loss, human_count(e.samples_per_s))};
      fmt::print(stderr, "\r\033[K{}", render_progress(state, columns()));
      drawn_ = true;
    } else if (e.logged) {
      fmt::print(stderr, "step {}  epoch {}  loss {:.4f}  lr {:.3g}  {} samples/s\n", e.step, e.epoch + 1, e.loss, e.lr,
                 human_count(e.samples_per_s));
    }
  }

  void on_eval(const train::EvalEvent& e) override {
    if (quiet_) return;
    clear_line();
    fmt::print(stderr, "{} step {}: test accuracy {:.4f}  test loss {:.4f}  ({:.1f}s)\n",
               e.final ? "final" : fmt::format("epoch {:.0f}", e.epochs), e.step, e.test_accuracy, e.test_loss,
               e.elapsed_s);
  }

  void on_note(std::string_view text) override {
    if (quiet_) return;
    clear_line();
    fmt::print(stderr, "{}\n", text);
  }

  void on_warning(std::string_view text) override {
    clear_line();
    fmt::print(stderr, "{}\n", text);
  }

  void clear_line() {
    if (drawn_) fmt::print(stderr, "\r\033[K");
    drawn_ = false;
  }

 private:
  static int columns() {
    const char* env = std::getenv("COLUMNS");
    int n = env != nullptr ? std::atoi(env) : 0;
    return n > 20 ? n : 100;
  }

  bool tty_;
  bool quiet_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace cfmo::train_tool
