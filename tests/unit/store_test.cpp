// The Store contract (include/dtrain/store/store.h), run against every
// implementation: HashStore, FileStore, TcpStore (server and clients in this
// process) and PrefixStore over a HashStore. Each test opens several
// handles onto one store, so "another rank" is another handle (another
// FileStore object on the same file, another TCP connection) in a thread.

#include <gtest/gtest.h>

#include "common/paths.h"
#include "harness/assertions.h"
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <future>
#include <numeric>
#include <thread>

#include "dtrain/errors.h"
#include "dtrain/store/file_store.h"
#include "dtrain/store/hash_store.h"
#include "dtrain/store/prefix_store.h"
#include "dtrain/store/tcp_store.h"

namespace dtrain {
namespace {

using namespace std::chrono_literals;
using ms = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string str(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }
using testing::Contains;
using testing::seconds_since;

// A fresh directory under the temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    path_ = paths::make_temp_dir("dtrain_store_");
  }
  ~TempDir() { paths::remove_all(path_); }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Opens handles onto one store of a given kind.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::shared_ptr<Store> open(ms timeout) = 0;
};

// One HashStore shared by every handle (its timeout is the latest asked for).
class HashBackend : public Backend {
 public:
  std::shared_ptr<Store> open(ms timeout) override {
    store_->set_timeout(timeout);
    return store_;
  }

 private:
  std::shared_ptr<HashStore> store_ = std::make_shared<HashStore>();
};

class FileBackend : public Backend {
 public:
  std::shared_ptr<Store> open(ms timeout) override {
    return std::make_shared<FileStore>(dir_.file("store"), timeout);
  }

 private:
  TempDir dir_;
};

// The server's own TcpStore stays alive for the test; each handle is
// another client connection.
class TcpBackend : public Backend {
 public:
  std::shared_ptr<Store> open(ms timeout) override {
    return std::make_shared<TcpStore>(
        TcpStoreOptions().port(server_.port()).timeout(timeout));
  }

 private:
  TcpStore server_{TcpStoreOptions().port(0).is_server(true).timeout(5s)};
};

class PrefixBackend : public Backend {
 public:
  std::shared_ptr<Store> open(ms timeout) override {
    inner_->set_timeout(timeout);
    return std::make_shared<PrefixStore>("job", inner_);
  }

 private:
  std::shared_ptr<HashStore> inner_ = std::make_shared<HashStore>();
};

class StoreTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string& kind = GetParam();
    if (kind == "Hash") backend_ = std::make_unique<HashBackend>();
    if (kind == "File") backend_ = std::make_unique<FileBackend>();
    if (kind == "Tcp") backend_ = std::make_unique<TcpBackend>();
    if (kind == "Prefix") backend_ = std::make_unique<PrefixBackend>();
    ASSERT_NE(backend_, nullptr) << kind;
  }
  std::shared_ptr<Store> open(ms timeout = 10s) { return backend_->open(timeout); }

  std::unique_ptr<Backend> backend_;
};

TEST_P(StoreTest, SetThenGetRoundTripsBinaryValues) {
  auto a = open(), b = open();
  const std::vector<uint8_t> binary{0, 1, 0xff, 0, 'x', 0x80};
  a->set("bin", binary);
  EXPECT_EQ(b->get("bin"), binary);
  a->set("text", "hello");
  EXPECT_EQ(b->get_string("text"), "hello");
  b->set("text", "again");  // overwrite
  EXPECT_EQ(a->get_string("text"), "again");
  a->set("empty", std::vector<uint8_t>{});
  EXPECT_TRUE(b->get("empty").empty());
  EXPECT_TRUE(b->check({"empty"}));
}

TEST_P(StoreTest, GetBlocksUntilAnotherThreadSets) {
  auto getter = open(), setter = open();
  std::promise<void> started;
  auto result = std::async(std::launch::async, [&] {
    started.set_value();
    return getter->get_string("late");
  });
  started.get_future().wait();
  EXPECT_EQ(result.wait_for(0ms), std::future_status::timeout) << "get() returned early";
  setter->set("late", "value");
  EXPECT_EQ(result.get(), "value");
}

