#include "diverge/plot.h"

#include "support/well_formed_xml.h"

#include <gtest/gtest.h>

#include <cmath>
#include <regex>

namespace cfmo::diverge {
namespace {

std::vector<PlotSeries> sample_series() {
  return {{0, {{1, 0.02}, {2, 0.03}, {3, 0.07}, {4, 0.04}}},
          {1, {{1, 0.01}, {2, std::nan("")}, {3, 0.02}, {4, 0.025}}}};
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(XmlCheckTest, CatchesBrokenDocuments) {
  EXPECT_EQ(testing::xml_problem("<a><b x=\"1\"/></a>"), "");
  EXPECT_NE(testing::xml_problem("<a><b></a>"), "");
  EXPECT_NE(testing::xml_problem("<a x=1/>"), "");
  EXPECT_NE(testing::xml_problem("<a>1 < 2</a>"), "");
  EXPECT_NE(testing::xml_problem("<a>&nbsp;</a>"), "");
  EXPECT_NE(testing::xml_problem("<a/><b/>"), "");
  EXPECT_NE(testing::xml_problem("<a>"), "");
}

TEST(SvgTest, WellFormedWithAxesLegendThresholdAndALinePerRank) {
  SvgOptions options;
  options.threshold = 0.05;
  options.subtitle = "runs/<odd> & \"quoted\"";
  const std::string svg = render_svg(sample_series(), options);
  EXPECT_EQ(testing::xml_problem(svg), "") << svg;
  EXPECT_NE(svg.find("xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  EXPECT_NE(svg.find("runs/&lt;odd&gt; &amp; &quot;quoted&quot;"), std::string::npos);
  EXPECT_NE(svg.find(">round</text>"), std::string::npos);
  EXPECT_NE(svg.find("relative L2 (%)"), std::string::npos);
  EXPECT_NE(svg.find("threshold 5%"), std::string::npos);
  EXPECT_NE(svg.find("stroke-dasharray=\"6 4\""), std::string::npos);
  EXPECT_NE(svg.find(">rank 0</text>"), std::string::npos);
  EXPECT_NE(svg.find(">rank 1</text>"), std::string::npos);
  // Rank 1's line is broken where its value is undefined: 1 + 2 polylines.
  EXPECT_EQ(count(svg, "<polyline"), 3u);
  EXPECT_EQ(count(svg, "<circle"), 7u);
  // The y axis reaches past the largest value (7%) and the threshold.
  EXPECT_NE(svg.find(">6</text>"), std::string::npos) << svg;
  // Every coordinate is a number inside the picture.
  const std::regex coordinate(R"re((?:x|y|cx|cy|x1|x2|y1|y2)="(-?[0-9.]+)")re");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), coordinate); it != std::sregex_iterator(); ++it) {
    const double v = std::stod((*it)[1]);
    EXPECT_GE(v, 0);
    EXPECT_LE(v, 800);
  }
}

TEST(SvgTest, EmptyAndSinglePointPlotsAreStillWellFormed) {
  EXPECT_EQ(testing::xml_problem(render_svg({}, {})), "");
  EXPECT_NE(render_svg({}, {}).find("no rounds"), std::string::npos);
  const std::vector<PlotSeries> one = {{3, {{7, 0.0}}}};
  const std::string svg = render_svg(one, {});
  EXPECT_EQ(testing::xml_problem(svg), "") << svg;
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);
  // Many ranks: the colours repeat with a dash pattern.
  std::vector<PlotSeries> many;
  for (int r = 0; r < 12; ++r) many.push_back({r, {{1, 0.01 * r}, {2, 0.02}}});
  const std::string crowded = render_svg(many, {.threshold = 0.05});
  EXPECT_EQ(testing::xml_problem(crowded), "");
  EXPECT_NE(crowded.find(">rank 11</text>"), std::string::npos);
}

TEST(SvgTest, SeriesComeFromTheReportByRankAndRound) {
  Report report;
  auto row = [](int rank, int64_t round, double rel) {
    DeltaRow r;
    r.rank = rank;
    r.round = round;
    r.overall.rel_l2 = rel;
    return r;
  };
  report.deltas = {row(1, 2, 0.2), row(0, 2, 0.1), row(1, 1, 0.3), DeltaRow{}};
  const auto series = rel_l2_series(report);
  ASSERT_EQ(series.size(), 2u);
  EXPECT_EQ(series[0].rank, 0);
  ASSERT_EQ(series[1].points.size(), 2u);
  EXPECT_EQ(series[1].points[0], (std::pair<int64_t, double>{1, 0.3}));
}

TEST(SparklineTest, OneLinePerRankOnACommonAxis) {
  const std::string text = render_sparklines(sample_series(), 0.05, 100);
  EXPECT_NE(text.find("rounds 1..4"), std::string::npos) << text;
  EXPECT_NE(text.find("threshold 5%"), std::string::npos);
  EXPECT_NE(text.find("rank 0   \u2583\u2584\u2588\u2585  last 4%  max 7% at round 3  1 above 5%"), std::string::npos)
      << text;
  // Rank 1's undefined round is a gap.
  EXPECT_NE(text.find("rank 1   \u2582 \u2583\u2584  last 2.5%"), std::string::npos) << text;
}

TEST(SparklineTest, ManyRoundsShareCells) {
  PlotSeries s{0, {}};
  for (int64_t r = 0; r < 1000; ++r) s.points.emplace_back(r, r == 500 ? 1.0 : 0.01);
  const std::string text = render_sparklines(std::vector<PlotSeries>{s}, std::nullopt, 80);
  EXPECT_NE(text.find("per character, the largest shown"), std::string::npos) << text;
  EXPECT_NE(text.find("\u2588"), std::string::npos);  // the spike survives the bucketing
  const auto line = text.substr(text.find("rank 0"));
  EXPECT_LE(line.size(), 80u * 3);  // block characters are 3 bytes each
}

}  // namespace
}  // namespace cfmo::diverge
