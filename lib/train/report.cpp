#include "train/report.h"

#include "core/progress.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <iterator>

namespace cfmo::train {

namespace {

/// Every field of a WorkerReport with its JSON key, once: `f(key, member)`
/// for a const or a mutable report, so to_json and from_json stay in step.
template <typename Report, typename F>
void visit_fields(Report& w, F&& f) {
  f("rank", w.rank);
  f("steps", w.steps);
  f("samples", w.samples);
  f("samples_per_s", w.samples_per_s);
  f("solo_samples_per_s", w.solo_samples_per_s);
  f("wait_s", w.wait_s);
  f("finish_wait_s", w.finish_wait_s);
  f("dispatch_wait_s", w.dispatch_wait_s);
  f("peak_rss_bytes", w.peak_rss_bytes);
  f("loop_s", w.loop_s);
  f("loop_cpu_s", w.loop_cpu_s);
  f("bytes_sent", w.bytes_sent);
  f("bytes_received", w.bytes_received);
  f("contributions_dropped", w.contributions_dropped);
  f("contributions_sent", w.contributions_sent);
  f("contributions_applied", w.contributions_applied);
  f("contributions_received", w.contributions_received);
  f("rounds", w.rounds);
  f("deferred", w.deferred);
  f("replies_held", w.replies_held);
  f("reply_rounds_cut", w.reply_rounds_cut);
  f("staleness_histogram", w.staleness_histogram);
  f("slowdown", w.slowdown);
  f("deltas_written", w.deltas_written);
  f("deltas_skipped", w.deltas_skipped);
  f("stopped_by", w.stopped_by);
  f("joined", w.joined);
  f("first_step_s", w.first_step_s);
}

nlohmann::ordered_json worker_json(const WorkerReport& w) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  visit_fields(w, [&](const char* key, const auto& value) { j[key] = value; });
  return j;
}

}  // namespace

std::string WorkerReport::to_json() const { return worker_json(*this).dump(); }

Result<WorkerReport> WorkerReport::from_json(std::string_view text) {
  WorkerReport w;
  try {
    const auto j = nlohmann::json::parse(text);
    visit_fields(w, [&](const char* key, auto& value) { j.at(key).get_to(value); });
  } catch (const nlohmann::json::exception& e) {
    return make_error(ErrorKind::kPeer, "a worker report is malformed: {}", e.what());
  }
  return w;
}

