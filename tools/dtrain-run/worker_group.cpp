#include "worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "error_file.h"
#include "signals.h"

namespace dtrain::run {

namespace {

constexpr size_t kTailLines = 20;

int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// waitid()'s report as the status word waitpid() would have given.
int wait_status(const siginfo_t& info) {
  if (info.si_code == CLD_EXITED) return (info.si_status & 0xff) << 8;
  return (info.si_status & 0x7f) | (info.si_code == CLD_DUMPED ? 0x80 : 0);
}

using Clock = std::chrono::steady_clock;
// An execve that has not returned by then (the program on a file system
// that stopped answering) fails the start.
constexpr auto kExecTimeout = std::chrono::seconds(60);
constexpr auto kReapTimeout = std::chrono::seconds(5);

// Reaps `pid` within `timeout`; false if it has not ended (a process in
// uninterruptible sleep: stop()'s final sweep reaps it later).
bool reap_within(pid_t pid, Clock::duration timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const pid_t r = waitpid(pid, nullptr, WNOHANG);
    if (r == pid || (r < 0 && errno != EINTR)) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// The workers' oom_score_adj: the launcher's plus 500 (at most 1000), so
// that under memory pressure the kernel ends a worker, which dtrain-run
// restarts, before dtrain-run, which holds the host's snapshot keeper.
// Raising it needs no privilege. "" where /proc does not say.
std::string worker_oom_score_adj() {
  std::ifstream in("/proc/self/oom_score_adj");
  int mine = 0;
  if (!(in >> mine)) return "";
  return std::to_string(std::min(1000, mine + 500));
}

// Waits for a child's execve: its exec_err pipe (close-on-exec) closes when
// the program starts, or carries the errno of a failed execve. Returns that
// errno, 0 once the program runs. A signal to the launcher (Interrupted) or
// kExecTimeout kills the child and ends the wait.
int wait_exec(int fd, pid_t pid, const std::string& program) {
  const auto deadline = Clock::now() + kExecTimeout;
  int child_errno = 0;
  size_t got = 0;
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, 100);
    if (ready > 0) {
      const ssize_t n = read(fd, reinterpret_cast<char*>(&child_errno) + got, sizeof(child_errno) - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return got == sizeof(child_errno) ? child_errno : 0;  // closed: it runs
      got += static_cast<size_t>(n);
      if (got == sizeof(child_errno)) return child_errno;
      continue;
    }
    if (ready < 0 && errno != EINTR)
      throw std::runtime_error(std::string("poll on the exec pipe: ") + std::strerror(errno));
    const int sig = pending_signal();
    if (sig == 0 && Clock::now() < deadline) continue;
    kill(pid, SIGKILL);
    reap_within(pid, kReapTimeout);
    if (sig != 0) throw Interrupted(sig);
    throw std::runtime_error("cannot execute '" + program + "': execve did not return within " +
                             std::to_string(kExecTimeout.count()) +
                             " s (does the file system that holds it answer?)");
  }
}

// --redirects / --tee: LOG_DIR/RDZV_ID/attempt_N/LOCAL_RANK/std{out,err}.log.
void open_logs(const Options& options, int attempt, int local_rank, std::ofstream& out,
               std::ofstream& err) {
  const int to_file = static_cast<int>(options.redirect_of(local_rank)) |
                      static_cast<int>(options.tee_of(local_rank));
  if (to_file == 0) return;
  const std::string dir = options.log_dir + "/" + options.rdzv_id + "/attempt_" +
                          std::to_string(attempt) + "/" + std::to_string(local_rank);
  make_dirs(dir);
  if (to_file & 1) out.open(dir + "/stdout.log");
  if (to_file & 2) err.open(dir + "/stderr.log");
}

// The program and its arguments, ${local_rank} replaced.
std::vector<std::string> worker_argv(const Options& options, int local_rank) {
  std::vector<std::string> argv{options.program};
  for (const auto& a : options.args) argv.push_back(a);
  for (auto& a : argv)
    for (size_t p; (p = a.find("${local_rank}")) != std::string::npos;)
      a.replace(p, 13, std::to_string(local_rank));
  return argv;
}

}  // namespace

std::string WorkerExit::describe() const {
  if (signal != 0) {
    const char* abbrev = sigabbrev_np(signal);
    return std::string("killed by SIG") + (abbrev ? abbrev : std::to_string(signal).c_str());
  }
  return "exited with code " + std::to_string(code);
}

struct WorkerGroup::Worker {
  WorkerSpec spec;
  pid_t pid = -1;
  bool running = false;  // not yet exited
  bool reaped = false;   // exited and waited for: its pid may belong to anyone now
  int status = 0;
  std::chrono::system_clock::time_point ended;
  std::thread out_pump, err_pump;
  std::ofstream out_file, err_file;
  std::mutex tail_mutex;
  std::deque<std::string> tail;
};

WorkerGroup::WorkerGroup(const Options& options, int attempt) : options_(options), attempt_(attempt) {}

WorkerGroup::~WorkerGroup() { stop(SIGTERM, std::chrono::seconds(5)); }

void WorkerGroup::start(const std::vector<WorkerSpec>& specs) {
  for (const auto& spec : specs) {
    auto w = std::make_unique<Worker>();
    w->spec = spec;
    open_logs(options_, attempt_, spec.local_rank, w->out_file, w->err_file);

    int out[2], err[2], exec_err[2];
    if (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC) || pipe2(exec_err, O_CLOEXEC))
      throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    // Everything the child needs is prepared before fork (only
    // async-signal-safe calls are allowed after it).
    std::vector<std::string> argv_s = worker_argv(options_, spec.local_rank);
    std::vector<char*> argv, envp;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::string> env_copy = spec.env;
    for (auto& e : env_copy) envp.push_back(e.data());
    envp.push_back(nullptr);
    const pid_t parent = getpid();
    const std::string oom_adj = worker_oom_score_adj();
    // Workers run in their own process groups: one reading the terminal
    // would be stopped by SIGTTIN for good, so stdin is /dev/null unless asked.
    const int stdin_fd = options_.keep_stdin ? -1 : open("/dev/null", O_RDONLY | O_CLOEXEC);

    pid_t pid = fork();
    if (pid < 0) {
      if (stdin_fd >= 0) close(stdin_fd);
      throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    }
    if (pid == 0) {
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);  // the launcher died before prctl
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      if (!oom_adj.empty()) {
        const int adj = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (adj >= 0) {
          (void)!write(adj, oom_adj.data(), oom_adj.size());
          close(adj);
        }
      }
      if (stdin_fd >= 0) dup2(stdin_fd, STDIN_FILENO);
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
      execve(argv[0], argv.data(), envp.data());
      int e = errno;
      (void)!write(exec_err[1], &e, sizeof(e));
      _exit(127);
    }
    setpgid(pid, pid);  // also from here, so no signal can race the child's call
    if (stdin_fd >= 0) close(stdin_fd);
    close(out[1]);
    close(err[1]);
    close(exec_err[1]);
    int child_errno = 0;
    try {
      child_errno = wait_exec(exec_err[0], pid, options_.program);
    } catch (...) {
      close(exec_err[0]);
      close(out[0]);
      close(err[0]);
      throw;
    }
    close(exec_err[0]);
    if (child_errno != 0) {
      reap_within(pid, kReapTimeout);  // it _exit()s at once
      close(out[0]);
      close(err[0]);
      throw std::runtime_error("cannot execute '" + options_.program + "': " +
                               std::strerror(child_errno));
    }
    w->pid = pid;
    w->running = true;
    Worker* raw = w.get();
    w->out_pump = std::thread([this, raw, fd = out[0]] { pump(*raw, fd, false); });
    w->err_pump = std::thread([this, raw, fd = err[0]] { pump(*raw, fd, true); });
    workers_.push_back(std::move(w));
  }
}