TEST_P(StoreTest, GetTimesOutNamingTheKey) {
  auto s = open(200ms);
  const auto start = Clock::now();
  try {
    s->get("missing_key");
    FAIL() << "get() of a missing key returned";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(Contains(e.what(), "timed out after 200 ms waiting for key '"));
    EXPECT_TRUE(Contains(e.what(), "missing_key'"));
  }
  const double elapsed = seconds_since(start);
  EXPECT_GE(elapsed, 0.19);
  EXPECT_LT(elapsed, 2.0);
}

TEST_P(StoreTest, AddCountsFromZeroAndStoresDecimalText) {
  auto a = open(), b = open();
  EXPECT_EQ(a->add("counter", 5), 5);
  EXPECT_EQ(b->add("counter", -2), 3);
  EXPECT_EQ(a->get_string("counter"), "3");
  EXPECT_FALSE(a->check({"zero"}));
  EXPECT_EQ(b->add("zero", 0), 0);  // a missing key counts as 0, and now exists
  EXPECT_EQ(a->get_string("zero"), "0");
  a->set("preset", "40");
  EXPECT_EQ(b->add("preset", 2), 42);
}

TEST_P(StoreTest, AddOnANonIntegerValueIsInvalidArgument) {
  auto a = open();
  a->set("word", "abc");
  try {
    a->add("word", 1);
    FAIL() << "add() on 'abc' succeeded";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(Contains(e.what(), "word'"));
    EXPECT_TRUE(Contains(e.what(), "'abc' is not a decimal integer"));
  }
  EXPECT_EQ(a->get_string("word"), "abc");  // unchanged, and the store still works
}

TEST_P(StoreTest, ConcurrentAddsFromFourThreadsGiveTheExactTotal) {
  constexpr int kThreads = 4, kAdds = 100;
  std::vector<std::shared_ptr<Store>> handles;
  for (int t = 0; t < kThreads; ++t) handles.push_back(open());
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kAdds; ++i) seen[t].push_back(handles[t]->add("total", 1));
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(handles[0]->get_string("total"), std::to_string(kThreads * kAdds));
  // Every add saw a distinct intermediate sum: none was lost or doubled.
  std::vector<int64_t> all;
  for (const auto& s : seen) all.insert(all.end(), s.begin(), s.end());
  std::sort(all.begin(), all.end());
  std::vector<int64_t> expected(kThreads * kAdds);
  std::iota(expected.begin(), expected.end(), 1);
  EXPECT_EQ(all, expected);
}

TEST_P(StoreTest, CompareSetFollowsTorchSemantics) {
  auto s = open();
  // Missing key, empty expected: the key is created.
  EXPECT_EQ(str(s->compare_set("k", {}, bytes("first"))), "first");
  EXPECT_EQ(s->get_string("k"), "first");
  // Current value equals expected: replaced.
  EXPECT_EQ(str(s->compare_set("k", bytes("first"), bytes("second"))), "second");
  EXPECT_EQ(s->get_string("k"), "second");
  // Current value differs: unchanged, the current value is returned.
  EXPECT_EQ(str(s->compare_set("k", bytes("first"), bytes("third"))), "second");
  EXPECT_EQ(s->get_string("k"), "second");
  // Missing key, non-empty expected: nothing is stored; torch returns expected.
  EXPECT_EQ(str(s->compare_set("absent", bytes("x"), bytes("y"))), "x");
  EXPECT_FALSE(s->check({"absent"}));
}

TEST_P(StoreTest, CheckNeverBlocksAndNeedsEveryKey) {
  auto s = open(5s);
  const auto start = Clock::now();
  EXPECT_TRUE(s->check({}));
  EXPECT_FALSE(s->check({"a"}));
  s->set("a", "1");
  EXPECT_TRUE(s->check({"a"}));
  EXPECT_FALSE(s->check({"a", "b"}));
  s->set("b", "2");
  EXPECT_TRUE(s->check({"a", "b"}));
  EXPECT_LT(seconds_since(start), 1.0);
}

