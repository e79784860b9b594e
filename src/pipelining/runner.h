#pragma once

// Runs one schedule's actions on this rank: forwards and backwards of its
// stages in the schedule's order, activations and gradients exchanged with
// the neighbouring stages' ranks by point-to-point operations. Every receive
// whose shape is known is posted ahead (so a sender never waits for its
// receiver, and the schedule's order alone decides who waits for whom);
// sends are waited for at the end of the step.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "dtrain/pipelining.h"
#include "pipelining/orders.h"
#include "pipelining/stage_state.h"

namespace dtrain::pipelining::detail {

// What one step is given and gives back.
struct StepArgs {
  const at::Tensor* input = nullptr;
  const at::Tensor* target = nullptr;
  std::vector<at::Tensor>* losses = nullptr;
  bool train = true;
  const char* call = "step";
};

class Runner {
 public:
  Runner(ScheduleKind kind, std::vector<PipelineStage> stages, int n_microbatches,
         LossFn loss_fn);
  at::Tensor run(const StepArgs& args);
  // step(x) / eval(x): x is the input on the rank holding the first stage,
  // else the target.
  StepArgs one_argument(const at::Tensor& x, std::vector<at::Tensor>* losses, bool train,
                        const char* call) const;
  int n_microbatches() const { return m_; }
  ScheduleStats stats() const { return stats_; }

 private:
  using Key = std::tuple<int, int>;  // (stage, microbatch)
  struct Pending {
    at::Tensor tensor;
    WorkPtr work;
  };
  // What a step keeps per microbatch of a local stage.
  struct Micro {
    at::Tensor input, output, loss;
    at::Tensor grad_out;  // between a split backward's two halves
  };

  StageState& stage(int index);
  bool holds(int index) const;
  int rank_of(int stage) const { return rank_of_stage(kind_, stage, ranks_); }
  int tag(int stage, bool backward, int mb) const;
  int header_tag(int stage) const;  // the shape of stage `stage`'s input
  std::string where(int stage, int mb) const;
  void check_call(const StepArgs& args) const;
  void check_schedules_agree();
  void post_receives(bool train);
  at::Tensor receive(std::map<Key, Pending>& from, int stage, int mb, const char* what);
  void learn_input_shape(int stage);
  void send(const at::Tensor& t, int to_stage, bool backward, int mb, const char* what);
  void forward(int s, int mb, bool train);
  // A whole backward (BACKWARD) or one of its halves.
  void backward(int s, int mb, ActionKind kind);
  at::Tensor gradient_of_output(int s, int mb);
  void finish_step(bool train);

  ScheduleKind kind_;
  std::vector<PipelineStage> stages_;  // by index
  int m_;
  LossFn loss_fn_;
  std::shared_ptr<ProcessGroup> group_;
  int rank_, ranks_;
  std::vector<Action> order_;
  // stage -> its last action in order_ that accumulates the parameters'
  // gradients (a backward, or the weights' half of one)
  std::map<int, size_t> last_backward_;
  bool checked_ = false;
  ScheduleStats stats_;

  // One step's state.
  std::vector<at::Tensor> inputs_, targets_;    // the microbatches
  std::map<Key, Micro> micro_;
  std::set<std::tuple<int, bool, int>> posted_;  // (stage, backward, mb) posted this step
  std::map<Key, Pending> activations_, grads_;  // receives in flight, by the receiving stage
  std::map<Key, at::Tensor> local_activations_, local_grads_;  // between stages of this rank
  std::vector<WorkPtr> sends_;
  std::vector<at::Tensor> outputs_, losses_;
  double compute_ms_ = 0, wait_ms_ = 0;
  int held_ = 0;
  bool train_ = false;  // this step runs backwards
  int tag_base_ = 0;     // the group's internal_tags_from(), asked once (mpi asks MPI)
};

}  // namespace dtrain::pipelining::detail