void WorkerGroup::pump(Worker& w, int fd, bool is_stderr) {
  const int bit = is_stderr ? 2 : 1;
  const bool to_file = (static_cast<int>(options_.redirect_of(w.spec.local_rank)) |
                        static_cast<int>(options_.tee_of(w.spec.local_rank))) & bit;
  const bool redirected_only = (static_cast<int>(options_.redirect_of(w.spec.local_rank)) & bit) &&
                               !(static_cast<int>(options_.tee_of(w.spec.local_rank)) & bit);
  const bool to_console = options_.shown(w.spec.local_rank) && !redirected_only;
  const std::string prefix = "[" + std::to_string(w.spec.rank) + "]:";
  std::ofstream& file = is_stderr ? w.err_file : w.out_file;
  std::string pending;
  char buf[4096];
  auto emit = [&](const std::string& line) {
    {
      std::lock_guard<std::mutex> lock(w.tail_mutex);
      w.tail.push_back(line);
      if (w.tail.size() > kTailLines) w.tail.pop_front();
    }
    if (to_file && file.is_open()) file << line << '\n' << std::flush;
    if (to_console) {
      std::lock_guard<std::mutex> lock(console_mutex_);
      FILE* stream = is_stderr ? stderr : stdout;
      std::fprintf(stream, "%s%s\n", prefix.c_str(), line.c_str());
      std::fflush(stream);
    }
  };
  for (;;) {
    // A grandchild that left the worker's process group may hold the pipe
    // open forever: after stop()'s deadline the pump gives up on it.
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) == 0) {
      if (steady_ns() > pump_deadline_ns_.load()) break;
      continue;
    }
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    pending.append(buf, static_cast<size_t>(n));
    size_t end;
    while ((end = pending.find_first_of("\r\n")) != std::string::npos) {
      if (pending[end] == '\r' && end + 1 >= pending.size()) break;  // "\r\n" may be split
      if (pending[end] == '\r' && pending[end + 1] != '\n') {
        // A progress-bar frame: redraw it in place on the console only.
        if (to_console) {
          std::lock_guard<std::mutex> lock(console_mutex_);
          std::fprintf(stdout, "%s%s\r", prefix.c_str(), pending.substr(0, end).c_str());
          std::fflush(stdout);
        }
        pending.erase(0, end + 1);
        continue;
      }
      emit(pending.substr(0, end));
      pending.erase(0, end + (pending[end] == '\r' ? 2 : 1));
    }
  }
  if (!pending.empty()) emit(pending);
  close(fd);
}

