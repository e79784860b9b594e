// The tensor-parallel random streams (tensor_parallel_rng.h): per device,
// a generator state kept beside the default generator and swapped into it
// while a ForkRng lives.

#include <ATen/Context.h>
#include <ATen/core/Generator.h>

#include <mutex>

#include "common/enforce.h"
#include "dtrain/tensor_parallel_rng.h"
#include "tensor_parallel/group.h"
#include "tensor_parallel/rng_streams.h"

namespace dtrain::tensor_parallel {
namespace {

std::mutex mu;
detail::RngStreams streams;     // guarded by mu
// Devices with a ForkRng alive: their stream is in the default generator
// meanwhile, and this is the default generator's own state to go back to.
detail::RngStreams forked;      // guarded by mu

at::Generator generator_of(c10::Device device, const char* what) {
  DTRAIN_CHECK_ARG(device.is_cpu() || (device.is_cuda() && device.has_index()), what,
                   ": device ", device.str(), " (the CPU, or a CUDA device with its index)");
  return at::globalContext().defaultGenerator(device);
}

at::Tensor get_state(at::Generator& g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_state(at::Generator& g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

void set_seed(at::Generator& g, uint64_t seed) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_current_seed(seed);
}

}  // namespace

void manual_seed(uint64_t seed, const std::shared_ptr<ProcessGroup>& group, c10::Device device) {
  const auto g = detail::group_or_default(group, "tensor_parallel::manual_seed");
  auto gen = generator_of(device, "tensor_parallel::manual_seed");
  std::lock_guard<std::mutex> lock(mu);
  DTRAIN_CHECK_ARG(!forked.count(device.str()), "tensor_parallel::manual_seed: a ForkRng of ",
                   device.str(), " is alive");
  set_seed(gen, seed + 2718 + static_cast<uint64_t>(g->rank()));
  streams[device.str()] = get_state(gen);
  set_seed(gen, seed);
}

ForkRng::ForkRng(c10::Device device) : device_(device) {
  auto gen = generator_of(device, "ForkRng");
  std::lock_guard<std::mutex> lock(mu);
  const auto stream = streams.find(device.str());
  DTRAIN_CHECK_ARG(stream != streams.end(), "ForkRng: no tensor-parallel stream for ", device.str(),
                   " (call tensor_parallel::manual_seed(seed, group", device.is_cpu() ? "" : ", device",
                   ") first)");
  DTRAIN_CHECK_ARG(!forked.count(device.str()), "ForkRng: one for ", device.str(),
                   " is alive already (they do not nest)");
  forked[device.str()] = get_state(gen);
  set_state(gen, stream->second);
}

ForkRng::~ForkRng() {
  auto gen = at::globalContext().defaultGenerator(device_);
  std::lock_guard<std::mutex> lock(mu);
  const auto outer = forked.find(device_.str());
  streams[device_.str()] = get_state(gen);
  set_state(gen, outer->second);
  forked.erase(outer);
}

namespace detail {

// A device forked now is left out (its stream's place is in the default
// generator, which activation_checkpoint keeps itself).
RngStreams rng_streams() {
  std::lock_guard<std::mutex> lock(mu);
  RngStreams now;
  for (const auto& [device, state] : streams)
    if (!forked.count(device)) now[device] = state;
  return now;
}

void set_rng_streams(const RngStreams& given) {
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [device, state] : given)
    if (!forked.count(device)) streams[device] = state;
}

}  // namespace detail
}  // namespace dtrain::tensor_parallel
