#include "report.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

namespace {

std::string duration(double seconds) {
  char buf[32];
  const int s = static_cast<int>(seconds + 0.5);
  std::snprintf(buf, sizeof(buf), "%d:%02d", s / 60, s % 60);
  return buf;
}

}  // namespace

Progress::Progress(bool live, int64_t epochs, int64_t steps_per_epoch, int64_t samples_per_step,
                   std::string unit)
    : live_(live), epochs_(epochs), steps_(steps_per_epoch), samples_per_step_(samples_per_step),
      unit_(std::move(unit)) {}

void Progress::start_epoch(int64_t epoch, int64_t first_step) {
  epoch_ = epoch;
  first_step_ = first_step;
  last_logged_ = -1;
  start_ = last_draw_ = Clock::now();
}

void Progress::update(int64_t step, double loss) {
  const auto now = Clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double rate = elapsed > 0 ? (step - first_step_) * samples_per_step_ / elapsed : 0;
  const double eta = step > first_step_ ? elapsed / (step - first_step_) * (steps_ - step) : 0;
  char line[256];
  if (live_) {
    if (step < steps_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    const int width = 30, filled = static_cast<int>(width * step / std::max<int64_t>(steps_, 1));
    std::string bar(filled, '#');
    bar += std::string(width - filled, '.');
    std::snprintf(line, sizeof(line), "epoch %lld/%lld [%s] %3d%% step %lld/%lld loss %.4f %6.0f %s/s ETA %s",
                  static_cast<long long>(epoch_ + 1), static_cast<long long>(epochs_), bar.c_str(),
                  static_cast<int>(100 * step / std::max<int64_t>(steps_, 1)),
                  static_cast<long long>(step), static_cast<long long>(steps_), loss, rate,
                  unit_.c_str(), duration(eta).c_str());
    std::cout << "\r" << line << "\033[K" << std::flush;
    return;
  }
  // Not a terminal: a plain line at every tenth of the epoch.
  const int64_t tenth = std::max<int64_t>(steps_ / 10, 1);
  if (step / tenth == last_logged_ && step != steps_) return;
  last_logged_ = step / tenth;
  std::snprintf(line, sizeof(line), "epoch %lld/%lld step %lld/%lld loss %.4f %.0f %s/s ETA %s",
                static_cast<long long>(epoch_ + 1), static_cast<long long>(epochs_),
                static_cast<long long>(step), static_cast<long long>(steps_), loss, rate,
                unit_.c_str(), duration(eta).c_str());
  std::cout << line << std::endl;
}

void Progress::finish_epoch() {
  if (live_) std::cout << "\r\033[K" << std::flush;
}

Metrics::Metrics(std::string dir) : dir_(std::move(dir)) {}

void Metrics::add(const EpochMetrics& m) {
  rows_.push_back(m);
  std::ofstream out(dir_ + "/metrics.jsonl", std::ios::app);
  out << "{\"epoch\": " << m.epoch << ", \"train_loss\": " << m.train_loss
      << ", \"test_accuracy\": " << m.test_accuracy << ", \"samples_per_s\": " << m.samples_per_s
      << ", \"seconds\": " << m.seconds << "}\n";
}

// The script names only files in `dir`: no character of --out-dir reaches
// a shell or gnuplot's command line (which expands `backquotes` even inside
// strings).
bool run_gnuplot(const std::string& script, const std::string& dir) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return false;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[0], 0);
  posix_spawn_file_actions_addchdir_np(&actions, dir.c_str());
  posix_spawn_file_actions_addopen(&actions, 1, "gnuplot.log", O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  char* argv[] = {const_cast<char*>("gnuplot"), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawnp(&pid, "gnuplot", &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[0]);
  // A gnuplot that exits early must not take this process down with SIGPIPE:
  // block it while writing, then drop a pending one.
  sigset_t pipe_only, old_mask;
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_only, &old_mask);
  bool written = rc == 0;
  for (size_t done = 0; written && done < script.size();) {
    const ssize_t n = write(pipe_fds[1], script.data() + done, script.size() - done);
    if (n < 0 && errno == EINTR) continue;
    written = n > 0;
    if (written) done += static_cast<size_t>(n);
  }
  close(pipe_fds[1]);
  const timespec zero{0, 0};
  while (sigtimedwait(&pipe_only, nullptr, &zero) == SIGPIPE) {
  }
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  if (rc != 0) return false;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return written && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

std::string Metrics::plot() const {
  if (rows_.empty()) return "";
  const std::string data = dir_ + "/metrics.dat", png = dir_ + "/training.png";
  {
    std::ofstream out(data);
    for (const auto& r : rows_) out << r.epoch << " " << r.train_loss << " " << 100 * r.test_accuracy << "\n";
  }
  std::ostringstream script;
  script << "set terminal pngcairo size 800,450\n"
         << "set output 'training.png'\n"
         << "set title 'Fashion-MNIST training'\nset xlabel 'epoch'\nset xtics 1\n"
         << "set ylabel 'train loss'\nset y2label 'test accuracy (%)'\nset y2tics\nset grid\n"
         << "set key center right\n"
         << "plot 'metrics.dat' using 1:2 with linespoints title 'train loss' axes x1y1, "
         << "'' using 1:3 with linespoints title 'test accuracy' axes x1y2\n";
  if (!run_gnuplot(script.str(), dir_)) {
    std::cerr << "gnuplot failed (is Debian's gnuplot-nox installed?); no plot written; see "
              << dir_ << "/gnuplot.log" << std::endl;
    return "";
  }
  std::remove(data.c_str());
  return png;
}
