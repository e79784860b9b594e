#pragma once

// What rank 0 shows and keeps: a live progress bar on a terminal (plain
// lines otherwise), a JSON-lines metrics file, and a PNG plot at the end.

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

class Progress {
 public:
  // `unit`: what samples_per_step counts ("samples/s" in the line).
  Progress(bool live, int64_t epochs, int64_t steps_per_epoch, int64_t samples_per_step,
           std::string unit = "samples");
  void start_epoch(int64_t epoch, int64_t first_step);
  void update(int64_t step, double loss);  // step: batches done in this epoch
  void finish_epoch();

 private:
  using Clock = std::chrono::steady_clock;
  bool live_;
  int64_t epochs_, steps_, samples_per_step_;
  std::string unit_;
  int64_t epoch_ = 0, first_step_ = 0, last_logged_ = -1;
  Clock::time_point start_, last_draw_;
};

struct EpochMetrics {
  int64_t epoch;
  double train_loss, test_accuracy, samples_per_s, seconds;
};

// Runs gnuplot on `script` in directory `dir`, without a shell (output and
// errors to dir/gnuplot.log). True on success.
bool run_gnuplot(const std::string& script, const std::string& dir);

class Metrics {
 public:
  explicit Metrics(std::string dir);  // appends to DIR/metrics.jsonl
  void add(const EpochMetrics& m);
  // DIR/training.png (loss and accuracy per epoch) with gnuplot; returns the
  // path, or an empty string (and says why) when it cannot.
  std::string plot() const;

 private:
  std::string dir_;
  std::vector<EpochMetrics> rows_;
};
