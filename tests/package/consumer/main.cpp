#include <dtrain/dtrain.h>

#include <ATen/ATen.h>

#include <unistd.h>

#include <iostream>
#include <string>

int main() {
  dtrain::init_process_group(dtrain::InitOptions()
                                 .store(std::make_shared<dtrain::HashStore>())
                                 .rank(0)
                                 .world_size(1));
  auto t = at::full({3}, 2.0);
  dtrain::all_reduce(t, dtrain::AllReduceOptions().op(dtrain::ReduceOp::AVG));
  // A tensor file round trip through the installed library.
  const std::string path = "/tmp/dtrain-consumer-" + std::to_string(getpid()) + ".dtt";
  dtrain::checkpoint::TensorFile file;
  file.tensors["t"] = t;
  dtrain::checkpoint::save_tensor_file(path, file);
  const auto back = dtrain::checkpoint::load_tensor_file(path).tensors.at("t");
  ::unlink(path.c_str());
  std::cout << "consumer ok: world " << dtrain::get_world_size() << " value " << t[0].item<double>()
            << " file " << back[0].item<double>() << std::endl;
  dtrain::destroy_process_group();
  return t.eq(2.0).all().item<bool>() && at::equal(back, t) ? 0 : 1;
}