TEST_P(StoreTest, DeleteKeyReportsWhetherTheKeyExisted) {
  auto s = open(100ms);
  s->set("gone", "1");
  EXPECT_TRUE(s->delete_key("gone"));
  EXPECT_FALSE(s->check({"gone"}));
  EXPECT_FALSE(s->delete_key("gone"));
  EXPECT_FALSE(s->delete_key("never_set"));
  EXPECT_THROW(s->get("gone"), TimeoutError);
  s->set("gone", "back");  // a deleted key can be set again
  EXPECT_EQ(s->get_string("gone"), "back");
}

TEST_P(StoreTest, NumKeysCountsUserKeys) {
  auto s = open();
  EXPECT_EQ(s->num_keys(), 0);
  s->set("a", "1");
  s->set("b", "2");
  EXPECT_EQ(s->num_keys(), 2);
  s->add("c", 1);
  EXPECT_EQ(s->num_keys(), 3);
  s->set("a", "overwritten");
  EXPECT_EQ(s->num_keys(), 3);
  s->delete_key("b");
  EXPECT_EQ(s->num_keys(), 2);
}

TEST_P(StoreTest, WaitReturnsOnceEveryKeyIsSet) {
  auto waiter = open(), setter = open();
  std::promise<void> waiting;
  std::thread t([&] {
    waiting.get_future().wait();
    setter->set("w1", "1");
    setter->set("w2", "2");
  });
  waiting.set_value();
  const auto start = Clock::now();
  waiter->wait({"w1", "w2"}, 10s);
  EXPECT_LT(seconds_since(start), 5.0);
  t.join();
  EXPECT_TRUE(waiter->check({"w1", "w2"}));
  waiter->wait({}, 0ms);       // nothing to wait for
  waiter->wait({"w1"}, 0ms);   // already there
}

TEST_P(StoreTest, WaitTimesOutNamingTheMissingKeys) {
  auto s = open();
  s->set("present", "1");
  const auto start = Clock::now();
  try {
    s->wait({"present", "never"}, 200ms);
    FAIL() << "wait() for a missing key returned";
  } catch (const TimeoutError& e) {
    EXPECT_TRUE(Contains(e.what(), "timed out after 200 ms waiting for key '"));
    EXPECT_TRUE(Contains(e.what(), "never'"));
    EXPECT_FALSE(Contains(e.what(), "present"));
  }
  const double elapsed = seconds_since(start);
  EXPECT_GE(elapsed, 0.19);
  EXPECT_LT(elapsed, 2.5);
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreTest,
                         ::testing::Values("Hash", "File", "Tcp", "Prefix"),
                         [](const auto& info) { return info.param; });

// ---- PrefixStore --------------------------------------------------------------

TEST(PrefixStore, KeepsPrefixesApart) {
  auto inner = std::make_shared<HashStore>(ms(100));
  PrefixStore a("a", inner), b("b", inner);
  a.set("k", "from a");
  EXPECT_EQ(inner->get_string("a/k"), "from a");
  EXPECT_FALSE(b.check({"k"}));
  EXPECT_THROW(b.get("k"), TimeoutError);
  b.set("k", "from b");
  EXPECT_EQ(a.get_string("k"), "from a");
  EXPECT_EQ(b.get_string("k"), "from b");
  EXPECT_EQ(a.add("n", 2), 2);
  EXPECT_EQ(b.add("n", 5), 5);
  EXPECT_TRUE(b.delete_key("n"));
  EXPECT_EQ(a.get_string("n"), "2");
  EXPECT_THROW(b.wait({"n"}, 50ms), TimeoutError);
  EXPECT_EQ(a.num_keys(), 3);  // a/k, b/k, a/n: counts the whole inner store
}

TEST(PrefixStore, NestsAndForwardsTimeouts) {
  auto inner = std::make_shared<HashStore>(ms(10000));
  auto outer = std::make_shared<PrefixStore>("job", inner);
  PrefixStore group("group1", outer);
  group.set("k", "v");
  EXPECT_EQ(inner->get_string("job/group1/k"), "v");
  group.set_timeout(ms(50));
  EXPECT_EQ(inner->timeout(), ms(50));
  EXPECT_THROW(group.get("missing"), TimeoutError);
}

TEST(PrefixStore, RejectsANullInnerStore) {
  EXPECT_THROW(PrefixStore("p", nullptr), InvalidArgument);
}

// ---- FileStore ----------------------------------------------------------------

