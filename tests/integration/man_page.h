#pragma once
// The check every tool's integration test makes of its man page: the
// generated page committed beside the scdoc source is what scdoc makes of it.

#include "integration/harness.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>

namespace cfmo::testing {

/// man/NAME.1 equals `scdoc < man/NAME.1.scd`, apart from the date scdoc
/// stamps into the .TH line; skipped where scdoc is not installed.
inline void expect_generated_man_page_current(const std::filesystem::path& source_root, const std::string& name) {
  if (std::system("command -v scdoc >/dev/null 2>&1") != 0) GTEST_SKIP() << "scdoc not installed";
  TempDir dir;
  const auto source = source_root / "man" / (name + ".1.scd");
  const std::string command = "scdoc < '" + source.string() + "' > '" + (dir / "page.1").string() + "'";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  auto without_date = [](const std::string& page) {
    return std::regex_replace(page, std::regex(R"(\n\.TH [^\n]*)"), "\n.TH");
  };
  EXPECT_EQ(without_date(slurp(dir / "page.1")), without_date(slurp(source_root / "man" / (name + ".1"))))
      << "run: scdoc < man/" << name << ".1.scd > man/" << name << ".1";
}

}  // namespace cfmo::testing
