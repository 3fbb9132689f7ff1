#include "core/progress.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>

namespace cfmo {
namespace {

TEST(HumanCountTest, SmallCountsArePlain) {
  EXPECT_EQ(human_count(0), "0");
  EXPECT_EQ(human_count(7), "7");
  EXPECT_EQ(human_count(1234), "1234");
  EXPECT_EQ(human_count(9999), "9999");
}

TEST(HumanCountTest, ThousandsAndMillions) {
  EXPECT_EQ(human_count(10000), "10.0k");
  EXPECT_EQ(human_count(41234), "41.2k");
  EXPECT_EQ(human_count(999000), "999.0k");
  EXPECT_EQ(human_count(1e6), "1.00M");
  EXPECT_EQ(human_count(5e6), "5.00M");
  EXPECT_EQ(human_count(12.345e6), "12.35M");
}

TEST(HumanDurationTest, MinutesAndSeconds) {
  EXPECT_EQ(human_duration(0), "0:00");
  EXPECT_EQ(human_duration(9), "0:09");
  EXPECT_EQ(human_duration(59.4), "0:59");
  EXPECT_EQ(human_duration(59.6), "1:00");  // rounded, not truncated
  EXPECT_EQ(human_duration(75), "1:15");
  EXPECT_EQ(human_duration(3599), "59:59");
}

TEST(HumanDurationTest, HoursMinutesAndSeconds) {
  EXPECT_EQ(human_duration(3600), "1:00:00");
  EXPECT_EQ(human_duration(3700), "1:01:40");
  EXPECT_EQ(human_duration(90061), "25:01:01");
}

TEST(HumanDurationTest, UnknownForNegativeOrNotFinite) {
  EXPECT_EQ(human_duration(-1), "?");
  EXPECT_EQ(human_duration(std::numeric_limits<double>::quiet_NaN()), "?");
  EXPECT_EQ(human_duration(std::numeric_limits<double>::infinity()), "?");
}

TEST(HumanDurationTest, UnknownBeyondAnyRealRun) {
  // An ETA from a tiny fraction can be astronomically large; it must not overflow the integer conversion.
  EXPECT_EQ(human_duration(1e300), "?");
  EXPECT_EQ(human_duration(std::numeric_limits<double>::max()), "?");
}

ProgressState state(double fraction, double eta_s, std::string label = "epoch 2/10",
                    std::string metrics = "loss 0.41") {
  ProgressState s;
  s.fraction = fraction;
  s.eta_s = eta_s;
  s.label = std::move(label);
  s.metrics = std::move(metrics);
  return s;
}

TEST(RenderProgressTest, HalfwayBar) {
  const std::string line = render_progress(state(0.5, 10), 80);
  EXPECT_EQ(line.size(), 80u) << line;
  EXPECT_TRUE(line.starts_with("epoch 2/10 [")) << line;
  EXPECT_NE(line.find("]  50%"), std::string::npos) << line;
  EXPECT_NE(line.find("  loss 0.41"), std::string::npos) << line;
  EXPECT_TRUE(line.ends_with("  ETA 0:10")) << line;
  const auto open = line.find('[');
  const auto close = line.find(']');
  const std::string bar = line.substr(open + 1, close - open - 1);
  const auto filled = std::count(bar.begin(), bar.end(), '#');
  EXPECT_EQ(filled, static_cast<long>(bar.size()) / 2) << bar;
  EXPECT_EQ(filled + std::count(bar.begin(), bar.end(), '.'), static_cast<long>(bar.size())) << bar;
}

TEST(RenderProgressTest, StartAndEnd) {
  const std::string start = render_progress(state(0, -1), 80);
  EXPECT_NE(start.find("[....."), std::string::npos) << start;
  EXPECT_NE(start.find("]   0%"), std::string::npos) << start;
  EXPECT_EQ(start.find('#'), std::string::npos) << start;
  EXPECT_EQ(start.find("ETA"), std::string::npos) << start;  // no rate measured yet
  EXPECT_EQ(start.size(), 80u) << start;

  const std::string end = render_progress(state(1, 0), 80);
  EXPECT_EQ(end.find('.', end.find('[')), end.find("0.41") + 1) << end;  // the only '.' is in the metrics
  EXPECT_NE(end.find("] 100%"), std::string::npos) << end;
  EXPECT_TRUE(end.ends_with("ETA 0:00")) << end;
}

TEST(RenderProgressTest, FractionAboveOneIsClamped) {
  const std::string line = render_progress(state(1.7, -1), 80);
  EXPECT_NE(line.find("] 100%"), std::string::npos) << line;
  EXPECT_EQ(line.size(), 80u) << line;
}

TEST(RenderProgressTest, UnknownFractionHasNoBar) {
  for (double fraction : {-1.0, std::numeric_limits<double>::quiet_NaN()}) {
    EXPECT_EQ(render_progress(state(fraction, -1), 80), "epoch 2/10   loss 0.41");
    // A time limit can give an ETA even when the fraction of the data is unknown.
    EXPECT_EQ(render_progress(state(fraction, 90), 80), "epoch 2/10   loss 0.41  ETA 1:30");
  }
}

TEST(RenderProgressTest, UnknownEtaIsLeftOut) {
  for (double eta : {-1.0, -0.001, std::numeric_limits<double>::quiet_NaN()}) {
    const std::string line = render_progress(state(0.5, eta), 80);
    EXPECT_EQ(line.find("ETA"), std::string::npos) << line;
    EXPECT_TRUE(line.ends_with("loss 0.41")) << line;
  }
}

TEST(RenderProgressTest, NoLabelNoMetrics) {
  const std::string line = render_progress(state(0.25, 90, "", ""), 40);
  EXPECT_TRUE(line.starts_with("[")) << line;
  EXPECT_NE(line.find("]  25%"), std::string::npos) << line;
  EXPECT_TRUE(line.ends_with("  ETA 1:30")) << line;
  EXPECT_EQ(line.size(), 40u) << line;
}

TEST(RenderProgressTest, AstronomicalEtaIsUnknown) {
  // A rate measured over almost no progress can give any ETA at all.
  EXPECT_TRUE(render_progress(state(1e-9, 1e300), 80).ends_with("ETA ?"));
  EXPECT_TRUE(render_progress(state(0.5, std::numeric_limits<double>::infinity()), 80).ends_with("ETA ?"));
}

TEST(RenderProgressTest, NeverWiderThanTheTerminal) {
  // A line wider than the terminal wraps, and the next '\r' redraw then leaves a trail of lines.
  const std::string long_metrics(200, 'm');
  for (int width : {-5, 0, 1, 10, 20, 30, 40, 60, 80, 120, 200}) {
    for (double fraction : {-1.0, 0.0, 0.01, 0.5, 0.999, 1.0}) {
      for (double eta : {-1.0, 5.0, 400000.0}) {
        for (const auto& metrics : {std::string(), std::string("loss 0.41  41.2k samples/s"), long_metrics}) {
          const std::string line = render_progress(state(fraction, eta, "epoch 12/100", metrics), width);
          EXPECT_LE(line.size(), static_cast<size_t>(std::max(width, 0))) << "width " << width << ": " << line;
        }
      }
    }
  }
}

TEST(RenderProgressTest, NarrowTerminalDropsTheBarFirst) {
  const std::string line = render_progress(state(0.5, 10), 30);
  EXPECT_EQ(line.find('['), std::string::npos) << line;
  EXPECT_TRUE(line.starts_with("epoch 2/10   loss 0.41")) << line;
  EXPECT_EQ(line.size(), 30u) << line;
}

}  // namespace
}  // namespace cfmo