TEST(FileStore, IgnoresATornTrailingRecord) {
  TempDir dir;
  const std::string path = dir.file("torn");
  FileStore a(path, ms(100));
  a.set("whole", "1");
  {
    // A writer killed mid-record: a header promising a 100-byte value, and
    // only 3 bytes of it.
    std::ofstream f(path, std::ios::binary | std::ios::app);
    const char torn[] = {'S', 4, 0, 0, 0, 100, 0, 0, 0, 'l', 'o', 's', 't', 'x', 'y', 'z'};
    f.write(torn, sizeof(torn));
  }
  FileStore b(path, ms(100));
  EXPECT_EQ(b.get_string("whole"), "1");
  EXPECT_FALSE(b.check({"lost"}));
  EXPECT_EQ(b.num_keys(), 1);
  // The next write replaces the torn bytes, so both handles read it cleanly.
  b.set("after", "2");
  EXPECT_EQ(a.get_string("after"), "2");
  EXPECT_EQ(a.num_keys(), 2);
  FileStore c(path, ms(100));
  EXPECT_EQ(c.get_string("after"), "2");
  EXPECT_EQ(c.get_string("whole"), "1");
}

TEST(FileStore, TheLastUserRemovesTheFile) {
  TempDir dir;
  const std::string path = dir.file("users");
  auto a = std::make_unique<FileStore>(path);
  auto b = std::make_unique<FileStore>(path);
  a->set("k", "v");
  EXPECT_EQ(a->num_keys(), 1);  // the user counter is not a user key
  a.reset();
  EXPECT_TRUE(paths::exists(path));
  EXPECT_EQ(b->get_string("k"), "v");
  b.reset();
  EXPECT_FALSE(paths::exists(path));
  // A new store on the same path starts empty.
  FileStore c(path, ms(50));
  EXPECT_EQ(c.num_keys(), 0);
  EXPECT_FALSE(c.check({"k"}));
}

TEST(FileStore, AMissingDirectoryIsInvalidArgumentNamingThePath) {
  TempDir dir;
  const std::string path = dir.file("no_such_dir/store");
  try {
    FileStore s(path);
    FAIL() << "FileStore in a missing directory was created";
  } catch (const InvalidArgument& e) {
    EXPECT_TRUE(Contains(e.what(), "'" + path + "'"));
    EXPECT_TRUE(Contains(e.what(), "No such file or directory (does its directory exist?)"));
  }
}

std::string file_store_error(const std::string& path) {
  try {
    FileStore s(path);
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

// The file is opened without following a symbolic link, created private
// (0600), and used only when it is a regular file of this user (issue 30,
// item 13: a link or a file planted by another user was used as is).
TEST(FileStore, OnlyARegularFileOfThisUserIsUsed) {
  TempDir dir;
  const std::string target = dir.file("target"), link = dir.file("link");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  std::string err = file_store_error(link);
  EXPECT_TRUE(Contains(err, "'" + link + "'")) << err;
  EXPECT_TRUE(Contains(err, "it is a symbolic link")) << err;
  EXPECT_FALSE(paths::exists(target)) << "the link was followed";

  const std::string mine = dir.file("mine");
  {
    FileStore keep(mine);  // the file stays while a user holds it
    struct stat st {};
    ASSERT_EQ(::stat(mine.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }

  if (::geteuid() != 0) return;  // only root can give a file to another user
  const std::string planted = dir.file("planted");
  std::ofstream(planted).close();
  ASSERT_EQ(::chown(planted.c_str(), 65534, 65534), 0);
  err = file_store_error(planted);
  EXPECT_TRUE(Contains(err, "'" + planted + "'")) << err;
  EXPECT_TRUE(Contains(err, "is owned by uid 65534, not by this process's user (uid 0)")) << err;
}

TEST(FileStore, ACorruptRecordIsReportedNotSkipped) {
  TempDir dir;
  const std::string path = dir.file("corrupt");
  {
    std::ofstream f(path, std::ios::binary);
    f << "this is not a store file";
  }
  try {
    FileStore s(path);
    FAIL() << "a corrupt file was accepted";
  } catch (const NetworkError& e) {
    EXPECT_TRUE(Contains(e.what(), "corrupt record at byte 0"));
  }
}

}  // namespace
}  // namespace dtrain
