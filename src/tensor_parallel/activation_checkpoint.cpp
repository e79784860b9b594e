// Activation checkpointing (activation_checkpoint.h) as one autograd
// function: its forward runs the segment without recording a graph and keeps
// the input (and, with a policy, the outputs it chooses: kept_outputs.h);
// its backward runs the segment again with a graph, then a backward through
// that graph (reentrant, as PyTorch's use_reentrant=True).

#include "dtrain/activation_checkpoint.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/version.h>

#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "common/end_of_backward.h"
#include "common/enforce.h"
#include "tensor_parallel/kept_outputs.h"
#include "tensor_parallel/rng_streams.h"

namespace dtrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Autocast's thread-local state for the CPU and CUDA: whether each is on,
// in which dtype, and whether casts are cached (torch.utils.checkpoint
// saves the same and recomputes under it).
struct AutocastState {
  bool cpu = false, cuda = false, cache = true;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;

  static AutocastState now() {
    AutocastState s;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    s.cpu = at::autocast::is_autocast_enabled(at::kCPU);
    s.cuda = at::autocast::is_autocast_enabled(at::kCUDA);
    s.cpu_dtype = at::autocast::get_autocast_dtype(at::kCPU);
    s.cuda_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
#else
    s.cpu = at::autocast::is_cpu_enabled();
    s.cuda = at::autocast::is_enabled();
    s.cpu_dtype = at::autocast::get_autocast_cpu_dtype();
    s.cuda_dtype = at::autocast::get_autocast_gpu_dtype();
#endif
    s.cache = at::autocast::is_autocast_cache_enabled();
    return s;
  }
  void apply() const {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
#else
    at::autocast::set_cpu_enabled(cpu);
    at::autocast::set_enabled(cuda);
    at::autocast::set_autocast_cpu_dtype(cpu_dtype);
    at::autocast::set_autocast_gpu_dtype(cuda_dtype);
#endif
    at::autocast::set_autocast_cache_enabled(cache);
  }
};

// The autocast state of the forward while the segment is recomputed, and
// the backward's own again afterwards. Entered and left as an autocast
// region is: the casts it cached (parameters in the lower dtype) go when
// the outermost region ends, or a later forward would use them after the
// optimizer has changed the parameters.
class AutocastAsAtForward {
 public:
  explicit AutocastAsAtForward(const AutocastState& at_forward)
      : now_(AutocastState::now()), entered_(at_forward.cpu || at_forward.cuda) {
    at_forward.apply();
    if (entered_) at::autocast::increment_nesting();
  }
  ~AutocastAsAtForward() {
    if (entered_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    now_.apply();
  }
  AutocastAsAtForward(const AutocastAsAtForward&) = delete;
  AutocastAsAtForward& operator=(const AutocastAsAtForward&) = delete;

 private:
  AutocastState now_;
  bool entered_;
};

// What the backward needs besides the input: the segment (a copy: the
// caller's lambda is gone by then), the generators' state at the forward
// and autocast's.
struct Segment : torch::CustomClassHolder {
  std::function<at::Tensor(at::Tensor)> run;
  bool input_needs_grad = false;
  bool preserve_rng = true;
  at::Tensor cpu_rng;
  std::optional<at::Device> device;
  at::Tensor device_rng;
  tensor_parallel::detail::RngStreams tp_rng;  // tensor_parallel_rng.h's streams
  AutocastState autocast;
  std::unique_ptr<detail::KeptOutputs> kept;  // a selective segment's (null without a policy)
};

at::Tensor rng_state(at::Generator generator) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get_state();
}

