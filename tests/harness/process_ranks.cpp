#include "harness/process_ranks.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace dtrain::testing {

std::string RankProcess::output() const {
  std::ifstream in(log_path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string describe(const RankProcess& p) {
  return "exit " + std::to_string(p.exit_code) + " signal " + std::to_string(p.signal) +
         "\n--- output ---\n" + p.output();
}

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    throw std::runtime_error("free_port: bind failed");
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

HeldPort::HeldPort() {
  fd_ = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd_, 1) != 0)
    throw std::runtime_error("HeldPort: cannot listen on 127.0.0.1");
  socklen_t len = sizeof(addr);
  getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.sin_port);
}

HeldPort::~HeldPort() { close(fd_); }

std::map<std::string, std::string> rank_env(int rank, int world, int port,
                                            const std::string& timeout_s) {
  return {{"RANK", std::to_string(rank)},     {"WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "127.0.0.1"},       {"MASTER_PORT", std::to_string(port)},
          {"DTRAIN_TIMEOUT", timeout_s},      {"OMP_NUM_THREADS", "1"}};
}

RankProcess& ProcessRanks::spawn(const std::vector<std::string>& argv,
                                 const std::map<std::string, std::string>& env) {
  std::map<std::string, std::string> merged;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) merged[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : env) merged[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : merged) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, args;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);

  char tmpl[] = "/tmp/dtrain-rank-XXXXXX";
  int log_fd = mkstemp(tmpl);
  if (log_fd < 0) throw std::runtime_error("mkstemp failed");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, log_fd, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, log_fd, STDERR_FILENO);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  close(log_fd);
  if (rc != 0) throw std::runtime_error("posix_spawn " + argv[0] + ": " + std::strerror(rc));
  RankProcess p;
  p.pid = pid;
  p.log_path = tmpl;
  procs_.push_back(p);
  return procs_.back();
}

bool ProcessRanks::wait(RankProcess& p, std::chrono::steady_clock::time_point deadline) {
  while (!p.exited) {
    int status = 0;
    pid_t r = waitpid(p.pid, &status, WNOHANG);
    if (r == p.pid) {
      p.exited = true;
      p.end = std::chrono::steady_clock::now();
      if (WIFEXITED(status)) p.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) p.signal = WTERMSIG(status);
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // waitpid has no timeout
  }
  return true;
}

bool ProcessRanks::wait_all(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  bool ok = true;
  for (auto& p : procs_) ok = wait(p, deadline) && ok;
  return ok;
}

bool ProcessRanks::wait_for_output(RankProcess& p, const std::string& text,
                                   std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (p.output().find(text) != std::string::npos) return true;
    if (wait(p, std::chrono::steady_clock::now())) return false;  // exited without it
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

ProcessRanks::~ProcessRanks() {
  for (auto& p : procs_) {
    if (!p.exited) {
      kill(p.pid, SIGCONT);
      kill(p.pid, SIGKILL);
      waitpid(p.pid, nullptr, 0);
    }
    unlink(p.log_path.c_str());
  }
}

}  // namespace dtrain::testing
