// Telling the dialects apart, and a c10d request's extent from its first
// bytes (store/c10d_wire.h).

#include "store/c10d_wire.h"

#include <iterator>

namespace dtrain::c10d_wire {

Dialect detect(const uint8_t* p, size_t n, bool* refused) {
  *refused = false;
  if (n == 0) return Dialect::kUnknown;
  if (p[0] == static_cast<uint8_t>(wire::kMagic & 0xff)) {  // 'D' of "DTRS"
    return Dialect::kDtrain;  // dtrain's header check refuses a wrong magic
  }
  if (p[0] == 0) {  // v2's VALIDATE, or v1's SET
    if (n < 5) return Dialect::kUnknown;
    uint32_t magic;
    std::memcpy(&magic, p + 1, sizeof(magic));
    return magic == kValidateMagic ? Dialect::kC10dV2 : Dialect::kC10dV1;
  }
  if (p[0] <= 8) return Dialect::kC10dV1;  // v2 clients always open with VALIDATE
  *refused = true;
  return Dialect::kUnknown;
}

Op decode_op(Dialect d, uint8_t b) {
  static const Op v1[] = {Op::kSet,   Op::kCompareSet, Op::kGet,      Op::kAdd,   Op::kCheck,
                          Op::kWait,  Op::kNumKeys,    Op::kWatchKey, Op::kDelete};
  static const Op v2[] = {Op::kValidate, Op::kSet,        Op::kCompareSet, Op::kGet,
                          Op::kAdd,      Op::kCheck,      Op::kWait,       Op::kNumKeys,
                          Op::kDelete,   Op::kAppend,     Op::kMultiGet,   Op::kMultiSet,
                          Op::kCancelWait, Op::kPing,     Op::kQueuePush,  Op::kQueuePop,
                          Op::kQueueLen, Op::kListKeys,   Op::kBarrier};
  if (d == Dialect::kC10dV1) return b < std::size(v1) ? v1[b] : Op::kInvalid;
  return b < std::size(v2) ? v2[b] : Op::kInvalid;
}

const char* op_name(Op op) {
  static const char* names[] = {
      "VALIDATE",   "SET",         "COMPARE_SET", "GET",       "ADD",        "CHECK",
      "WAIT",       "GETNUMKEYS",  "DELETE_KEY",  "APPEND",    "MULTI_GET",  "MULTI_SET",
      "CANCEL_WAIT", "PING",       "WATCH_KEY",   "QUEUE_PUSH", "QUEUE_POP", "QUEUE_LEN",
      "LIST_KEYS",  "BARRIER",     "an unknown query type"};
  return names[static_cast<size_t>(op)];
}

namespace {

// The fields of each request after its query byte.
enum Field : uint8_t { kU32, kI64, kKey, kValue, kKeyList, kPairList, kEnd };

const Field* layout_of(Op op) {
  static const Field u32[] = {kU32, kEnd}, key_value[] = {kKey, kValue, kEnd},
                     pairs[] = {kPairList, kEnd}, cas[] = {kKey, kValue, kValue, kEnd},
                     add[] = {kKey, kI64, kEnd}, key[] = {kKey, kEnd}, keys[] = {kKeyList, kEnd},
                     none[] = {kEnd};
  switch (op) {
    case Op::kValidate:
    case Op::kPing: return u32;
    case Op::kSet:
    case Op::kAppend: return key_value;
    case Op::kMultiSet: return pairs;
    case Op::kCompareSet: return cas;
    case Op::kAdd: return add;
    case Op::kGet:
    case Op::kDelete: return key;
    case Op::kMultiGet:
    case Op::kCheck:
    case Op::kWait: return keys;
    default: return none;  // no fields, or not supported: the handler decides
  }
}

}  // namespace

size_t scan(Dialect d, const uint8_t* p, size_t n, Scan& s, size_t* need) {
  if (n == 0) {
    *need = 1;
    return 0;
  }
  const Field* layout = layout_of(decode_op(d, p[0]));
  if (s.pos == 0) s.pos = 1;
  auto u64_at = [&](uint64_t at) {
    uint64_t v;
    std::memcpy(&v, p + at, sizeof(v));
    return v;
  };
  for (;;) {
    Field f = layout[s.field];
    if (s.in_list) {
      if (s.items_left == 0) {
        s.in_list = false;
        ++s.field;
        continue;
      }
      f = f == kPairList && s.value_next ? kValue : kKey;
    }
    if (f == kEnd) {
      const size_t size = s.pos;
      s = Scan{};
      return size;
    }
    uint64_t end = s.pos + (f == kU32 ? 4 : 8);
    if (end > n) {
      *need = end;
      return 0;
    }
    if (f == kKey || f == kValue) {
      const uint64_t len = u64_at(s.pos);
      if (len > (f == kKey ? kMaxKeyBytes : kMaxValueBytes))
        throw wire::Malformed{f == kKey ? "key over the 64 KiB limit" : "value over the 64 MiB limit"};
      end += len;
    } else if (f == kKeyList || f == kPairList) {
      const uint64_t count = u64_at(s.pos);
      if (count > kMaxKeysPerRequest) throw wire::Malformed{"more than 131072 keys in one request"};
      s.in_list = true;
      s.items_left = count;
    }
    if (end > kMaxRequestBytes) throw wire::Malformed{"request over the 64 MiB limit"};
    if (end > n) {
      *need = end;
      return 0;
    }
    s.pos = end;
    if (!s.in_list || f == kKeyList || f == kPairList) {
      if (!s.in_list) ++s.field;
      continue;
    }
    if (layout[s.field] == kPairList && !s.value_next) {
      s.value_next = true;  // the pair's value
      continue;
    }
    s.value_next = false;
    --s.items_left;
  }
}

}  // namespace dtrain::c10d_wire