std::string TrainSummary::to_json() const {
  nlohmann::ordered_json workers_json = nlohmann::ordered_json::array();
  for (const auto& w : per_worker) workers_json.push_back(worker_json(w));
  auto null_or = [](const std::string& v) {
    return v.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(v);
  };
  nlohmann::ordered_json lost_json = nlohmann::ordered_json::array();
  for (const auto& l : lost) {
    lost_json.push_back(
        {{"rank", l.rank},
         {"step", l.step},
         {"wall_s", l.wall_s},
         {"why", l.why},
         {"served_by", l.served_by < 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(l.served_by)},
         {"experts", l.experts},
         {"experts_from", null_or(l.experts_from)}});
  }
  nlohmann::ordered_json joined_json = nlohmann::ordered_json::array();
  for (const auto& r : joined) {
    joined_json.push_back({{"rank", r.rank},
                           {"step", r.step},
                           {"wall_s", r.wall_s},
                           {"first_step_s", r.first_step_s < 0 ? nlohmann::ordered_json(nullptr)
                                                               : nlohmann::ordered_json(r.first_step_s)}});
  }
  nlohmann::ordered_json slowdowns = nlohmann::ordered_json::object();
  for (const auto& item : slowdown) {
    const auto eq = item.find('=');
    if (eq != std::string::npos) slowdowns[item.substr(0, eq)] = std::stod(item.substr(eq + 1));
  }
  nlohmann::ordered_json j = {
      {"mode", mode},
      {"workers", workers},
      {"model", model},
      {"optimizer", optimizer},
      {"data", data},
      {"blas", blas},
      {"device", device},
      {"parameters", parameters},
      {"steps", steps},
      {"samples", samples},
      {"epochs_completed", epochs_completed},
      {"wall_s", wall_s},
      {"train_s", train_s},
      {"eval_s", eval_s},
      {"samples_per_s", samples_per_s},
      {"efficiency", efficiency},
      {"efficiency_basis",
       "total samples/s over the sum of each worker's solo samples/s, measured during this run "
       "as its samples over its own compute time (simulated slowness included, waits excluded)"},
      {"test_accuracy", test_accuracy},
      {"test_loss", test_loss},
      {"final_train_loss", final_train_loss},
      {"train_loss", train_loss},
      {"val_loss", context > 0 ? nlohmann::ordered_json(val_loss) : nlohmann::ordered_json(nullptr)},
      {"tokens", tokens},
      {"tokens_per_s", tokens_per_s},
      {"gflops_per_s", gflops_per_s},
      {"flops_per_example", flops_per_example},
      {"flops_formula", flops_formula},
      {"bytes_sent", bytes_sent},
      {"stopped_by", stopped_by},
      {"lost_ranks", lost_ranks},
      {"lost", lost_json},
      {"joined", joined_json},
      {"settings",
       {{"sync_interval", mode_settings.sync_interval},
        {"staleness_discount", mode_settings.staleness_discount},
        {"max_staleness", mode_settings.max_staleness},
        {"owners", mode_settings.owners},
        {"outer_optimizer", std::string(to_string(mode_settings.outer_optimizer))},
        {"outer_lr", mode_settings.outer_lr},
        {"outer_momentum", mode_settings.outer_momentum},
        {"outer_warmup", mode_settings.outer_warmup},
        {"delta_dtype", std::string(to_string(mode_settings.delta_dtype))}}},
      {"simulation",
       {{"simulated", !slowdown.empty() || !straggler.empty()},
        {"slowdown", slowdowns},
        {"straggler", null_or(straggler)}}},
      {"run_dir", null_or(run_dir)},
      {"resumed_from", null_or(resumed_from)},
      {"per_worker", workers_json}};
  if (!muon_tensors.empty()) j["optimizer_split"] = {{"muon", muon_tensors}, {"adamw", adamw_tensors}};
  if (!model_metrics.is_null()) j["moe"] = model_metrics;
  return j.dump();
}

