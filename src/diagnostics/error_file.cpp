// Error files: why a worker failed, for its launcher (launch_env.h).

#include <cxxabi.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <typeinfo>

#include "common/env.h"
#include "common/json_text.h"
#include "diagnostics/error_file.h"
#include "dtrain/launch_env.h"

namespace dtrain {
namespace {

std::string type_name(const std::type_info& type) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> name(
      abi::__cxa_demangle(type.name(), nullptr, nullptr, &status), std::free);
  return status == 0 && name ? name.get() : type.name();
}

// torchrun's layout, with dtrain's nanosecond clock beside its seconds
// (readers that do not know it ignore it; dtrain-run orders failures by it).
std::string error_json(const std::string& message) {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const auto s = std::chrono::duration_cast<std::chrono::seconds>(now).count();
  const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now).count();
  const std::string text = detail::json_escaped(message);
  return "{\"message\": {\"message\": \"" + text + "\", \"extraInfo\": {\"py_callstack\": \"" + text +
         "\", \"timestamp\": \"" + std::to_string(s) + "\", \"dtrain_timestamp_ns\": \"" +
         std::to_string(ns) + "\"}}}\n";
}

// Whole or not at all: a temporary file beside it, renamed over it.
bool write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  const bool ok = ::close(fd) == 0 && done == text.size() && ::rename(tmp.c_str(), path.c_str()) == 0;
  if (!ok) ::unlink(tmp.c_str());
  return ok;
}

std::terminate_handler previous_handler = nullptr;

// Records the exception that is ending the program, then hands over.
[[noreturn]] void record_and_terminate() {
  if (auto current = std::current_exception()) {
    try {
      std::rethrow_exception(current);
    } catch (const std::exception& e) {
      record_error(e);
    } catch (...) {
      record_error(std::string("an exception of unknown type"));
    }
  }
  if (previous_handler) previous_handler();
  std::abort();
}

}  // namespace

bool record_error(const std::string& message) {
  try {
    const auto path = env::get(env::kErrorFile);
    if (!path || path->empty()) return false;
    return write_file(*path, error_json(message));
  } catch (...) {
    return false;
  }
}

bool record_error(const std::exception& e) {
  try {
    return record_error(type_name(typeid(e)) + ": " + e.what());
  } catch (...) {
    return false;
  }
}

namespace detail {

void install_error_file_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    const auto path = env::get(env::kErrorFile);
    if (!path || path->empty()) return;
    previous_handler = std::set_terminate(record_and_terminate);
  });
}

}  // namespace detail
}  // namespace dtrain
