#include "common/slurm.h"

#include <cctype>
#include <cstdio>

#include "common/enforce.h"
#include "common/env.h"

namespace dtrain::slurm {
namespace {

// The names one bracket expression "01-03,07" stands for.
std::vector<std::string> range_items(const std::string& body, const std::string& what,
                                     size_t max_items) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= body.size() && out.size() < max_items) {
    const size_t comma = std::min(body.find(',', start), body.size());
    const std::string item = body.substr(start, comma - start);
    const size_t dash = item.find('-');
    const std::string lo = item.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
    auto digits = [](const std::string& s) {
      if (s.empty() || s.size() > 9) return false;
      for (char c : s)
        if (!std::isdigit(static_cast<unsigned char>(c))) return false;
      return true;
    };
    DTRAIN_CHECK_ARG(digits(lo) && digits(hi), what, ": '[", body,
                     "]' is not a Slurm range (expected numbers like [1-4,7])");
    const long a = std::stol(lo), b = std::stol(hi);
    DTRAIN_CHECK_ARG(a <= b, what, ": range ", item, " runs backwards");
    for (long n = a; n <= b && out.size() < max_items; ++n) {
      std::string s = std::to_string(n);
      if (s.size() < lo.size()) s.insert(0, lo.size() - s.size(), '0');  // keep "01"
      out.push_back(s);
    }
    start = comma + 1;
  }
  return out;
}

// Expands one host expression (no top-level commas) into `out`.
void expand_one(const std::string& expr, const std::string& what, size_t max_hosts,
                std::vector<std::string>& out) {
  std::vector<std::string> partial{""};
  size_t at = 0;
  while (at < expr.size()) {
    const size_t open = expr.find('[', at);
    const std::string text = expr.substr(at, open == std::string::npos ? std::string::npos : open - at);
    DTRAIN_CHECK_ARG(text.find(']') == std::string::npos, what, ": unbalanced ']' in '", expr, "'");
    for (auto& p : partial) p += text;
    if (open == std::string::npos) break;
    const size_t close = expr.find(']', open);
    DTRAIN_CHECK_ARG(close != std::string::npos, what, ": unbalanced '[' in '", expr, "'");
    const auto items = range_items(expr.substr(open + 1, close - open - 1), what, max_hosts);
    std::vector<std::string> next;
    for (const auto& p : partial)
      for (const auto& item : items)
        if (next.size() < max_hosts) next.push_back(p + item);
    partial.swap(next);
    at = close + 1;
  }
  for (auto& p : partial) {
    DTRAIN_CHECK_ARG(!p.empty(), what, ": empty host name in '", expr, "'");
    if (out.size() < max_hosts) out.push_back(std::move(p));
  }
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list, const std::string& what,
                                         size_t max_hosts) {
  DTRAIN_CHECK_ARG(!list.empty(), what, " is empty");
  std::vector<std::string> hosts;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= list.size() && hosts.size() < max_hosts; ++i) {
    if (i < list.size() && list[i] == '[') ++depth;
    if (i < list.size() && list[i] == ']') --depth;
    DTRAIN_CHECK_ARG(depth >= 0 && depth <= 1, what, ": unbalanced brackets in '", list, "'");
    if (i == list.size() || (list[i] == ',' && depth == 0)) {
      expand_one(list.substr(start, i - start), what, max_hosts, hosts);
      start = i + 1;
    }
  }
  DTRAIN_CHECK_ARG(depth == 0, what, ": unbalanced '[' in '", list, "'");
  return hosts;
}

int rendezvous_port(long long job_id, long long step_id) {
  const long long mixed = ((job_id % 40000) * 1009 + (step_id % 40000)) % 40000;
  return 15000 + static_cast<int>(mixed < 0 ? mixed + 40000 : mixed);
}

std::optional<std::string> master_addr_from_slurm() {
  const env::Var* var = &env::kSlurmStepNodelist;
  auto list = env::get(*var);
  if (!list) var = &env::kSlurmJobNodelist, list = env::get(*var);
  if (!list) return std::nullopt;
  return expand_hostlist(*list, std::string(var->name) + "='" + *list + "'", 1).front();
}

std::optional<std::string> node_addr(const std::string& node) {
  // The name goes into a command line: only host-name characters.
  if (node.empty() || node.size() > 255) return std::nullopt;
  for (char c : node)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.' && c != '_')
      return std::nullopt;
  const std::string cmd = "timeout 5 scontrol show node -o " + node + " 2>/dev/null";
  FILE* out = popen(cmd.c_str(), "r");
  if (!out) return std::nullopt;
  std::string text;
  char buf[4096];
  size_t n;
  while (text.size() < (1 << 16) && (n = fread(buf, 1, sizeof(buf), out)) > 0) text.append(buf, n);
  pclose(out);
  const auto at = text.find("NodeAddr=");
  if (at == std::string::npos) return std::nullopt;
  const auto begin = at + 9;
  const auto end = text.find_first_of(" \n", begin);
  std::string addr = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
  if (addr.empty() || addr == "(null)") return std::nullopt;
  return addr;
}

std::optional<int> master_port_from_slurm() {
  const auto job = env::get_int(env::kSlurmJobId, 0, (1LL << 62));
  if (!job) return std::nullopt;
  const auto step = env::get_int(env::kSlurmStepId, 0, (1LL << 62));
  return rendezvous_port(*job, step.value_or(0));
}

}  // namespace dtrain::slurm