std::string summary_text(const TrainSummary& s) {
  std::string text;
  auto out = std::back_inserter(text);
  // The rate is this invocation's samples over its training time (the longest worker's
  // loop), so the line shows both and the wall time beside them; a resumed run's totals
  // include the steps before the resume.
  int64_t run_samples = 0;
  for (const auto& w : s.per_worker) run_samples += w.samples;
  fmt::format_to(out,
                 "{} on {} worker(s): {} steps, {} samples{} in {:.2f}s of training ({} samples/s), {:.2f}s in all, "
                 "stopped by {}\n",
                 s.mode, s.workers, s.steps, s.samples,
                 run_samples != s.samples ? fmt::format(" ({} in this run)", run_samples) : "", s.train_s,
                 human_count(s.samples_per_s), s.wall_s, s.stopped_by);
  if (s.workers > 1) {
    fmt::format_to(out, "efficiency {:.2f} (total samples/s over the sum of the workers' solo samples/s)\n",
                   s.efficiency);
    for (const auto& w : s.per_worker) {
      fmt::format_to(
          out, "  rank {}: {} steps, {} samples/s (solo {}), waited {:.2f}s{}, sent {} bytes, dropped {}{}{}\n", w.rank,
          w.steps, human_count(w.samples_per_s), human_count(w.solo_samples_per_s), w.wait_s,
          w.dispatch_wait_s > 0 ? fmt::format(" (+{:.2f}s in expert dispatch)", w.dispatch_wait_s) : "", w.bytes_sent,
          w.contributions_dropped, w.slowdown > 1 ? fmt::format(", simulated {}x slower", w.slowdown) : "",
          w.peak_rss_bytes > 0 ? fmt::format(", peak RSS {} MiB", w.peak_rss_bytes >> 20) : "");
    }
    for (int r : s.lost_ranks) {
      const auto l = std::find_if(s.lost.begin(), s.lost.end(), [r](const LostRank& x) { return x.rank == r; });
      if (l == s.lost.end()) {
        fmt::format_to(out, "  rank {}: lost during the run\n", r);
      } else {
        fmt::format_to(
            out, "  rank {}: lost at step {}, {:.1f}s into the run ({}){}{}\n", r, l->step, l->wall_s, l->why,
            l->served_by >= 0 ? fmt::format(", its shard served by rank {}", l->served_by) : "",
            l->experts.empty()
                ? ""
                : fmt::format(", its experts {} lost (their tokens take the residual){}", fmt::join(l->experts, ","),
                              l->experts_from.empty() ? "" : "; model.safetensors has them from " + l->experts_from));
      }
    }
    for (const auto& j : s.joined) {
      fmt::format_to(
          out, "  rank {}: joined at step {}, {:.1f}s into the run{}\n", j.rank, j.step, j.wall_s,
          j.first_step_s >= 0 ? fmt::format(", its first step {:.2f}s after its start", j.first_step_s) : "");
    }
  }
  if (!s.slowdown.empty() || !s.straggler.empty()) {
    fmt::format_to(out, "heterogeneity was simulated (sleeps after steps):{}{}\n",
                   s.slowdown.empty() ? "" : fmt::format(" slowdown {}", fmt::join(s.slowdown, ",")),
                   s.straggler.empty() ? "" : fmt::format(" straggler {}", s.straggler));
  }
  fmt::format_to(out, "model {} ({} parameters), optimizer {}, data {}\n", s.model, s.parameters, s.optimizer, s.data);
  if (s.context > 0) {
    fmt::format_to(out, "val loss {:.4f}, train loss {:.4f}, {} tokens ({} tokens/s, {:.1f} GFLOP/s)\n", s.val_loss,
                   s.train_loss, s.tokens, human_count(s.tokens_per_s), s.gflops_per_s);
    fmt::format_to(out, "FLOPs per window: {} = {:.4g}\n", s.flops_formula, s.flops_per_example);
  } else {
    fmt::format_to(out, "test accuracy {:.4f}, test loss {:.4f}\n", s.test_accuracy, s.test_loss);
  }
  if (const auto& m = s.model_metrics; m.is_object()) {
    fmt::format_to(out, "experts (rank 0): aux loss {:.4f}, z loss {:.4f}, dropped {:.2f}% of assignments\n",
                   m["aux_loss"].get<double>(), m["z_loss"].get<double>(), 100 * m["dropped_share"].get<double>());
    for (const auto& l : m["layers"]) {
      fmt::format_to(out,
                     "  block {}: tokens per expert min {:.1f} mean {:.1f} max {:.1f} (cv {:.3f}), dropped {:.2f}%\n",
                     l["layer"].get<int>(), l["load_min"].get<double>(), l["load_mean"].get<double>(),
                     l["load_max"].get<double>(), l["load_cv"].get<double>(), 100 * l["dropped_share"].get<double>());
    }
    if (m.contains("dispatch")) {
      const auto& d = m["dispatch"];
      fmt::format_to(out,
                     "  expert dispatch (rank 0, per block and pass): dispatch p50 {:.0f} us p99 {:.0f} us, combine "
                     "p50 {:.0f} us p99 {:.0f} us, late {:.2f}%, waited {:.2f}s\n",
                     d["dispatch_p50_us"].get<double>(), d["dispatch_p99_us"].get<double>(),
                     d["combine_p50_us"].get<double>(), d["combine_p99_us"].get<double>(),
                     100 * d["late_share"].get<double>(), d["wait_s"].get<double>());
    }
  }
  if (!s.muon_tensors.empty()) {
    fmt::format_to(out, "muon updates {}; adamw updates {}\n", fmt::join(s.muon_tensors, ", "),
                   fmt::join(s.adamw_tensors, ", "));
  }
  if (!s.run_dir.empty()) fmt::format_to(out, "run directory: {}\n", s.run_dir);
  return text;
}

}  // namespace cfmo::train
