#include "ft/protocol.h"

#include <sstream>

#include "common/decimal.h"
#include "common/enforce.h"

namespace dtrain::ft::protocol {
namespace {

// The lines of `text`, each "<word> <rest>"; InvalidArgument on a text
// that is too long or holds a byte outside printable ASCII.
std::vector<std::pair<std::string, std::string>> lines_of(const std::string& text,
                                                          const char* what) {
  DTRAIN_CHECK_ARG(text.size() <= kMaxText, what, ": ", text.size(), " bytes (at most ", kMaxText, ")");
  std::vector<std::pair<std::string, std::string>> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(at, end - at);
    at = end + 1;
    for (unsigned char c : line)
      DTRAIN_CHECK_ARG(c >= 0x20 && c < 0x7f, what, ": byte ", static_cast<int>(c), " is not printable");
    const size_t space = line.find(' ');
    out.emplace_back(line.substr(0, space), space == std::string::npos ? "" : line.substr(space + 1));
  }
  return out;
}

int64_t number(const std::string& s, int64_t lo, int64_t hi, const char* what, const char* field) {
  const auto v = dtrain::detail::parse_decimal(s);
  DTRAIN_CHECK_ARG(v || (!s.empty() && s.find_first_not_of("0123456789") == std::string::npos), what, ": ", field,
                   " '", s, "' is not a number");
  DTRAIN_CHECK_ARG(v && *v >= lo && *v <= hi, what, ": ", field, " ", s, " is outside [", lo, ", ", hi, "]");
  return *v;
}

bool hex_word(const std::string& s, size_t max) {
  return s.size() <= max && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

// A quorum id as the lighthouse makes them: one word of at most 64
// (lines_of has checked that every byte is printable).
void check_quorum_id(const std::string& id, bool may_be_empty, const char* what, const char* field) {
  DTRAIN_CHECK_ARG((may_be_empty || !id.empty()) && id.size() <= 64 && id.find(' ') == std::string::npos, what,
                   ": ", field, " '", id, "' is not one word of at most 64");
}

}  // namespace

std::string request_key(int64_t n) { return "ft/request/" + std::to_string(n); }
std::string registration_key(int64_t n) { return "ft/registration/" + std::to_string(n); }
std::string answer_key(int64_t n) { return "ft/answer/" + std::to_string(n); }
std::string heartbeat_key(const std::string& replica) { return "ft/heartbeat/" + replica; }
std::string present_key(const std::string& replica) { return "ft/present/" + replica; }
std::string dead_key(const std::string& quorum_id) { return "ft/dead/" + quorum_id; }

void check_replica_id(const std::string& id, const std::string& what) {
  DTRAIN_CHECK_ARG(!id.empty() && id.size() <= 64 &&
                       id.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") ==
                           std::string::npos,
                   what, ": replica id '", id, "' is not 1 to 64 of A-Z a-z 0-9 . _ -");
}

std::string encode(const Request& r) {
  return detail::cat("replica ", r.replica, "\nstep ", r.step, "\nworld ", r.world, "\nlayout ", r.layout,
                     "\nrebuild ", r.rebuild ? 1 : 0,
                     "\nincarnation ", r.incarnation, "\nlineage ", r.lineage);
}

Request parse_request(const std::string& text) {
  const char* what = "lighthouse request";
  Request r;
  int seen = 0;
  for (const auto& [word, rest] : lines_of(text, what)) {
    if (word == "replica") {
      check_replica_id(rest, what);
      r.replica = rest;
      seen |= 1;
    } else if (word == "step") {
      r.step = number(rest, 0, INT64_MAX / 2, what, "step");
      seen |= 2;
    } else if (word == "world") {
      r.world = static_cast<int>(number(rest, 1, 1 << 24, what, "world"));
      seen |= 4;
    } else if (word == "layout") {
      DTRAIN_CHECK_ARG(hex_word(rest, 64), what, ": layout '", rest, "' is not at most 64 hex digits");
      r.layout = rest;
      seen |= 8;
    } else if (word == "rebuild") {
      r.rebuild = number(rest, 0, 1, what, "rebuild") == 1;
    } else if (word == "incarnation") {
      DTRAIN_CHECK_ARG(!rest.empty() && hex_word(rest, 32), what, ": incarnation '", rest,
                       "' is not 1 to 32 hex digits");
      r.incarnation = rest;
      seen |= 16;
    } else if (word == "lineage") {
      check_quorum_id(rest, true, what, "lineage");
      r.lineage = rest;
    } else {
      throw InvalidArgument(detail::cat(what, ": unknown field '", word, "'"));
    }
  }
  DTRAIN_CHECK_ARG(seen == 31, what, ": replica, step, world, layout and incarnation are each required");
  return r;
}

std::string encode(const Answer& a) {
  if (!a.error.empty()) {
    std::string one_line = a.error;
    for (char& c : one_line)
      if (c < 0x20 || c >= 0x7f) c = ' ';
    return "error " + one_line;
  }
  std::ostringstream out;
  out << "quorum " << a.quorum_id;
  for (const auto& m : a.members)
    out << "\nmember " << m.replica << " " << m.step << (m.lineage.empty() ? "" : " ") << m.lineage;
  return out.str();
}

Answer parse_answer(const std::string& text) {
  const char* what = "lighthouse answer";
  Answer a;
  bool quorum = false;
  for (const auto& [word, rest] : lines_of(text, what)) {
    if (word == "error") {
      DTRAIN_CHECK_ARG(!quorum && a.error.empty(), what, ": an error and a quorum at once");
      a.error = rest.empty() ? "(no reason given)" : rest;
    } else if (word == "quorum") {
      DTRAIN_CHECK_ARG(!quorum && a.error.empty(), what, ": a second quorum line, or a quorum and an error");
      check_quorum_id(rest, false, what, "quorum id");
      a.quorum_id = rest;
      quorum = true;
    } else if (word == "member") {
      DTRAIN_CHECK_ARG(quorum, what, ": a member before the quorum line");
      DTRAIN_CHECK_ARG(a.members.size() < kMaxMembers, what, ": more than ", kMaxMembers, " members");
      // "<replica> <step>[ <lineage>]"
      const size_t space = rest.find(' ');
      DTRAIN_CHECK_ARG(space != std::string::npos, what, ": member '", rest, "' has no step");
      const size_t second = rest.find(' ', space + 1);
      Member m{rest.substr(0, space), number(rest.substr(space + 1, second - space - 1), 0, INT64_MAX / 2, what, "step"),
               second == std::string::npos ? "" : rest.substr(second + 1)};
      check_replica_id(m.replica, what);
      check_quorum_id(m.lineage, true, what, "lineage");
      DTRAIN_CHECK_ARG(a.members.empty() || a.members.back().replica < m.replica, what, ": member '", m.replica,
                       "' is out of order or repeated");
      a.members.push_back(std::move(m));
    } else {
      throw InvalidArgument(detail::cat(what, ": unknown field '", word, "'"));
    }
  }
  DTRAIN_CHECK_ARG(!a.error.empty() || (quorum && !a.members.empty()), what,
                   ": neither an error nor a quorum with members");
  return a;
}

std::string encode(const std::vector<Death>& deaths) {
  std::string out;
  for (const auto& d : deaths)
    out += d.closed ? detail::cat(out.empty() ? "" : "\n", "gone ", d.replica)
                    : detail::cat(out.empty() ? "" : "\n", "dead ", d.replica, " ", d.silent_ms);
  return out;
}

std::vector<Death> parse_deaths(const std::string& text) {
  const char* what = "lighthouse verdict";
  std::vector<Death> out;
  for (const auto& [word, rest] : lines_of(text, what)) {
    DTRAIN_CHECK_ARG(word == "dead" || word == "gone", what, ": unknown field '", word, "'");
    DTRAIN_CHECK_ARG(out.size() < kMaxMembers, what, ": more than ", kMaxMembers, " members");
    if (word == "gone") {
      check_replica_id(rest, what);
      out.push_back(Death{rest, 0, true});
      continue;
    }
    const size_t space = rest.find(' ');
    DTRAIN_CHECK_ARG(space != std::string::npos, what, ": '", rest, "' has no silence");
    Death d{rest.substr(0, space), number(rest.substr(space + 1), 0, INT64_MAX / 2, what, "silence")};
    check_replica_id(d.replica, what);
    out.push_back(std::move(d));
  }
  DTRAIN_CHECK_ARG(!out.empty(), what, ": names no replica");
  return out;
}

std::string describe(const std::vector<Death>& deaths) {
  std::string out;
  for (const auto& d : deaths)
    out += d.closed ? detail::cat(out.empty() ? "" : ", ", "replica '", d.replica,
                                  "' (its connection to the lighthouse closed)")
                    : detail::cat(out.empty() ? "" : ", ", "replica '", d.replica, "' (no heartbeat for ",
                                  d.silent_ms, " ms)");
  return out;
}

}  // namespace dtrain::ft::protocol
