// One worker: nothing to reconcile, whatever the mode's name.
#include "train/modes.h"

#include <memory>

namespace cfmo::train::modes {
namespace {

class SoloMode final : public Mode {
 public:
  explicit SoloMode(std::string_view name) : name_(name) {}
  std::string_view name() const override { return name_; }

 private:
  std::string_view name_;  ///< the table's, which outlives every mode
};

}  // namespace

std::unique_ptr<Mode> make_solo(std::string_view name) { return std::make_unique<SoloMode>(name); }

}  // namespace cfmo::train::modes
