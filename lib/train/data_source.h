#pragma once
/// What the trainer draws its batches from, whatever the examples are: an
/// image set it walks in shuffled epochs, or a stream of tokens whose
/// windows are drawn from the step number (data/tokens.h). The engine turns
/// a BatchRequest into the model's Examples through it.

#include "core/error.h"
#include "data/dataset.h"
#include "model/factory.h"
#include "model/model.h"
#include "tensor/buffer.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace cfmo::train {

struct TrainConfig;

/// Which training examples one step of one worker uses.
struct BatchRequest {
  std::span<const int64_t> indices;  ///< indexed data: the examples, a slice of the epoch's order
  int64_t step = 0;                  ///< sampled data: the worker's step, which draws them
  int count = 0;
};

class DataSource {
 public:
  virtual ~DataSource() = default;
  /// For the summary: the directory read, "synthetic", "text: 431 files".
  virtual std::string description() const = 0;
  virtual model::DataShape shape() const = 0;
  /// Examples in one epoch of the training data (for token data, its training
  /// tokens over the context: one pass over them in windows).
  virtual int64_t train_examples() const = 0;
  /// True when the trainer's epoch order names the examples; false when the
  /// source draws them from the step.
  virtual bool indexed() const = 0;
  /// The request's examples, copied into the source's scratch (valid until the next call).
  virtual model::Examples train_batch(const BatchRequest& request) = 0;
  /// Calls `f` with the evaluation examples, at most `chunk` at a time.
  virtual void for_each_eval_batch(int chunk, const std::function<void(const model::Examples&)>& f) = 0;
  /// The image split, for an engine that uploads it whole (CUDA); null for token data.
  virtual const data::DataSplit* images() const { return nullptr; }
  /// Takes worker `rank`'s part of `world` before the first batch: token
  /// windows come from each worker's own part of the tokens (kInput if it is
  /// shorter than a window); an image set is used whole, cut by the epoch
  /// order. Apart from the load, as a worker reads its data before it knows
  /// its rank (a joiner is taken in ready: train::preload).
  virtual Status take_part(int /*rank*/, int /*world*/) { return {}; }
};

/// An image set in memory (Fashion-MNIST, synthetic), as DataSource.
std::unique_ptr<DataSource> make_image_source(data::DataSplit split);

/// The data `config` names, read and checked whole; `context` is the
/// model's, for token data (0 before the model is known). Its part is
/// taken after (DataSource::take_part).
Result<std::unique_ptr<DataSource>> load_data_source(const TrainConfig& config, int context);

}  // namespace cfmo::train
