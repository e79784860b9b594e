#include "checkpoint/staging.h"

#include <signal.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace dtrain::checkpoint::staging {
namespace {

// Every tensor of the part, by its buffer's key.
std::vector<std::pair<std::string, at::Tensor*>> tensors_of(storage::Part& part) {
  std::vector<std::pair<std::string, at::Tensor*>> out;
  for (auto& [name, t] : part.replicated) out.emplace_back("r/" + name, &t);
  for (auto& [name, s] : part.sharded) out.emplace_back("s/" + name, &s.local);
  return out;
}

}  // namespace

void stage(storage::Part& part, Buffers& buffers, bool reuse, bool die_half_way) {
  at::AutoGradMode no_grad(false);
  Buffers staged;
  const auto tensors = tensors_of(part);
  size_t n = 0;
  for (const auto& [key, t] : tensors) {
    if (die_half_way && ++n > tensors.size() / 2) ::raise(SIGKILL);
    at::Tensor buffer;
    auto kept = buffers.find(key);
    if (kept != buffers.end() && kept->second.sizes() == t->sizes() && kept->second.scalar_type() == t->scalar_type())
      buffer = kept->second;
    else
      buffer = at::empty(t->sizes(), at::TensorOptions().dtype(t->scalar_type()).pinned_memory(t->is_cuda()));
    buffer.copy_(*t);
    *t = buffer;
    staged[key] = buffer;
  }
  if (die_half_way) ::raise(SIGKILL);  // no tensor to stage: dies all the same
  buffers = reuse ? std::move(staged) : Buffers();
}

CallersStreams::CallersStreams(const storage::Part& part) {
  for (const auto& [name, t] : part.replicated) record(t);
  for (const auto& [name, s] : part.sharded) record(s.local);
}

void CallersStreams::record(const at::Tensor& t) {
  if (t.device().is_cpu()) return;
  for (const auto& [device, event] : events_)
    if (device == t.device()) return;
  const auto* impl = c10::impl::getDeviceGuardImpl(t.device().type());
  auto event = std::make_shared<c10::Event>(t.device().type());
  event->record(impl->getStream(t.device()));
  events_.emplace_back(t.device(), std::move(event));
}

void CallersStreams::order_this_thread() const {
  for (const auto& [device, event] : events_)
    event->block(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
}

}  // namespace dtrain::checkpoint::staging
