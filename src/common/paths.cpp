#include "common/paths.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/enforce.h"
#include "common/socket.h"

namespace dtrain::paths {

bool exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::vector<std::string> list(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  return names;
}

std::string make_temp_dir(const std::string& prefix) {
  std::string tmpl = "/tmp/" + prefix + "XXXXXX";
  DTRAIN_CHECK_ARG(::mkdtemp(tmpl.data()) != nullptr, "cannot create a directory like ", tmpl,
                   ": ", std::strerror(errno));
  return tmpl;
}

void remove_all(const std::string& path) {
  ::nftw(
      path.c_str(),
      [](const char* p, const struct stat*, int, struct FTW*) {
        ::remove(p);  // best effort: keep going
        return 0;
      },
      16, FTW_DEPTH | FTW_PHYS);
}

void copy_file(const std::string& from, const std::string& to) {
  net::Fd in(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
  DTRAIN_CHECK_ARG(in, "cannot open ", from, ": ", std::strerror(errno));
  net::Fd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  DTRAIN_CHECK_ARG(out, "cannot create ", to, ": ", std::strerror(errno));
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(in.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    DTRAIN_CHECK_ARG(n >= 0, "cannot read ", from, ": ", std::strerror(errno));
    if (n == 0) break;
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = ::write(out.get(), buf + done, static_cast<size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      DTRAIN_CHECK_ARG(w > 0, "cannot write ", to, ": ", std::strerror(errno));
      done += w;
    }
  }
}

}  // namespace dtrain::paths
