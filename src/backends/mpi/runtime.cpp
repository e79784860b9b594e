#include "backends/mpi/runtime.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdlib>
#include <mutex>

#include "common/enforce.h"

namespace dtrain::mpi_backend {
namespace {

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    default: return "MPI_THREAD_MULTIPLE";
  }
}

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

// User ops for the 16-bit floats: element-wise on uint16 storage.
template <typename T, typename F>
void combine16(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = static_cast<T>(F{}(static_cast<float>(a[i]), static_cast<float>(b[i])));
}
struct Add { float operator()(float a, float b) const { return a + b; } };
struct Mul { float operator()(float a, float b) const { return a * b; } };
struct Lo { float operator()(float a, float b) const { return b < a ? b : a; } };
struct Hi { float operator()(float a, float b) const { return a < b ? b : a; } };

struct HalfOps {
  MPI_Op ops[2][4];  // [half, bfloat16][sum, product, min, max]
  HalfOps() {
    MPI_Op_create(&combine16<c10::Half, Add>, 1, &ops[0][0]);
    MPI_Op_create(&combine16<c10::Half, Mul>, 1, &ops[0][1]);
    MPI_Op_create(&combine16<c10::Half, Lo>, 1, &ops[0][2]);
    MPI_Op_create(&combine16<c10::Half, Hi>, 1, &ops[0][3]);
    MPI_Op_create(&combine16<c10::BFloat16, Add>, 1, &ops[1][0]);
    MPI_Op_create(&combine16<c10::BFloat16, Mul>, 1, &ops[1][1]);
    MPI_Op_create(&combine16<c10::BFloat16, Lo>, 1, &ops[1][2]);
    MPI_Op_create(&combine16<c10::BFloat16, Hi>, 1, &ops[1][3]);
  }
};

int op_index(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: case ReduceOp::AVG: return 0;
    case ReduceOp::PRODUCT: return 1;
    case ReduceOp::MIN: return 2;
    case ReduceOp::MAX: return 3;
    default: break;  // bitwise: integers only, never 16-bit floats
  }
  throw InternalError("mpi: unknown reduce op");
}

}  // namespace

void ensure_initialized() {
  static std::once_flag once;
  std::call_once(once, [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    int provided = MPI_THREAD_SINGLE;
    if (initialized) {
      MPI_Query_thread(&provided);
    } else {
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
        throw BackendUnavailable("mpi: MPI_Init_thread failed");
      std::atexit(finalize_at_exit);
    }
    if (provided < MPI_THREAD_MULTIPLE)
      throw BackendUnavailable(detail::cat(
          "mpi: the MPI library provides ", thread_level_name(provided),
          "; dtrain needs MPI_THREAD_MULTIPLE (an MPI built with thread support)"));
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  });
}

std::pair<int, int> world_rank_and_size() {
  ensure_initialized();
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return {rank, size};
}

MPI_Datatype datatype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return MPI_FLOAT;
    case c10::ScalarType::Double: return MPI_DOUBLE;
    case c10::ScalarType::Half: case c10::ScalarType::BFloat16: return MPI_UINT16_T;
    case c10::ScalarType::Int: return MPI_INT32_T;
    case c10::ScalarType::Long: return MPI_INT64_T;
    case c10::ScalarType::Byte: return MPI_UINT8_T;
    case c10::ScalarType::Char: return MPI_INT8_T;
    default:
      throw InvalidArgument(detail::cat("mpi: dtype ", c10::toString(dtype), " is not supported"));
  }
}

MPI_Op reduction(c10::ScalarType dtype, ReduceOp op) {
  if (dtype == c10::ScalarType::Half || dtype == c10::ScalarType::BFloat16) {
    static HalfOps* half_ops = new HalfOps;  // lives until exit, like MPI itself
    return half_ops->ops[dtype == c10::ScalarType::Half ? 0 : 1][op_index(op)];
  }
  switch (op) {
    case ReduceOp::BAND: return MPI_BAND;
    case ReduceOp::BOR: return MPI_BOR;
    case ReduceOp::BXOR: return MPI_BXOR;
    default: break;
  }
  static const MPI_Op builtin[4] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX};
  return builtin[op_index(op)];
}

}  // namespace dtrain::mpi_backend
