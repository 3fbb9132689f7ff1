#include "model/moe_mlp.h"

#include "model/expert_exchange.h"
#include "model/gpt.h"
#include "moe/stats.h"
#include "tensor/ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

namespace cfmo::model {

using tensor::ops::Trans;

void expert_forward(const float* x, int n, const ExpertTensors& w, int c, int d, float* fc, float* act, float* y) {
  if (n == 0) return;
  gpt::linear_forward(fc, x, w.fc_w, w.fc_b, n, c, d);
  gpt::gelu_forward(act, fc, static_cast<size_t>(n) * static_cast<size_t>(d));
  gpt::linear_forward(y, act, w.proj_w, w.proj_b, n, d, c);
}

void expert_backward_inputs(const float* dy, int n, const float* fc, const ExpertTensors& w, int c, int d, float* d_act,
                            float* dx) {
  if (n == 0) return;
  // linear_backward's dx products, without its weight gradients.
  tensor::ops::gemm(Trans::kNo, Trans::kYes, n, d, c, 1.0f, dy, c, w.proj_w, c, 0.0f, d_act, d);
  gpt::gelu_backward(d_act, d_act, fc, static_cast<size_t>(n) * static_cast<size_t>(d));
  tensor::ops::gemm(Trans::kNo, Trans::kYes, n, c, d, 1.0f, d_act, d, w.fc_w, d, 0.0f, dx, c);
}

void expert_backward_weights(const float* dy, int n, const float* x, const float* act, const float* d_act,
                             const ExpertTensors& g, int c, int d) {
  if (n == 0) return;
  gpt::linear_backward(nullptr, g.proj_w, g.proj_b, dy, act, nullptr, n, d, c);
  gpt::linear_backward(nullptr, g.fc_w, g.fc_b, d_act, x, nullptr, n, c, d);
}

void expert_backward(const float* dy, int n, const float* x, const float* fc, const float* act, const ExpertTensors& w,
                     const ExpertTensors& g, int c, int d, float* d_act, float* dx) {
  // The same products as one linear_backward per layer, each gradient
  // buffer written by the same call: async dispatch adds the weight
  // gradients later, in this order, and matches bit for bit.
  expert_backward_inputs(dy, n, fc, w, c, d, d_act, dx);
  expert_backward_weights(dy, n, x, act, d_act, g, c, d);
}

MoeMlp::MoeMlp(int dim, int experts, int top_k, int expert_dim, const MoeOptions& options)
    : dim_(dim),
      experts_(experts),
      top_k_(top_k),
      expert_dim_(expert_dim),
      options_(options),
      rank_(options.expert_rank),
      placement_{experts, options.expert_ranks, /*strided=*/true} {}

void MoeMlp::set_expert_parallel(comm::Communicator* comm, ExpertExchange* exchange, int layer) {
  comm_ = comm;
  exchange_ = exchange;
  layer_ = layer;
}

namespace {

/// Sizes each of `buffers` to the rows it will receive.
void size_rows(std::vector<std::vector<std::byte>>& buffers, size_t ranks, const auto& rows_of, size_t row_bytes) {
  buffers.resize(ranks);
  for (size_t p = 0; p < ranks; ++p) buffers[p].resize(rows_of(p) * row_bytes);
}

}  // namespace

int64_t MoeMlp::capacity(int rows) const {
  if (options_.drop_policy == moe::DropPolicy::kDropless) return -1;
  return moe::expert_capacity(rows, top_k_, experts_, options_.capacity_factor);
}

size_t MoeMlp::workspace_floats(int rows) const {
  const auto r = static_cast<size_t>(rows);
  const auto e = static_cast<size_t>(experts_);
  const size_t a = r * static_cast<size_t>(top_k_);
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  // logits, probs, d_logits; lse; in, out, d_out, d_in; fc, act, d_act; the routing's
  // expert, gate, kept, slot and d_gate per assignment (counted as floats).
  return 3 * r * e + r + a * (4 * c + 3 * d) + 5 * a;
}

namespace {

/// Zero-filled to `n` (its pages touched), then emptied: the capacity stays.
template <typename T>
void touch(std::vector<T>& v, size_t n) {
  v.resize(n);
  v.clear();
}

}  // namespace

size_t MoeMlp::rows_to(int experts, int rows) const {
  const size_t all = static_cast<size_t>(rows) * static_cast<size_t>(top_k_);
  const int64_t cap = capacity(rows);
  return cap < 0 ? all : std::min(all, static_cast<size_t>(experts) * static_cast<size_t>(cap));
}

void MoeMlp::prepare(int rows) {
  const auto r = static_cast<size_t>(rows);
  const auto e = static_cast<size_t>(experts_);
  const auto k = static_cast<size_t>(top_k_);
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  const auto ranks = static_cast<size_t>(placement_.ranks);
  const auto to_experts = [&](int count) { return rows_to(count, rows); };
  touch(logits_, r * e);
  touch(probs_, r * e);
  touch(d_logits_, r * e);
  touch(lse_, r);
  touch(routing_.expert, r * k);
  touch(routing_.gate, r * k);
  touch(d_gate_, r * k);
  const size_t row = c * sizeof(float);
  send_.resize(ranks);
  results_.resize(ranks);
  received_.resize(ranks);
  size_t in_rows = 0;
  for (size_t p = 0; p < ranks; ++p) {
    const size_t out = to_experts(placement_.count(static_cast<int>(p)));
    touch(send_[p], out * row);
    touch(results_[p], out * row);
    if (exchange_ != nullptr) continue;  // async: the exchange serves peers' rows
    touch(received_[p], to_experts(local_experts()) * row);
    in_rows += to_experts(local_experts());
  }
  for (auto* v : {&in_, &out_, &d_out_, &d_in_}) touch(*v, in_rows * c);
  for (auto* v : {&fc_, &act_, &d_act_}) touch(*v, in_rows * d);
}

void MoeMlp::forward(const float* x, const float* residual, int rows, const float* router,
                     std::span<const ExpertTensors> experts, float* y) {
  rows_ = rows;
  const auto r = static_cast<size_t>(rows);
  const auto e_count = static_cast<size_t>(experts_);
  logits_.resize(r * e_count);
  probs_.resize(r * e_count);
  lse_.resize(r);
  if (rows > 0) {
    tensor::ops::gemm(Trans::kNo, Trans::kNo, rows, experts_, dim_, 1.0f, x, dim_, router, experts_, 0.0f,
                      logits_.data(), experts_);
  }
  moe::Routing& routing = routing_;
  routing.tokens = rows;
  routing.top_k = top_k_;
  routing.experts = experts_;
  routing.expert.resize(r * static_cast<size_t>(top_k_));
  routing.gate.resize(routing.expert.size());
  routing.load.assign(e_count, 0);
  std::vector<double> mean_prob(e_count, 0.0);
  double z_sum = 0;
  for (size_t t = 0; t < r; ++t) {
    const float* row = logits_.data() + t * e_count;
    float* prob = probs_.data() + t * e_count;
    moe::softmax_row(row, experts_, prob);
    const float top = *std::max_element(row, row + e_count);
    double sum = 0;
    for (size_t e = 0; e < e_count; ++e) sum += std::exp(static_cast<double>(row[e] - top));
    const double lse = static_cast<double>(top) + std::log(sum);
    lse_[t] = static_cast<float>(lse);
    z_sum += lse * lse;
    for (size_t e = 0; e < e_count; ++e) mean_prob[e] += prob[e];
    int32_t* chosen = routing.expert.data() + t * static_cast<size_t>(top_k_);
    moe::top_k_row(prob, experts_, top_k_, chosen, routing.gate.data() + t * static_cast<size_t>(top_k_), order_);
    for (int j = 0; j < top_k_; ++j) ++routing.load[static_cast<size_t>(chosen[j])];
  }
  moe::apply_capacity(routing, capacity(rows));
  aux_loss_ = 0;
  if (rows > 0) {
    const double assignments = static_cast<double>(routing.expert.size());
    for (size_t e = 0; e < e_count; ++e) {
      aux_loss_ += static_cast<double>(routing.load[e]) / assignments * (mean_prob[e] / static_cast<double>(r));
    }
    aux_loss_ *= static_cast<double>(experts_);
  }
  z_loss_ = rows > 0 ? z_sum / static_cast<double>(r) : 0.0;

  // The kept assignments by owner rank (with one rank: all of them, by
  // expert), dispatched as cfmo-moe dispatches them; the owners compute and
  // send the results back, which combine with the gates.
  if (exchange_ != nullptr) {
    // Async: late ranks' results stay empty (their assignments take the residual).
    timing_ = Timing{};
    plan_ = moe::plan_dispatch(routing_, placement_);
    exchange_->forward(layer_, x, top_k_, plan_, results_, have_, timing_);
  } else if (status_) {
    status_ = dispatch_forward(x, experts);
  }
  if (!status_) {
    // A failed exchange (a peer lost): every token takes the residual path; the run ends with the status.
    const auto ranks = static_cast<size_t>(placement_.ranks);
    incoming_.assign(ranks, std::vector<uint32_t>(static_cast<size_t>(local_experts()), 0));
    first_row_.assign(ranks, 0);
    in_.clear();
    fc_.clear();
    act_.clear();
    received_.assign(ranks, {});
    results_.assign(ranks, {});
  }
  std::vector<const float*> result_rows(routing.expert.size(), nullptr);
  std::vector<float> unused;
  for (size_t p = 0; p < results_.size(); ++p) {
    moe::locate_results(results_[p], plan_.slots[p], comm::WireDtype::kFp32, dim_, unused, result_rows);
  }
  moe::combine(residual, routing, result_rows, dim_, y);
}

size_t MoeMlp::rows_from(size_t rank) const {
  size_t n = 0;
  for (const uint32_t v : incoming_[rank]) n += v;
  return n;
}

Status MoeMlp::dispatch_forward(const float* x, std::span<const ExpertTensors> experts) {
  timing_ = Timing{};
  plan_ = moe::plan_dispatch(routing_, placement_);
  const auto ranks = static_cast<size_t>(placement_.ranks);
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  const size_t row = c * sizeof(float);
  send_.resize(ranks);
  for (size_t p = 0; p < ranks; ++p) {
    send_[p].clear();
    moe::encode_rows(x, dim_, top_k_, plan_.slots[p], comm::WireDtype::kFp32, send_[p]);
  }
  auto start = moe::Clock::now();
  CFMO_ASSIGN_OR_RETURN(incoming_, moe::exchange_counts(comm_, plan_, local_experts()));
  size_rows(
      received_, ranks, [&](size_t p) { return rows_from(p); }, row);
  CFMO_TRY(moe::exchange_buffers(comm_, send_, received_));
  timing_.dispatch_s += moe::seconds_between(start, moe::Clock::now());

  // The owner's side: every source rank's rows, by local expert, one block each.
  first_row_.assign(ranks, 0);
  size_t total = 0;
  for (size_t p = 0; p < ranks; ++p) {
    first_row_[p] = total;
    total += rows_from(p);
  }
  in_.resize(total * c);
  fc_.resize(total * d);
  act_.resize(total * d);
  out_.resize(total * c);
  for (size_t p = 0; p < ranks; ++p)
    std::memcpy(in_.data() + first_row_[p] * c, received_[p].data(), received_[p].size());
  size_t first = 0;
  for (size_t p = 0; p < ranks; ++p) {
    for (size_t i = 0; i < incoming_[p].size(); ++i) {
      const auto n = static_cast<int>(incoming_[p][i]);
      expert_forward(in_.data() + first * c, n, experts[i], dim_, expert_dim_, fc_.data() + first * d,
                     act_.data() + first * d, out_.data() + first * c);
      first += static_cast<size_t>(n);
    }
  }
  for (size_t p = 0; p < ranks; ++p) {
    const float* from = out_.data() + first_row_[p] * c;
    received_[p].assign(reinterpret_cast<const std::byte*>(from),
                        reinterpret_cast<const std::byte*>(from + rows_from(p) * c));
  }
  size_rows(
      results_, ranks, [&](size_t p) { return plan_.slots[p].size(); }, row);
  start = moe::Clock::now();
  const Status combined = moe::exchange_buffers(comm_, received_, results_);
  timing_.combine_s += moe::seconds_between(start, moe::Clock::now());
  return combined;
}

void MoeMlp::backward_exchange(std::span<const ExpertTensors> experts, std::span<const ExpertTensors> d_experts) {
  const auto c = static_cast<size_t>(dim_);
  const auto d = static_cast<size_t>(expert_dim_);
  const auto ranks = static_cast<size_t>(placement_.ranks);
  const size_t row = c * sizeof(float);
  const size_t received = in_.size() / c;
  d_out_.resize(received * c);
  d_in_.resize(received * c);
  d_act_.resize(received * d);
  if (status_) {
    size_rows(
        received_, ranks, [&](size_t p) { return rows_from(p); }, row);
    const auto start = moe::Clock::now();
    status_ = moe::exchange_buffers(comm_, send_, received_);
    timing_.dispatch_s += moe::seconds_between(start, moe::Clock::now());
  }
  if (status_) {
    for (size_t p = 0; p < ranks; ++p) {
      std::memcpy(d_out_.data() + first_row_[p] * c, received_[p].data(), received_[p].size());
    }
  } else {
    std::fill(d_out_.begin(), d_out_.end(), 0.0f);
  }
  size_t first = 0;
  for (size_t p = 0; p < ranks; ++p) {
    for (size_t i = 0; i < incoming_[p].size(); ++i) {
      const auto n = static_cast<int>(incoming_[p][i]);
      expert_backward(d_out_.data() + first * c, n, in_.data() + first * c, fc_.data() + first * d,
                      act_.data() + first * d, experts[i], d_experts[i], dim_, expert_dim_, d_act_.data() + first * d,
                      d_in_.data() + first * c);
      first += static_cast<size_t>(n);
    }
  }
  for (size_t p = 0; p < ranks; ++p) {
    const auto* from = d_in_.data() + first_row_[p] * c;
    received_[p].assign(reinterpret_cast<const std::byte*>(from),
                        reinterpret_cast<const std::byte*>(from + rows_from(p) * c));
  }
  if (status_) {
    size_rows(
        results_, ranks, [&](size_t p) { return plan_.slots[p].size(); }, row);
    const auto start = moe::Clock::now();
    status_ = moe::exchange_buffers(comm_, received_, results_);
    timing_.combine_s += moe::seconds_between(start, moe::Clock::now());
  }
}

void MoeMlp::backward(const float* dy, const float* x, const float* router, float* d_router,
                      std::span<const ExpertTensors> experts, std::span<const ExpertTensors> d_experts, float* dx,
                      float aux_weight, float z_weight) {
  const auto r = static_cast<size_t>(rows_);
  const auto e_count = static_cast<size_t>(experts_);
  const auto c = static_cast<size_t>(dim_);
  const auto k = static_cast<size_t>(top_k_);
  const auto ranks = static_cast<size_t>(placement_.ranks);
  const size_t row = c * sizeof(float);
  // y_t = residual_t + sum_j gate_tj out_a: d out_a = gate_a dy_t, d gate_a = dy_t . out_a.
  // The d out rows go to the experts' ranks in the order the results came
  // back (the combine's transpose), the d in rows return in the order the
  // rows went (the dispatch's).
  d_gate_.assign(r * k, 0.0f);
  send_.resize(ranks);
  results_.resize(ranks);
  for (size_t p = 0; p < ranks; ++p) {
    const auto& slots = plan_.slots[p];
    send_[p].resize(slots.size() * row);
    auto* dout = reinterpret_cast<float*>(send_[p].data());
    const auto* out = reinterpret_cast<const float*>(results_[p].data());
    const bool have = results_[p].size() == send_[p].size();
    for (size_t i = 0; i < slots.size(); ++i) {
      const auto a = static_cast<size_t>(slots[i]);
      const float* dyt = dy + (a / k) * c;
      const float g = routing_.gate[a];
      float dot = 0;
      for (size_t j = 0; j < c; ++j) {
        dout[i * c + j] = g * dyt[j];
        if (have) dot += dyt[j] * out[i * c + j];
      }
      d_gate_[a] = dot;
    }
  }
  if (exchange_ != nullptr) {
    // Async: the owners keep what they served; late rows' gradients stay empty.
    std::vector<uint8_t> had(ranks, 0);
    for (size_t p = 0; p < ranks; ++p) had[p] = results_[p].size() == send_[p].size() ? 1 : 0;
    exchange_->backward(layer_, plan_, send_, had, results_, timing_);
  } else {
    backward_exchange(experts, d_experts);
  }
  for (size_t p = 0; p < ranks && status_; ++p) {
    const auto& slots = plan_.slots[p];
    if (results_[p].size() != slots.size() * row) continue;  // late: no gradient to the token through them
    const auto* source = reinterpret_cast<const float*>(results_[p].data());
    for (size_t i = 0; i < slots.size(); ++i) {
      float* target = dx + static_cast<size_t>(slots[i] / top_k_) * c;
      for (size_t j = 0; j < c; ++j) target[j] += source[i * c + j];
    }
  }

  // Back to the router's logits: through the renormalised gates, the
  // load-balancing loss (d/dP_i = E f_i, P_i a mean over tokens) and the
  // softmax; the z-loss acts on the logits directly.
  d_logits_.assign(r * e_count, 0.0f);
  const double assignments = static_cast<double>(r * k);
  std::vector<float> aux_grad(e_count);
  for (size_t e = 0; e < e_count; ++e) {
    aux_grad[e] = static_cast<float>(aux_weight * static_cast<double>(experts_) *
                                     (static_cast<double>(routing_.load[e]) / assignments) / static_cast<double>(r));
  }
  const float z_scale = 2.0f * z_weight / static_cast<float>(r);
  std::vector<float> d_prob(e_count);
  for (size_t t = 0; t < r; ++t) {
    const float* prob = probs_.data() + t * e_count;
    std::copy(aux_grad.begin(), aux_grad.end(), d_prob.begin());
    // gate_j = p_j / S over the chosen: d p_m = (d gate_m - sum_j d gate_j gate_j) / S.
    float chosen = 0;
    float weighted = 0;
    for (size_t j = 0; j < k; ++j) {
      chosen += prob[routing_.expert[t * k + j]];
      weighted += d_gate_[t * k + j] * routing_.gate[t * k + j];
    }
    for (size_t j = 0; j < k; ++j) {
      d_prob[static_cast<size_t>(routing_.expert[t * k + j])] += (d_gate_[t * k + j] - weighted) / chosen;
    }
    float dot = 0;
    for (size_t e = 0; e < e_count; ++e) dot += prob[e] * d_prob[e];
    float* dl = d_logits_.data() + t * e_count;
    for (size_t e = 0; e < e_count; ++e) dl[e] = prob[e] * (d_prob[e] - dot) + z_scale * lse_[t] * prob[e];
  }
  if (rows_ > 0) {
    // d router += x^T d logits; dx += d logits router^T.
    tensor::ops::gemm(Trans::kYes, Trans::kNo, dim_, experts_, rows_, 1.0f, x, dim_, d_logits_.data(), experts_, 1.0f,
                      d_router, experts_);
    tensor::ops::gemm(Trans::kNo, Trans::kYes, rows_, dim_, experts_, 1.0f, d_logits_.data(), experts_, router,
                      experts_, 1.0f, dx, dim_);
  }
}

void MoeStats::add_timing(std::span<const MoeMlp* const> layers) {
  for (const MoeMlp* layer : layers) {
    if (!layer->exchanges()) continue;
    exchanges_ = true;
    const auto& t = layer->timing();
    dispatch_us_.push_back(t.dispatch_s * 1e6);
    combine_us_.push_back(t.combine_s * 1e6);
    wait_s_ += t.dispatch_s + t.combine_s;
    kept_ += t.kept;
    late_ += t.late;
    late_grads_ += t.late_grads;
  }
}

void MoeStats::add(std::span<const MoeMlp* const> layers, std::span<const int> index) {
  if (layers_.empty()) {
    for (size_t i = 0; i < layers.size(); ++i) layers_.push_back(Layer{index[i]});
  }
  for (size_t i = 0; i < layers.size() && i < layers_.size(); ++i) {
    const moe::Routing& routing = layers[i]->routing();
    Layer& l = layers_[i];
    l.aux += layers[i]->aux_loss();
    l.z += layers[i]->z_loss();
    l.assignments += static_cast<int64_t>(routing.expert.size());
    l.dropped += routing.dropped;
    const std::vector<int64_t>& load = routing.load;
    if (load.empty()) continue;
    const double mean =
        static_cast<double>(std::accumulate(load.begin(), load.end(), int64_t{0})) / static_cast<double>(load.size());
    double var = 0;
    for (const int64_t v : load) var += (static_cast<double>(v) - mean) * (static_cast<double>(v) - mean);
    var /= static_cast<double>(load.size());
    l.load_min += static_cast<double>(*std::min_element(load.begin(), load.end()));
    l.load_max += static_cast<double>(*std::max_element(load.begin(), load.end()));
    l.load_mean += mean;
    l.load_cv += mean > 0 ? std::sqrt(var) / mean : 0;
  }
  ++passes_;
}

nlohmann::ordered_json MoeStats::to_json() const {
  if (passes_ == 0) return nullptr;
  const auto passes = static_cast<double>(passes_);
  nlohmann::ordered_json layers = nlohmann::ordered_json::array();
  double aux = 0, z = 0;
  int64_t assignments = 0, dropped = 0;
  for (const Layer& l : layers_) {
    const double share = l.assignments > 0 ? static_cast<double>(l.dropped) / static_cast<double>(l.assignments) : 0;
    layers.push_back({{"layer", l.index},
                      {"aux_loss", l.aux / passes},
                      {"z_loss", l.z / passes},
                      {"load_min", l.load_min / passes},
                      {"load_mean", l.load_mean / passes},
                      {"load_max", l.load_max / passes},
                      {"load_cv", l.load_cv / passes},
                      {"dropped_share", share}});
    aux += l.aux / passes;
    z += l.z / passes;
    assignments += l.assignments;
    dropped += l.dropped;
  }
  const auto n = static_cast<double>(std::max<size_t>(1, layers_.size()));
  nlohmann::ordered_json out = {
      {"aux_loss", aux / n},
      {"z_loss", z / n},
      {"dropped_share", assignments > 0 ? static_cast<double>(dropped) / static_cast<double>(assignments) : 0},
      {"passes", passes_},
      {"layers", layers}};
  if (exchanges_) {
    // Sync dispatch: nothing is late (every rank waits for every result).
    const auto share = [&](int64_t n) { return kept_ > 0 ? static_cast<double>(n) / static_cast<double>(kept_) : 0.0; };
    out["dispatch"] = {{"dispatch_p50_us", moe::percentile(dispatch_us_, 0.5)},
                       {"dispatch_p99_us", moe::percentile(dispatch_us_, 0.99)},
                       {"combine_p50_us", moe::percentile(combine_us_, 0.5)},
                       {"combine_p99_us", moe::percentile(combine_us_, 0.99)},
                       {"wait_s", wait_s_},
                       {"late_share", share(late_)},
                       {"late", late_},
                       {"late_grad_share", share(late_grads_)}};
  }
  return out;
}

}  // namespace cfmo::model
