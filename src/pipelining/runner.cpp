#include "pipelining/runner.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>

#include "common/enforce.h"
#include "common/rethrow.h"
#include "core/internal_tags.h"
#include "diagnostics/op_label.h"
#include "diagnostics/timeline.h"
#include "dtrain/errors.h"

namespace dtrain::pipelining::detail {
namespace {

using Clock = std::chrono::steady_clock;
using dtrain::detail::cat;
using dtrain::detail::join;
using dtrain::detail::rethrow_with;

// Tags of the pipeline's messages: above what programs usually pick, one
// per receiving stage, direction and microbatch; a stage's first-step shape
// header just below them.
constexpr int kShapeHeaderMaxDims = 10;
constexpr int kMaxLocalStages = 16;

double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

std::string shape_text(const std::vector<int64_t>& sizes, at::ScalarType dtype) {
  return cat(c10::toString(dtype), " [", join(sizes), "]");
}

// DTRAIN_TIMELINE: one track per stage, a span per forward and backward.
void draw(const char* what, int stage, int mb, Clock::time_point begin) {
  namespace tl = dtrain::detail::timeline;
  if (!tl::enabled()) return;
  tl::name_track(tl::kPipelineTrack + stage, cat("pipeline stage ", stage));
  tl::span(what, tl::kPipelineTrack + stage, begin, Clock::now(), cat("\"microbatch\": ", mb));
}

}  // namespace

Runner::Runner(ScheduleKind kind, std::vector<PipelineStage> stages, int n_microbatches,
               LossFn loss_fn)
    : kind_(kind), m_(n_microbatches), loss_fn_(std::move(loss_fn)) {
  const std::string name = to_string(kind);
  DTRAIN_CHECK_ARG(!stages.empty(), name, ": no stage given");
  std::sort(stages.begin(), stages.end(),
            [](const auto& a, const auto& b) { return a.stage_index() < b.stage_index(); });
  group_ = stages[0].group();
  rank_ = group_->rank();
  ranks_ = group_->size();
  const int v = static_cast<int>(stages.size());
  const int num_stages = stages[0].num_stages();
  for (size_t i = 0; i < stages.size(); ++i) {
    const auto& s = stages[i];
    DTRAIN_CHECK_ARG(s.group() == group_, name, ": stages ", stages[0].stage_index(), " and ",
                     s.stage_index(), " use different groups; a rank's stages share one");
    DTRAIN_CHECK_ARG(s.num_stages() == num_stages, name, ": stage ", stages[0].stage_index(),
                     " says num_stages ", num_stages, " but stage ", s.stage_index(), " says ",
                     s.num_stages());
    DTRAIN_CHECK_ARG(i == 0 || s.stage_index() != stages[i - 1].stage_index(), name, ": stage ",
                     s.stage_index(), " is given twice");
    DTRAIN_CHECK_ARG(kind != ScheduleKind::ZBV_ZERO_BUBBLE || !s.state().module.fsdp, name,
                     ": stage ", s.stage_index(), " is a FullyShardedDataParallel, whose backward "
                     "cannot be split into the input's and the weights' halves; use DDP or a "
                     "plain module for its stages, or another schedule");
  }
  const auto shape = check_shape(kind, ranks_, v, m_);
  DTRAIN_CHECK_ARG(shape.empty(), shape);
  DTRAIN_CHECK_ARG(v <= kMaxLocalStages, name, ": at most ", kMaxLocalStages,
                   " stages per rank, got ", v);
  DTRAIN_CHECK_ARG(num_stages == ranks_ * v, name, ": ", num_stages, " stages over group '",
                   group_->name(), "' of ", ranks_, " ranks with ", v,
                   " stage(s) on this rank; this schedule needs num_stages = ranks x stages per "
                   "rank, ", ranks_ * v);
  for (const auto& s : stages)
    DTRAIN_CHECK_ARG(rank_of(s.stage_index()) == rank_, name, ": stage ", s.stage_index(),
                     " belongs on rank ", rank_of(s.stage_index()), " of group '",
                     group_->name(), "' (", placement_text(kind_), ", p = ", ranks_,
                     "), but rank ", rank_, " holds it");
  // dtrain's own tags (core/internal_tags.h): a shape header per stage,
  // then one per stage, direction and microbatch.
  tag_base_ = group_->internal_tags_from();
  const int64_t top = int64_t{tag_base_} + num_stages + 2 * num_stages * m_ - 1;
  const int64_t most = int64_t{group_->max_tag()} - dtrain::detail::kTagsAtTheTop;
  DTRAIN_CHECK_ARG(top <= most, name, ": ", num_stages, " stages x ", m_,
                   " microbatches need point-to-point tags up to ", top, ", over the ",
                   most, " that group '", group_->name(), "' takes (backend ",
                   group_->backend_name(), "); use fewer microbatches or stages");
  stages_ = std::move(stages);
  order_ = order_of(kind, rank_, ranks_, v, m_);
  for (size_t i = 0; i < order_.size(); ++i)
    if (order_[i].kind == ActionKind::BACKWARD || order_[i].kind == ActionKind::WEIGHT_GRAD)
      last_backward_[order_[i].stage] = i;
}

StageState& Runner::stage(int index) {
  for (auto& s : stages_)
    if (s.stage_index() == index) return s.state();
  throw InternalError(cat("pipelining: stage ", index, " is not on this rank"));
}

bool Runner::holds(int index) const {
  return std::any_of(stages_.begin(), stages_.end(),
                     [&](const auto& s) { return s.stage_index() == index; });
}

int Runner::tag(int stage, bool backward, int mb) const {
  const int num_stages = stages_.front().num_stages();
  return tag_base_ + num_stages + (stage * 2 + (backward ? 1 : 0)) * m_ + mb;
}

int Runner::header_tag(int stage) const { return tag_base_ + stage; }

std::string Runner::where(int stage, int mb) const {
  return cat("pipeline stage ", stage, " (rank ", rank_, " of group '", group_->name(),
             "'), microbatch ", mb);
}

StepArgs Runner::one_argument(const at::Tensor& x, std::vector<at::Tensor>* losses, bool train,
                              const char* call) const {
  StepArgs a;
  (holds(0) ? a.input : a.target) = &x;
  a.losses = losses;
  a.train = train;
  a.call = call;
  return a;
}

// Which of input and target this rank's stages take.
void Runner::check_call(const StepArgs& a) const {
  const std::string name = cat(to_string(kind_), ".", a.call);
  const bool first = holds(0), last = holds(stages_[0].num_stages() - 1);
  auto mine = [&] {
    std::vector<int> s;
    for (const auto& st : stages_) s.push_back(st.stage_index());
    return cat("rank ", rank_, " holds stage(s) ", join(s), " of ", stages_[0].num_stages());
  };
  DTRAIN_CHECK_ARG(first == (a.input != nullptr), name, ": ", mine(),
                   first ? ", the first, which needs the input: call step(input, ...)"
                         : "; only the first stage's rank passes the input");
  DTRAIN_CHECK_ARG(last || a.target == nullptr, name, ": ", mine(),
                   "; only the last stage's rank passes the target (and losses)");
  DTRAIN_CHECK_ARG(!(last && a.train && loss_fn_) || a.target != nullptr, name, ": ", mine(),
                   ", the last, which needs the target for the loss: call step(target, &losses)");
  DTRAIN_CHECK_ARG(a.target == nullptr || loss_fn_, name,
                   ": a target was given but the schedule has no loss_fn");
  for (const auto* t : {a.input, a.target}) {
    if (t == nullptr) continue;
    DTRAIN_CHECK_ARG(t->defined() && t->dim() >= 1, name,
                     ": the input and target must be tensors of at least one dimension");
    DTRAIN_CHECK_ARG(t->size(0) % m_ == 0, name, ": dim 0 (", t->size(0),
                     ") of the ", t == a.input ? "input" : "target", " does not split into ", m_,
                     " equal microbatches");
  }
}

// The first step: every rank must run the same schedule over the same
// stages and microbatches, and every stage must be held once.
void Runner::check_schedules_agree() {
  constexpr int kFields = 4 + kMaxLocalStages;
  auto mine = at::full({kFields}, -1, at::kLong);
  auto* p = mine.data_ptr<int64_t>();
  p[0] = static_cast<int64_t>(kind_);
  p[1] = stages_[0].num_stages();
  p[2] = m_;
  p[3] = static_cast<int64_t>(stages_.size());
  for (size_t i = 0; i < stages_.size(); ++i) p[4 + i] = stages_[i].stage_index();
  auto all = at::empty({ranks_, kFields}, at::kLong);
  try {
    group_->all_gather_into_tensor(all, mine)->wait();
  } catch (const Error&) {
    rethrow_with(cat(to_string(kind_), ": the first step's check that every rank of group '",
                     group_->name(), "' runs the same schedule: "));
  }
  auto describe = [&](int r) {
    const auto* q = all[r].data_ptr<int64_t>();
    std::vector<int64_t> held(q + 4, q + 4 + std::clamp<int64_t>(q[3], 0, kMaxLocalStages));
    const auto k = static_cast<ScheduleKind>(
        std::clamp<int64_t>(q[0], 0, static_cast<int64_t>(ScheduleKind::ZBV_ZERO_BUBBLE)));
    return cat("rank ", r, ": ", to_string(k), ", stage(s) ", join(held), " of ", q[1], ", ",
               q[2], " microbatches");
  };
  bool same = true;
  for (int r = 1; r < ranks_; ++r) {
    const auto* a = all[0].data_ptr<int64_t>();
    const auto* b = all[r].data_ptr<int64_t>();
    same &= a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
  }
  if (!same) {
    std::vector<std::string> lines;
    for (int r = 0; r < ranks_; ++r) lines.push_back(describe(r));
    throw InvalidArgument(cat("pipelining: the ranks of group '", group_->name(),
                              "' run different schedules: ", join(lines, "; ")));
  }
}

// Receives posted ahead, per stage and direction: the one needed next and
// the one after it, so that a message lands while the stage computes. A
// step holds that many receive buffers per direction, not one for each
// microbatch, as PyTorch's schedules post each receive when its action
// runs (the one after it is the prefetch).
constexpr int kReceivesAhead = 2;

// Posts the next receives of this step whose shape is known, up to
// kReceivesAhead in flight per stage and direction, in microbatch order
// (the order every schedule consumes them in).
void Runner::post_receives(bool train) {
  for (auto& handle : stages_) {
    auto& st = handle.state();
    const int s = st.index;
    auto post = [&](std::map<Key, Pending>& into, const TensorShape& shape, int from, bool bwd,
                    const char* what) {
      int in_flight = 0;
      for (const auto& entry : into) in_flight += std::get<0>(entry.first) == s;
      for (int mb = 0; mb < m_ && in_flight < kReceivesAhead; ++mb) {
        if (!posted_.insert({s, bwd, mb}).second) continue;
        ++in_flight;
        Pending p;
        p.tensor =
            at::empty(shape.sizes, at::TensorOptions().dtype(shape.dtype).device(st.device));
        dtrain::detail::OpLabel label(cat(where(s, mb), ", ", what));
        dtrain::detail::InternalTraffic own;
        p.work = group_->recv(p.tensor, rank_of(from), tag(s, bwd, mb));
        into.emplace(Key{s, mb}, std::move(p));
      }
    };
    if (s > 0 && !holds(s - 1) && st.input.known)
      post(activations_, st.input, s - 1, false, "forward input");
    if (train && s + 1 < st.num_stages && !holds(s + 1) && st.output.known)
      post(grads_, st.output, s + 1, true, "gradient of the output");
  }
}

at::Tensor Runner::receive(std::map<Key, Pending>& from, int s, int mb, const char* what) {
  auto it = from.find({s, mb});
  DTRAIN_ENFORCE(it != from.end());  // posted in microbatch order, consumed so
  const auto begin = Clock::now();
  try {
    it->second.work->wait();
  } catch (const Error&) {
    rethrow_with(cat(where(s, mb), ": waiting for ", what, ": "));
  }
  wait_ms_ += ms_since(begin);
  auto t = std::move(it->second.tensor);
  from.erase(it);
  post_receives(train_);  // the next one in its place
  return t;
}

// A step's first forward of a stage fed by another rank: the shape of its
// microbatches comes ahead (each step, so that steps may differ in batch
// size, as an eval after training often does).
void Runner::learn_input_shape(int s) {
  auto& st = stage(s);
  // On the stage's device, as a device backend (nccl) takes only those.
  auto header =
      at::empty({2 + kShapeHeaderMaxDims}, at::TensorOptions().dtype(at::kLong).device(st.device));
  const auto begin = Clock::now();
  try {
    dtrain::detail::OpLabel label(cat(where(s, 0), ", shape of the forward input"));
    WorkPtr work;
    {
      dtrain::detail::InternalTraffic own;
      work = group_->recv(header, rank_of(s - 1), header_tag(s));
    }
    work->wait();
    header = header.cpu();
  } catch (const Error&) {
    rethrow_with(cat(where(s, 0), ": waiting for stage ", s - 1, "'s output (its shape): "));
  }
  wait_ms_ += ms_since(begin);
  const auto* h = header.data_ptr<int64_t>();
  DTRAIN_CHECK_ARG(h[1] >= 0 && h[1] <= kShapeHeaderMaxDims, where(s, 0), ": a shape header of ",
                   h[1], " dimensions");
  st.input.sizes.assign(h + 2, h + 2 + h[1]);
  st.input.dtype = static_cast<at::ScalarType>(h[0]);
  st.input.known = true;
}

void Runner::send(const at::Tensor& t, int to_stage, bool backward, int mb, const char* what) {
  dtrain::detail::OpLabel label(cat(where(to_stage, mb), ", ", what));
  dtrain::detail::InternalTraffic own;
  sends_.push_back(group_->send(t, rank_of(to_stage), tag(to_stage, backward, mb)));
}

void Runner::forward(int s, int mb, bool train) {
  auto& st = stage(s);
  at::Tensor x;
  if (s == 0) {
    x = inputs_[mb];
  } else if (holds(s - 1)) {
    x = local_activations_.at({s, mb});
    local_activations_.erase({s, mb});
  } else {
    if (!st.input.known) {
      learn_input_shape(s);
      post_receives(train);
    }
    x = receive(activations_, s, mb, cat("stage ", s - 1, "'s output").c_str());
  }
  if (train && s > 0) {
    DTRAIN_CHECK_ARG(x.is_floating_point(), where(s, mb), ": the stage's input is ",
                     x.scalar_type(), "; a stage after the first needs a floating input to "
                     "pass gradients back");
    x = x.detach().requires_grad_(true);
  }
  const bool last = s == st.num_stages - 1;
  const auto begin = Clock::now();
  at::Tensor out, loss;
  {
    torch::AutoGradMode grad(train);
    out = st.module.forward(x);
    DTRAIN_CHECK_ARG(out.defined(), where(s, mb), ": the stage's forward returned no tensor");
    if (last && !targets_.empty()) loss = loss_fn_(out, targets_[mb]);
  }
  compute_ms_ += ms_since(begin);
  draw("forward", s, mb, begin);
  auto& micro = micro_[{s, mb}];
  micro.input = x;
  micro.output = out;
  micro.loss = loss;
  ++held_;
  stats_.peak_microbatches = std::max(stats_.peak_microbatches, held_);
  if (last) {
    if (loss.defined()) losses_[mb] = loss.detach();
    outputs_[mb] = out.detach();
    return;
  }
  const auto sent = out.detach().contiguous();
  if (holds(s + 1)) {
    local_activations_[{s + 1, mb}] = sent;
    return;
  }
  if (!st.output.known) {
    auto header = at::zeros({2 + kShapeHeaderMaxDims}, at::kLong);
    auto* h = header.data_ptr<int64_t>();
    DTRAIN_CHECK_ARG(out.dim() <= kShapeHeaderMaxDims, where(s, mb), ": outputs of at most ",
                     kShapeHeaderMaxDims, " dimensions are sent, got ", out.dim());
    h[0] = static_cast<int64_t>(out.scalar_type());
    h[1] = out.dim();
    for (int64_t d = 0; d < out.dim(); ++d) h[2 + d] = out.size(d);
    st.output = TensorShape{true, out.sizes().vec(), out.scalar_type()};
    dtrain::detail::OpLabel label(cat(where(s + 1, mb), ", shape of the forward input"));
    dtrain::detail::InternalTraffic own;
    sends_.push_back(group_->send(header.to(out.device()), rank_of(s + 1), header_tag(s + 1)));
    post_receives(train);
  }
  DTRAIN_CHECK_ARG(out.sizes().vec() == st.output.sizes && out.scalar_type() == st.output.dtype,
                   where(s, mb), ": the stage's output is ",
                   shape_text(out.sizes().vec(), out.scalar_type()), " but microbatch 0's was ",
                   shape_text(st.output.sizes, st.output.dtype), ", which stage ", s + 1,
                   " was told to expect; the microbatches of a step must have one shape");
  send(sent, s + 1, false, mb, "forward input");
}

// The gradient of stage s's output for microbatch mb (undefined for the
// last stage, whose backward starts from its loss).
at::Tensor Runner::gradient_of_output(int s, int mb) {
  if (s == stage(s).num_stages - 1) return at::Tensor();
  if (holds(s + 1)) {
    auto g = local_grads_.at({s, mb});
    local_grads_.erase({s, mb});
    return g;
  }
  return receive(grads_, s, mb, cat("stage ", s + 1, "'s gradient").c_str());
}

// BACKWARD: the whole backward, the input's gradient sent back. The
// zero-bubble halves: INPUT_GRAD computes only the input's gradient
// (torch::autograd::grad, keeping the graph) and sends it; WEIGHT_GRAD
// then runs backward again to the stage's parameters alone. The two halves
// cost about two backwards of the stage's layers: what the weights' half
// saves is the wait, not the work.
void Runner::backward(int s, int mb, ActionKind kind) {
  auto& micro = micro_.at({s, mb});
  const bool last = s == stage(s).num_stages - 1;
  if (kind != ActionKind::WEIGHT_GRAD) micro.grad_out = gradient_of_output(s, mb);
  const auto& from = last ? micro.loss : micro.output;
  const std::vector<at::Tensor> seed =
      last ? std::vector<at::Tensor>{} : std::vector<at::Tensor>{micro.grad_out};
  const auto begin = Clock::now();
  at::Tensor input_grad;
  if (kind == ActionKind::BACKWARD) {
    torch::autograd::backward({from}, seed);
    if (s > 0) input_grad = micro.input.grad();
  } else if (kind == ActionKind::INPUT_GRAD) {
    if (s > 0)
      input_grad = torch::autograd::grad({from}, {micro.input}, seed, /*retain_graph=*/true,
                                         /*create_graph=*/false, /*allow_unused=*/true)[0];
  } else {
    std::vector<at::Tensor> params;
    for (const auto& p : parameters_of(stage(s).module))
      if (p.requires_grad()) params.push_back(p);
    if (!params.empty())
      torch::autograd::backward({from}, seed, /*retain_graph=*/false, /*create_graph=*/false,
                                params);
  }
  compute_ms_ += ms_since(begin);
  draw(kind == ActionKind::BACKWARD     ? "backward"
       : kind == ActionKind::INPUT_GRAD ? "backward (input)"
                                        : "backward (weights)",
       s, mb, begin);
  if (kind != ActionKind::WEIGHT_GRAD && s > 0) {
    // A stage that did not use its input sends zeros.
    if (!input_grad.defined()) input_grad = at::zeros_like(micro.input);
    if (holds(s - 1)) local_grads_[{s - 1, mb}] = input_grad;
    else send(input_grad.contiguous(), s - 1, true, mb, "gradient of the output");
  }
  if (kind != ActionKind::INPUT_GRAD) {
    micro_.erase({s, mb});
    --held_;
  }
}

at::Tensor Runner::run(const StepArgs& args) {
  check_call(args);
  if (!checked_) {
    check_schedules_agree();
    checked_ = true;
  }
  const bool train = args.train && static_cast<bool>(loss_fn_);
  train_ = train;
  const auto begin = Clock::now();
  inputs_ = args.input ? args.input->chunk(m_, 0) : std::vector<at::Tensor>();
  targets_ = args.target ? args.target->chunk(m_, 0) : std::vector<at::Tensor>();
  outputs_.assign(m_, at::Tensor());
  losses_.assign(m_, at::Tensor());
  compute_ms_ = wait_ms_ = 0;
  held_ = 0;
  stats_.peak_microbatches = 0;
  for (auto& st : stages_) st.state().input.known = st.state().output.known = false;
  if (train)
    for (auto& s : stages_)
      if (s.state().module.set_sync) s.state().module.set_sync(false);
  try {
    post_receives(train);
    for (size_t i = 0; i < order_.size(); ++i) {
      const auto& a = order_[i];
      if (a.kind == ActionKind::FORWARD) {
        forward(a.stage, a.microbatch, train);
      } else if (train) {
        auto& sync = stage(a.stage).module.sync_last_backward;
        if (sync && last_backward_.at(a.stage) == i) sync();
        backward(a.stage, a.microbatch, a.kind);
      }
    }
    const auto sent = Clock::now();
    for (auto& w : sends_) {
      try {
        w->wait();
      } catch (const Error&) {
        rethrow_with(cat("pipeline rank ", rank_, " of group '", group_->name(), "': ",
                         w->description(), ": "));
      }
    }
    wait_ms_ += ms_since(sent);
  } catch (...) {
    finish_step(train);
    throw;
  }
  finish_step(train);
  if (train)
    for (auto& s : stages_)
      for (auto& p : parameters_of(s.state().module))
        if (p.grad().defined()) p.grad().div_(m_);
  stats_.steps += 1;
  stats_.step_ms = ms_since(begin);
  stats_.compute_ms = compute_ms_;
  stats_.wait_ms = wait_ms_;
  stats_.idle_fraction = stats_.step_ms > 0 ? 1 - compute_ms_ / stats_.step_ms : 0;
  if (args.losses && args.target) *args.losses = losses_;
  const bool last = holds(stages_[0].num_stages() - 1);
  return last ? at::cat(outputs_, 0) : at::Tensor();
}

// Drops the step's state (also after a failure, so that the next step starts
// clean) and turns a wrapped module's synchronization back on.
void Runner::finish_step(bool train) {
  micro_.clear();
  posted_.clear();
  activations_.clear();
  grads_.clear();
  local_activations_.clear();
  local_grads_.clear();
  sends_.clear();
  inputs_.clear();
  targets_.clear();
  if (train)
    for (auto& s : stages_)
      if (s.state().module.set_sync) s.state().module.set_sync(true);
}

}  // namespace dtrain::pipelining::detail