void set_rng_state(at::Generator generator, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

at::Generator cpu_generator() { return at::globalContext().defaultGenerator(at::Device(at::kCPU)); }

// For the recomputation: the generators as they were at the forward, and
// as they are now again afterwards (the backward must not change what the
// next forward draws).
class RngAsAtForward {
 public:
  explicit RngAsAtForward(const Segment& s) : segment_(s) {
    if (!s.preserve_rng) return;
    cpu_now_ = rng_state(cpu_generator());
    set_rng_state(cpu_generator(), s.cpu_rng);
    tp_now_ = tensor_parallel::detail::rng_streams();
    tensor_parallel::detail::set_rng_streams(s.tp_rng);
    if (s.device) {
      device_now_ = rng_state(at::globalContext().defaultGenerator(*s.device));
      set_rng_state(at::globalContext().defaultGenerator(*s.device), s.device_rng);
    }
  }
  ~RngAsAtForward() {
    if (!segment_.preserve_rng) return;
    set_rng_state(cpu_generator(), cpu_now_);
    tensor_parallel::detail::set_rng_streams(tp_now_);
    if (segment_.device)
      set_rng_state(at::globalContext().defaultGenerator(*segment_.device), device_now_);
  }
  RngAsAtForward(const RngAsAtForward&) = delete;
  RngAsAtForward& operator=(const RngAsAtForward&) = delete;

 private:
  const Segment& segment_;
  at::Tensor cpu_now_, device_now_;
  tensor_parallel::detail::RngStreams tp_now_;
};

Segment& segment_of(AutogradContext* ctx) {
  return *static_cast<Segment*>(ctx->saved_data["segment"].toCapsule().get());
}

at::Tensor run_checked(const Segment& s, const at::Tensor& input, const char* when) {
  at::Tensor out = s.run(input);
  DTRAIN_CHECK_ARG(out.defined(), "activation_checkpoint: the segment returned no tensor ", when);
  return out;
}

// Inputs: the input, an anchor (an empty tensor that requires grad, so
// that the function is recorded even when nothing else going in does: an
// integer input, or one that needs no gradient, feeding parameters that do)
// and the segment.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor&,
                            const c10::intrusive_ptr<Segment>& segment) {
    ctx->save_for_backward({input});
    ctx->saved_data["segment"] = c10::IValue::make_capsule(segment);
    segment->autocast = AutocastState::now();
    if (segment->preserve_rng) {
      segment->cpu_rng = rng_state(cpu_generator());
      segment->tp_rng = tensor_parallel::detail::rng_streams();
      if (input.is_cuda()) {
        segment->device = input.device();
        segment->device_rng = rng_state(at::globalContext().defaultGenerator(input.device()));
      }
    }
    at::Tensor out;
    {
      detail::KeptOutputsScope scope(segment->kept.get(), /*recomputing=*/false);
      out = run_checked(*segment, input, "in the forward");
    }
    if (segment->kept) detail::forget_aliases_of(*segment->kept, out);
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    Segment& s = segment_of(ctx);
    const at::Tensor saved = ctx->get_saved_variables()[0];
    at::Tensor input = saved.detach();
    if (s.input_needs_grad) input.requires_grad_(true);
    at::Tensor out;
    {
      RngAsAtForward rng(s);
      AutocastAsAtForward autocast(s.autocast);
      at::AutoGradMode enable(true);
      detail::KeptOutputsScope scope(s.kept.get(), /*recomputing=*/true);
      out = run_checked(s, input, "when recomputed in the backward");
      if (s.kept) detail::finish_recomputation(*s.kept);
    }
    DTRAIN_CHECK_ARG(out.sizes() == grads[0].sizes(),
                     "activation_checkpoint: the segment returned ", out.sizes(),
                     " when recomputed in the backward but ", grads[0].sizes(),
                     " in the forward; it must compute the same thing twice");
    if (out.requires_grad()) {
      detail::NestedBackward nested;  // DDP's end-of-backward work waits for the enclosing pass
      torch::autograd::backward({out}, {grads[0]});
    }
    return {s.input_needs_grad ? input.grad() : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor activation_checkpoint(const std::function<at::Tensor(at::Tensor)>& segment,
                                 const at::Tensor& input,
                                 const ActivationCheckpointOptions& options) {
  DTRAIN_CHECK_ARG(static_cast<bool>(segment), "activation_checkpoint: no segment to run");
  DTRAIN_CHECK_ARG(input.defined(), "activation_checkpoint: the input is an undefined tensor");
  if (!at::GradMode::is_enabled()) {
    // Its multiplies are its own, not an enclosing selective segment's
    // (whose recomputation runs this one as a segment of its own).
    detail::KeptOutputsScope scope(nullptr, false);
    return segment(input);
  }
  auto s = c10::make_intrusive<Segment>();
  s->run = segment;
  s->input_needs_grad = input.requires_grad();
  s->preserve_rng = options.preserve_rng_state();
  if (options.policy()) {
    s->kept = std::make_unique<detail::KeptOutputs>();
    s->kept->policy = options.policy();
  }
  const auto anchor = at::empty({0}, input.options().dtype(at::kFloat)).requires_grad_(true);
  return CheckpointFunction::apply(input, anchor, s);
}

}  // namespace dtrain
