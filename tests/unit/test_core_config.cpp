#include "core/config.h"
#include "support/expect_error.h"

#include "integration/harness.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace cfmo {
namespace {

// One target of every type the table supports; the defaults differ from every value a test sets,
// so each test can tell where a value came from. Not copyable: the table points into it.
struct Options {
  bool verbose = false;
  bool cache = true;
  int epochs = 3;
  int64_t steps = 1000;
  double lr = 0.1;
  std::string name = "default";
  std::vector<std::string> tags = {"default-tag"};
  OptionTable table;

  Options() {
    table.add("verbose", &verbose, "print more");
    table.add("cache", &cache, "keep a cache", "behaviour");
    table.add("epochs", &epochs, "epochs to run", "length");
    table.add("steps", &steps, "steps to run", "length");
    table.add("lr", &lr, "learning rate", "optim");
    table.add("name", &name, "run name", "output");
    table.add("tags", &tags, "labels for the run", "output");
  }
  Options(const Options&) = delete;
  Options& operator=(const Options&) = delete;
};

// CLI11 2.1's parse(std::vector<std::string>&) consumes its arguments from the back,
// so the natural order is reversed here once instead of in every test.
void parse_args(CLI::App& app, std::vector<std::string> args) {
  std::reverse(args.begin(), args.end());
  app.parse(args);
}

TEST(OptionTableTest, FlagForTurnsUnderscoresIntoDashes) {
  EXPECT_EQ(OptionTable::flag_for("batch_size"), "--batch-size");
  EXPECT_EQ(OptionTable::flag_for("lr"), "--lr");
  EXPECT_EQ(OptionTable::flag_for("clip_grad_norm"), "--clip-grad-norm");
}

TEST(OptionTableTest, DefaultsStayWithoutFlagsOrFile) {
  Options o;
  CLI::App app;
  o.table.register_cli(app);
  parse_args(app, {});
  EXPECT_FALSE(o.verbose);
  EXPECT_TRUE(o.cache);
  EXPECT_EQ(o.epochs, 3);
  EXPECT_EQ(o.steps, 1000);
  EXPECT_DOUBLE_EQ(o.lr, 0.1);
  EXPECT_EQ(o.name, "default");
  EXPECT_EQ(o.tags, std::vector<std::string>{"default-tag"});
  for (const char* key : {"verbose", "cache", "epochs", "steps", "lr", "name", "tags"}) {
    EXPECT_FALSE(o.table.given_on_cli(key)) << key;
  }
}

TEST(OptionTableTest, FlagsSetEveryType) {
  Options o;
  CLI::App app;
  o.table.register_cli(app);
  parse_args(app, {"--verbose", "--epochs", "7", "--steps", "5000000000", "--lr", "0.25", "--name", "run-1", "--tags",
                   "x", "y"});
  EXPECT_TRUE(o.verbose);
  EXPECT_TRUE(o.cache);
  EXPECT_EQ(o.epochs, 7);
  EXPECT_EQ(o.steps, int64_t{5'000'000'000});
  EXPECT_DOUBLE_EQ(o.lr, 0.25);
  EXPECT_EQ(o.name, "run-1");
  EXPECT_EQ(o.tags, (std::vector<std::string>{"x", "y"}));
  for (const char* key : {"verbose", "epochs", "steps", "lr", "name", "tags"}) {
    EXPECT_TRUE(o.table.given_on_cli(key)) << key;
  }
  EXPECT_FALSE(o.table.given_on_cli("cache"));
  EXPECT_FALSE(o.table.given_on_cli("no_such_key"));
}

TEST(OptionTableTest, AShortAliasSetsTheSameOption) {
  std::string output = "-";
  bool quiet = false;
  OptionTable table;
  table.add("output", &output, "where", "", "-o");
  table.add("quiet", &quiet, "hush", "", "-q");
  CLI::App app;
  table.register_cli(app);
  parse_args(app, {"-o", "plot.svg", "-q"});
  EXPECT_EQ(output, "plot.svg");
  EXPECT_TRUE(quiet);
  EXPECT_TRUE(table.given_on_cli("output"));
  EXPECT_NE(app.get_option("--no-quiet"), nullptr);
}

TEST(OptionTableTest, NoFlagClearsABoolean) {
  Options o;
  CLI::App app;
  o.table.register_cli(app);
  parse_args(app, {"--no-cache"});
  EXPECT_FALSE(o.cache);
  // --no-FLAG counts as giving the flag, so a file cannot turn the value back on.
  EXPECT_TRUE(o.table.given_on_cli("cache"));
}

TEST(OptionTableTest, RepeatedListFlagReplacesTheDefault) {
  Options o;
  CLI::App app;
  o.table.register_cli(app);
  parse_args(app, {"--tags", "a", "--tags", "b"});
  EXPECT_EQ(o.tags, (std::vector<std::string>{"a", "b"}));
}

TEST(OptionTableTest, BadFlagValuesAreRejectedByTheParser) {
  {
    Options o;
    CLI::App app;
    o.table.register_cli(app);
    EXPECT_THROW(parse_args(app, {"--epochs", "many"}), CLI::ParseError);
  }
  {
    Options o;
    CLI::App app;
    o.table.register_cli(app);
    EXPECT_THROW(parse_args(app, {"--epochs", "3000000000"}), CLI::ParseError);
  }
  {
    Options o;
    CLI::App app;
    o.table.register_cli(app);
    EXPECT_THROW(parse_args(app, {"--no-such-flag"}), CLI::ParseError);
  }
}

TEST(OptionTableTest, FileSetsEveryType) {
  Options o;
  ASSERT_TRUE(o.table.load_toml_text(R"(
verbose = true
cache = false
epochs = 12
steps = 9000000000
lr = 2.5e-3
name = "from-file"
tags = ["p", "q", "r"]
)",
                                     "test.toml"));
  EXPECT_TRUE(o.verbose);
  EXPECT_FALSE(o.cache);
  EXPECT_EQ(o.epochs, 12);
  EXPECT_EQ(o.steps, int64_t{9'000'000'000});
  EXPECT_DOUBLE_EQ(o.lr, 2.5e-3);
  EXPECT_EQ(o.name, "from-file");
  EXPECT_EQ(o.tags, (std::vector<std::string>{"p", "q", "r"}));
}

TEST(OptionTableTest, FileWithoutCliRegistrationLoads) {
  // A table never registered with CLI11 has no flags, so no key is skipped.
  Options o;
  ASSERT_TRUE(o.table.load_toml_text("epochs = 5", "t.toml"));
  EXPECT_EQ(o.epochs, 5);
  EXPECT_FALSE(o.table.given_on_cli("epochs"));
}

TEST(OptionTableTest, FlagBeatsFileBeatsDefault) {
  Options o;
  CLI::App app;
  o.table.register_cli(app);
  parse_args(app, {"--epochs", "40", "--name", "from-flag", "--no-cache", "--tags", "flag-tag"});
  ASSERT_TRUE(o.table.load_toml_text(R"(
epochs = 12
lr = 0.5
name = "from-file"
cache = true
tags = ["file-tag"]
)",
                                     "run.toml"));
  EXPECT_EQ(o.epochs, 40);         // flag
  EXPECT_EQ(o.name, "from-flag");  // flag
  EXPECT_FALSE(o.cache);           // --no-cache beats cache = true
  EXPECT_EQ(o.tags, std::vector<std::string>{"flag-tag"});
  EXPECT_DOUBLE_EQ(o.lr, 0.5);  // file
  EXPECT_EQ(o.steps, 1000);     // default
  EXPECT_FALSE(o.verbose);      // default
}

TEST(OptionTableTest, FlagWinsEvenWhenTheFileValueIsBad) {
  // The key is skipped, not checked: a flag can override a stale entry in a shared file.
  Options o;
  CLI::App app;
  o.table.register_cli(app);
  parse_args(app, {"--epochs", "4"});
  ASSERT_TRUE(o.table.load_toml_text("epochs = \"lots\"", "run.toml"));
  EXPECT_EQ(o.epochs, 4);
}

TEST(OptionTableTest, UnknownKeyIsAUsageErrorNamingKeyAndSource) {
  Options o;
  auto status = o.table.load_toml_text("epochs = 2\nbatch_sise = 64\n", "my-run.toml");
  EXPECT_TRUE(fails_with(status, ErrorKind::kUsage, {"batch_sise", "my-run.toml"}));
}

TEST(OptionTableTest, UnknownTableIsAUsageError) {
  Options o;
  EXPECT_TRUE(
      fails_with(o.table.load_toml_text("[optim]\nlr = 0.1\n", "t.toml"), ErrorKind::kUsage, {"optim", "t.toml"}));
}

struct WrongType {
  const char* text;
  const char* key;
};

TEST(OptionTableTest, WrongTypesAreUsageErrorsNamingTheKey) {
  const WrongType cases[] = {
      {"epochs = \"5\"", "epochs"},          // string for an int
      {"epochs = 1.5", "epochs"},            // float for an int
      {"epochs = 2.0", "epochs"},            // float for an int, even when whole
      {"epochs = 2147483648", "epochs"},     // just above 32-bit range
      {"epochs = -2147483649", "epochs"},    // just below 32-bit range
      {"epochs = true", "epochs"},           // bool for an int
      {"steps = 1e3", "steps"},              // float for an int64
      {"steps = \"1000\"", "steps"},         // string for an int64
      {"lr = \"0.1\"", "lr"},                // string for a double
      {"lr = true", "lr"},                   // bool for a double
      {"verbose = 1", "verbose"},            // int for a bool
      {"verbose = \"true\"", "verbose"},     // string for a bool
      {"name = true", "name"},               // bool for a string
      {"name = [\"a\"]", "name"},            // array for a string
      {"tags = [\"a\", 1]", "tags"},         // non-string array item
      {"tags = [[\"a\"]]", "tags"},          // nested array
      {"tags = 5", "tags"},                  // number for a list
      {"epochs = [1]", "epochs"},            // array for an int
      {"epochs = { value = 1 }", "epochs"},  // table for an int
      {"lr = 1979-05-27", "lr"},             // date for a double
  };
  for (const auto& c : cases) {
    Options o;
    EXPECT_TRUE(fails_with(o.table.load_toml_text(c.text, "bad.toml"), ErrorKind::kUsage, {c.key, "bad.toml"}))
        << c.text;
  }
}

TEST(OptionTableTest, IntBoundsAreAccepted) {
  Options o;
  ASSERT_TRUE(o.table.load_toml_text("epochs = 2147483647", "t.toml"));
  EXPECT_EQ(o.epochs, std::numeric_limits<int>::max());
  ASSERT_TRUE(o.table.load_toml_text("epochs = -2147483648", "t.toml"));
  EXPECT_EQ(o.epochs, std::numeric_limits<int>::min());
  ASSERT_TRUE(o.table.load_toml_text("steps = -9223372036854775808", "t.toml"));
  EXPECT_EQ(o.steps, std::numeric_limits<int64_t>::min());
}

TEST(OptionTableTest, IntegerIsAcceptedForADouble) {
  Options o;
  ASSERT_TRUE(o.table.load_toml_text("lr = 1", "t.toml"));
  EXPECT_EQ(o.lr, 1.0);
  ASSERT_TRUE(o.table.load_toml_text("lr = -3", "t.toml"));
  EXPECT_EQ(o.lr, -3.0);
}

TEST(OptionTableTest, NumberIsAcceptedForAString) {
  // Strings such as durations are parsed later, so "time_limit = 90" must read as "90".
  Options o;
  ASSERT_TRUE(o.table.load_toml_text("name = 90", "t.toml"));
  EXPECT_EQ(o.name, "90");
  ASSERT_TRUE(o.table.load_toml_text("name = 1.5", "t.toml"));
  EXPECT_EQ(o.name, "1.5");
  // No digits may be lost on the way to text.
  ASSERT_TRUE(o.table.load_toml_text("name = 0.123456789", "t.toml"));
  EXPECT_EQ(std::stod(o.name), 0.123456789);
}

TEST(OptionTableTest, SingleStringIsAcceptedForAList) {
  Options o;
  ASSERT_TRUE(o.table.load_toml_text("tags = \"solo\"", "t.toml"));
  EXPECT_EQ(o.tags, std::vector<std::string>{"solo"});
  ASSERT_TRUE(o.table.load_toml_text("tags = []", "t.toml"));
  EXPECT_TRUE(o.tags.empty());
}

TEST(OptionTableTest, SyntaxErrorNamesSourceAndLine) {
  Options o;
  auto status = o.table.load_toml_text("epochs = 3\n\nlr = = 0.1\n", "broken.toml");
  EXPECT_TRUE(fails_with(status, ErrorKind::kUsage, {"broken.toml", "line 3"}));
}

TEST(OptionTableTest, DuplicateKeyIsASyntaxError) {
  Options o;
  EXPECT_TRUE(fails_with(o.table.load_toml_text("epochs = 3\nepochs = 4\n", "dup.toml"), ErrorKind::kUsage,
                         {"dup.toml", "line 2"}));
}

TEST(OptionTableTest, EmptyTextChangesNothing) {
  Options o;
  ASSERT_TRUE(o.table.load_toml_text("", "empty.toml"));
  ASSERT_TRUE(o.table.load_toml_text("# only a comment\n", "empty.toml"));
  EXPECT_EQ(o.epochs, 3);
  EXPECT_EQ(o.name, "default");
}

// A fresh directory per test, removed afterwards.
class OptionTableFileTest : public ::testing::Test {
 protected:
  testing::TempDir temp_;
  const std::filesystem::path dir_ = temp_.path();
};

TEST_F(OptionTableFileTest, LoadTomlReadsAFile) {
  const auto path = dir_ / "run.toml";
  std::ofstream(path) << "epochs = 9\nname = \"file\"\n";
  Options o;
  ASSERT_TRUE(o.table.load_toml(path));
  EXPECT_EQ(o.epochs, 9);
  EXPECT_EQ(o.name, "file");
}

TEST_F(OptionTableFileTest, ErrorsInAFileNameThePath) {
  const auto path = dir_ / "run.toml";
  std::ofstream(path) << "epochs = 9\nwat = 1\n";
  Options o;
  EXPECT_TRUE(fails_with(o.table.load_toml(path), ErrorKind::kUsage, {path.string(), "wat"}));
}

TEST_F(OptionTableFileTest, MissingFileIsAUsageErrorNamingIt) {
  const auto path = dir_ / "missing.toml";
  Options o;
  EXPECT_TRUE(fails_with(o.table.load_toml(path), ErrorKind::kUsage, {path.string()}));
}

TEST_F(OptionTableFileTest, DirectoryIsNotAConfigFile) {
  Options o;
  EXPECT_TRUE(fails_with(o.table.load_toml(dir_), ErrorKind::kUsage, {dir_.string(), "a directory"}));
}

TEST_F(OptionTableFileTest, AFifoIsRefusedWithoutBeingOpened) {
  // Opening a FIFO with no writer would block for ever; it is refused by its type.
  const auto fifo = dir_ / "config.fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  Options o;
  EXPECT_TRUE(fails_with(o.table.load_toml(fifo), ErrorKind::kUsage, {fifo.string(), "a FIFO"}));
  EXPECT_TRUE(fails_with(read_config_file("/dev/null"), ErrorKind::kUsage, {"/dev/null", "a device"}));
  EXPECT_TRUE(fails_with(read_config_file(dir_ / "none.toml"), ErrorKind::kUsage, {"none.toml", "no such file"}));
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(OptionTableTest, ToTomlPutsTheHelpLineBeforeEachKey) {
  Options o;
  const auto lines = lines_of(o.table.to_toml());
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"verbose", "# print more"},     {"cache", "# keep a cache"}, {"epochs", "# epochs to run"},
      {"steps", "# steps to run"},     {"lr", "# learning rate"},   {"name", "# run name"},
      {"tags", "# labels for the run"}};
  size_t found = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto eq = lines[i].find(" = ");
    if (lines[i].empty() || lines[i][0] == '#') continue;
    ASSERT_NE(eq, std::string::npos) << lines[i];
    ASSERT_LT(found, expected.size());
    EXPECT_EQ(lines[i].substr(0, eq), expected[found].first);
    ASSERT_GT(i, 0u);
    EXPECT_EQ(lines[i - 1], expected[found].second);
    ++found;
  }
  EXPECT_EQ(found, expected.size());
  // Groups are headed once, in order of first use.
  EXPECT_NE(std::find(lines.begin(), lines.end(), "# --- length ---"), lines.end());
  EXPECT_EQ(std::count(lines.begin(), lines.end(), "# --- output ---"), 1);
}

TEST(OptionTableTest, ToTomlRoundTrips) {
  Options a;
  a.verbose = true;
  a.cache = false;
  a.epochs = std::numeric_limits<int>::min();
  a.steps = std::numeric_limits<int64_t>::max();
  a.lr = 0.1 + 0.2;  // not exactly 0.3: every digit must survive
  a.name = "quote \" backslash \\ tab \t newline \n unicode \xc3\xa9 end";
  a.tags = {"", "two words", "[bracket]", "#hash"};
  const std::string text = a.table.to_toml();

  Options b;
  ASSERT_TRUE(b.table.load_toml_text(text, "round-trip")) << text;
  EXPECT_EQ(b.verbose, a.verbose);
  EXPECT_EQ(b.cache, a.cache);
  EXPECT_EQ(b.epochs, a.epochs);
  EXPECT_EQ(b.steps, a.steps);
  EXPECT_EQ(b.lr, a.lr);
  EXPECT_EQ(b.name, a.name);
  EXPECT_EQ(b.tags, a.tags);
  EXPECT_EQ(b.table.to_toml(), text);
}

TEST(OptionTableTest, ToTomlRoundTripsDoubles) {
  for (double value : {0.0, -0.0, 1.0, 3e-8, 1e300, -2.5, 1.0 / 3.0, 123456789.125}) {
    Options a;
    a.lr = value;
    Options b;
    ASSERT_TRUE(b.table.load_toml_text(a.table.to_toml(), "round-trip")) << value;
    EXPECT_EQ(b.lr, value);
  }
}

TEST(OptionTableTest, ToTomlRoundTripsAnEmptyList) {
  Options a;
  a.tags.clear();
  Options b;
  ASSERT_TRUE(b.table.load_toml_text(a.table.to_toml(), "round-trip"));
  EXPECT_TRUE(b.tags.empty());
}

TEST(OptionTableTest, ToTomlKeepsMultiLineHelpInComments) {
  bool flag = false;
  OptionTable table;
  table.add("flag", &flag, "first line\nsecond line");
  const std::string text = table.to_toml();
  for (const auto& line : lines_of(text)) {
    EXPECT_TRUE(line.empty() || line[0] == '#' || line.starts_with("flag = ")) << line;
  }
  bool reloaded = true;
  OptionTable again;
  again.add("flag", &reloaded, "");
  EXPECT_TRUE(again.load_toml_text(text, "round-trip")) << text;
  EXPECT_FALSE(reloaded);
}

TEST(ParseDurationTest, AcceptsSecondsAndUnits) {
  const std::pair<const char*, double> cases[] = {
      {"90", 90},   {"90s", 90},     {"0", 0},      {"1.5m", 90}, {"2min", 120},
      {"2h", 7200}, {"250ms", 0.25}, {"0.5s", 0.5}, {"1e2", 100}, {"3600s", 3600},
  };
  for (const auto& [text, seconds] : cases) {
    auto result = parse_duration(text);
    ASSERT_TRUE(result) << text << ": " << result.error().message;
    EXPECT_DOUBLE_EQ(*result, seconds) << text;
  }
}

TEST(ParseDurationTest, RejectsBadText) {
  for (const char* text :
       {"", "x", "-1", "-0.5s", "5d", "5 s", " 5", "5S", "s", "m5", "1.5.2", "inf", "nan", "5ss", "+5", "1e999"}) {
    EXPECT_TRUE(fails_with(parse_duration(text), ErrorKind::kUsage, {std::string("'") + text + "'"})) << text;
  }
}

TEST(ParseSizeTest, AcceptsBinaryMultiples) {
  const std::pair<const char*, uint64_t> cases[] = {
      {"0", 0},
      {"512", 512},
      {"512B", 512},
      {"64K", 64 * 1024},
      {"64k", 64 * 1024},
      {"64KiB", 64 * 1024},
      {"64KB", 64 * 1024},
      {"3M", 3 * 1024 * 1024},
      {"1.5G", 1536ull * 1024 * 1024},
      {"2GB", 2ull * 1024 * 1024 * 1024},
      {"2gib", 2ull * 1024 * 1024 * 1024},
      {"1T", 1ull << 40},
      {"0.5K", 512},
  };
  for (const auto& [text, bytes] : cases) {
    auto result = parse_size(text);
    ASSERT_TRUE(result) << text << ": " << result.error().message;
    EXPECT_EQ(*result, bytes) << text;
  }
}

// Two subcommands: "a" knows epochs, "b" knows name; both know lr.
SharedConfigShape two_subcommands(bool sections) {
  SharedConfigShape shape;
  shape.subcommands = {"a", "b"};
  shape.knows = [](size_t s, std::string_view key) {
    return key == "lr" || (s == 0 && key == "epochs") || (s == 1 && key == "name");
  };
  shape.sections = sections;
  return shape;
}

TEST_F(OptionTableFileTest, ASharedFileGivesEachSubcommandItsKeys) {
  const auto path = dir_ / "tool.toml";
  std::ofstream(path) << "epochs = 7\nname = \"shared\"\n";
  Options o;
  ASSERT_TRUE(load_shared_config(o.table, path, two_subcommands(false), 0));
  EXPECT_EQ(o.epochs, 7);
  EXPECT_EQ(o.name, "default");  // only "b" takes it
}

TEST_F(OptionTableFileTest, ASectionOverridesTheTopLevelForItsSubcommandOnly) {
  const auto path = dir_ / "tool.toml";
  std::ofstream(path) << "epochs = 7\n[a]\nepochs = 8\n[b]\nname = \"b's\"\n";
  Options a;
  ASSERT_TRUE(load_shared_config(a.table, path, two_subcommands(true), 0));
  EXPECT_EQ(a.epochs, 8);
  EXPECT_EQ(a.name, "default");
}

TEST_F(OptionTableFileTest, ASharedFileRefusesWhatNoSubcommandKnows) {
  const auto path = dir_ / "tool.toml";
  std::ofstream(path) << "epochs = 7\nwat = 1\n";
  Options o;
  EXPECT_TRUE(fails_with(load_shared_config(o.table, path, two_subcommands(false), 0), ErrorKind::kUsage,
                         {path.string(), "unknown key 'wat'"}));
  // A mistake in another subcommand's section shows too.
  std::ofstream(path) << "[b]\nepochs = 1\n";
  EXPECT_TRUE(fails_with(load_shared_config(o.table, path, two_subcommands(true), 0), ErrorKind::kUsage,
                         {"unknown key 'b.epochs'"}));
  // Without sections, a table named after a subcommand is just an unknown key.
  std::ofstream(path) << "[a]\nepochs = 1\n";
  EXPECT_TRUE(
      fails_with(load_shared_config(o.table, path, two_subcommands(false), 0), ErrorKind::kUsage, {"unknown key 'a'"}));
  EXPECT_TRUE(fails_with(load_shared_config(o.table, dir_ / "missing.toml", two_subcommands(false), 0),
                         ErrorKind::kUsage, {"no such file"}));
}

TEST(ParseSizeTest, RejectsBadText) {
  for (const char* text :
       {"", "12Q", "-3", "-1K", "K", "KB", "12 K", "12KK", "12KiBB", "12P", "inf", "nan", "x12", "1e999"}) {
    EXPECT_TRUE(fails_with(parse_size(text), ErrorKind::kUsage, {std::string("'") + text + "'"})) << text;
  }
}

TEST(ParseSizeTest, RejectsSizesBeyond64Bits) {
  // 2^24 T is 2^64 bytes: one past what uint64_t holds.
  EXPECT_TRUE(fails_with(parse_size("16777216T"), ErrorKind::kUsage, {"16777216T"}));
  EXPECT_TRUE(fails_with(parse_size("1e30"), ErrorKind::kUsage, {"1e30"}));
  auto largest = parse_size("16777215T");
  ASSERT_TRUE(largest);
  EXPECT_EQ(*largest, uint64_t{16777215} << 40);
}

}  // namespace
}  // namespace cfmo