// Records a worker's exit without reaping it (WNOWAIT); true once it has exited.
bool WorkerGroup::note_exit(Worker& w) {
  if (!w.running) return true;
  siginfo_t info{};
  if (waitid(P_PID, static_cast<id_t>(w.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
      info.si_pid != w.pid)
    return false;
  w.running = false;
  w.status = wait_status(info);
  w.ended = std::chrono::system_clock::now();
  return true;
}

namespace {

// When a failed worker failed, for picking the root cause: the time its
// error file gives, else when it exited.
int64_t failed_at_ns(const std::string& error_file, std::chrono::system_clock::time_point ended) {
  if (!error_file.empty())
    if (auto report = read_error_file(error_file); report && report->time_ns > 0) return report->time_ns;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(ended.time_since_epoch()).count();
}

}  // namespace

WorkerGroup::State WorkerGroup::poll(WorkerExit* failure) {
  bool all_done = true, failed = false;
  int64_t first_ns = INT64_MAX;
  for (auto& w : workers_) {
    if (!note_exit(*w)) {
      all_done = false;
      continue;
    }
    if (WIFEXITED(w->status) && WEXITSTATUS(w->status) == 0) continue;
    // The root cause is the failure that came first (torchrun: the earliest
    // error file); at equal times, a worker killed by a signal rather than
    // one that exited with an error because its peer died.
    const int64_t at = failed_at_ns(w->spec.error_file, w->ended);
    const bool signaled = WIFSIGNALED(w->status);
    const bool better = !failed || at < first_ns ||
                        (at == first_ns && signaled && failure && failure->signal == 0);
    failed = true;
    if (!better) continue;
    first_ns = at;
    if (failure) {
      failure->local_rank = w->spec.local_rank;
      failure->rank = w->spec.rank;
      failure->pid = w->pid;
      failure->code = WIFEXITED(w->status) ? WEXITSTATUS(w->status) : 0;
      failure->signal = signaled ? WTERMSIG(w->status) : 0;
      failure->when = w->ended;
      failure->error_file = w->spec.error_file;
    }
  }
  if (failed) return State::Failed;
  return all_done ? State::Succeeded : State::Running;
}

namespace {

// Modification time of `path` (0 when it does not exist), in ns.
int64_t modified_ns(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return 0;
  return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

std::vector<int> WorkerGroup::ranks() const {
  std::vector<int> out;
  for (const auto& w : workers_) out.push_back(w->spec.rank);
  return out;
}

std::vector<int> WorkerGroup::collect_traces(const std::string& dir,
                                             std::chrono::milliseconds wait) {
  auto dump_of = [&](const Worker& w) { return dir + "/rank-" + std::to_string(w.spec.rank) + ".json"; };
  std::vector<std::pair<const Worker*, int64_t>> asked;  // worker, its dump's time before
  for (auto& w : workers_) {
    if (note_exit(*w) || w->reaped) continue;
    asked.emplace_back(w.get(), modified_ns(dump_of(*w)));
    kill(w->pid, SIGUSR2);  // the worker only: its children are not dtrain ranks
  }
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    bool all = true;
    for (const auto& [w, before] : asked) all = all && modified_ns(dump_of(*w)) > before;
    if (all || std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::vector<int> ranks;
  for (auto& w : workers_)
    if (modified_ns(dump_of(*w)) > 0) ranks.push_back(w->spec.rank);
  return ranks;
}

namespace {

// Whole or not at all: a temporary file renamed over `path`.
bool write_whole(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.flush()) return false;
  }
  if (std::rename(tmp.c_str(), path.c_str()) == 0) return true;
  std::remove(tmp.c_str());
  return false;
}

}  // namespace

std::vector<int> WorkerGroup::copy_error_notes(const std::string& dir) {
  std::vector<int> ranks;
  for (auto& w : workers_) {
    note_exit(*w);
    if (w->running || w->spec.error_file.empty()) continue;
    if (WIFEXITED(w->status) && WEXITSTATUS(w->status) == 0) continue;
    const auto report = read_error_file(w->spec.error_file);  // bounded, checked
    if (!report || !report->problem.empty() || report->message.empty()) continue;
    const nlohmann::json note = {{"rank", w->spec.rank}, {"message", report->message},
                                 {"time_ns", report->time_ns}};
    const auto text = note.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    if (write_whole(dir + "/error-" + std::to_string(w->spec.rank) + ".json", text))
      ranks.push_back(w->spec.rank);
  }
  return ranks;
}

void WorkerGroup::stop(int sig, std::chrono::milliseconds grace) {
  using Steady = std::chrono::steady_clock;
  // An unreaped worker (running, or a zombie) still owns its pid, so its
  // process group id cannot have been handed to anyone else: signalling
  // -pid reaches only the worker and its children. Reaped ones are skipped.
  for (auto& w : workers_)
    if (!w->reaped) kill(-w->pid, sig);
  const auto deadline = Steady::now() + grace;
  for (;;) {
    bool any = false;
    for (auto& w : workers_) any = !note_exit(*w) || any;
    if (!any || Steady::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // waitid has no timeout
  }
  for (auto& w : workers_)
    if (!w->reaped) kill(-w->pid, SIGKILL);  // leftovers, and grandchildren in the group
  // SIGKILL is not instant (a process in uninterruptible sleep waits for
  // its I/O), so reaping has a deadline too.
  const auto kill_deadline = Steady::now() + std::chrono::seconds(5);
  for (auto& w : workers_) {
    while (!w->reaped) {
      int status = 0;
      const pid_t r = waitpid(w->pid, &status, WNOHANG);
      if (r == w->pid || (r < 0 && errno == ECHILD)) {
        if (w->running) w->status = status;
        if (w->running) w->ended = std::chrono::system_clock::now();
        w->running = false;
        w->reaped = true;
      } else if (Steady::now() >= kill_deadline) {
        std::fprintf(stderr, "dtrain-run: worker pid %d did not die of SIGKILL within 5 s; "
                             "leaving it\n", static_cast<int>(w->pid));
        w->reaped = true;  // never signal its group again
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  }
  // Reap whatever of the process groups was re-parented to us (we are a
  // child subreaper), so nothing outlives the group, not even as a zombie.
  const auto reap_deadline = Steady::now() + std::chrono::seconds(2);
  for (;;) {
    pid_t r = waitpid(-1, nullptr, WNOHANG);
    if (r > 0) continue;
    if (r < 0 || Steady::now() > reap_deadline) break;  // ECHILD: none left
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  pump_deadline_ns_ = steady_ns() + int64_t(2'000'000'000);
  for (auto& w : workers_) {
    if (w->out_pump.joinable()) w->out_pump.join();
    if (w->err_pump.joinable()) w->err_pump.join();
  }
}

std::vector<std::string> WorkerGroup::last_lines(int local_rank) {
  for (auto& w : workers_) {
    if (w->spec.local_rank != local_rank) continue;
    std::lock_guard<std::mutex> lock(w->tail_mutex);
    return {w->tail.begin(), w->tail.end()};
  }
  return {};
}

}  // namespace dtrain::run
