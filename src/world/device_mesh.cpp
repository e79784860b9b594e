// DeviceMesh: groups along the dimensions of a row-major array of ranks.

#include "dtrain/device_mesh.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <numeric>
#include <set>

#include "common/enforce.h"

namespace dtrain {
namespace detail {

struct MeshState {
  std::vector<int> shape;
  std::vector<int> strides;     // row-major
  std::vector<int> coordinate;  // this rank's
  std::shared_ptr<ProcessGroup> group;
  DeviceMeshOptions options;
  std::vector<MeshDim> dims;  // one per dimension
  std::mutex mutex;
  std::map<std::string, MeshDim> flattened;

  int rank_at(const std::vector<int>& coordinate) const {
    int r = 0;
    for (size_t d = 0; d < shape.size(); ++d) r += coordinate[d] * strides[d];
    return r;
  }

  // The group along `spanned` (dimensions of the whole mesh, increasing):
  // one per combination of the other dimensions' coordinates, each over the
  // ranks that differ only in `spanned`, built in that order on every rank.
  std::shared_ptr<ProcessGroup> build(const std::vector<int>& spanned) const {
    std::vector<int> others;
    for (int d = 0; d < static_cast<int>(shape.size()); ++d)
      if (std::find(spanned.begin(), spanned.end(), d) == spanned.end()) others.push_back(d);
    auto count = [&](const std::vector<int>& dims) {
      int n = 1;
      for (int d : dims) n *= shape[d];
      return n;
    };
    // Sets `c`'s coordinates along `dims` to the row-major index `i`.
    auto place = [&](std::vector<int>& c, const std::vector<int>& dims, int i) {
      for (auto d = dims.rbegin(); d != dims.rend(); ++d) {
        c[*d] = i % shape[*d];
        i /= shape[*d];
      }
    };
    std::shared_ptr<ProcessGroup> mine;
    for (int o = 0; o < count(others); ++o) {
      std::vector<int> c(shape.size(), 0);
      place(c, others, o);
      bool holds_me = true;
      for (int d : others) holds_me &= c[d] == coordinate[d];
      std::vector<int> line;
      for (int i = 0; i < count(spanned); ++i) {
        place(c, spanned, i);
        line.push_back(group->global_ranks()[rank_at(c)]);
      }
      if (options.new_group()) {
        if (holds_me) mine = options.new_group()(line);
      } else {
        auto g = new_group(line, options.group_options());
        if (holds_me) mine = g;
      }
    }
    DTRAIN_CHECK_ARG(mine && mine->rank() >= 0,
                     "DeviceMesh: the group made for this rank does not hold it");
    return mine;
  }
};

}  // namespace detail

DeviceMesh::DeviceMesh(const std::vector<int>& mesh_shape,
                       const std::vector<std::string>& mesh_dim_names,
                       const DeviceMeshOptions& options)
    : root_(std::make_shared<detail::MeshState>()) {
  auto& st = *root_;
  st.options = options;
  st.group = options.group() ? options.group() : default_group();
  DTRAIN_CHECK_ARG(options.new_group() || !options.group() ||
                       (is_initialized() && st.group == default_group()),
                   "DeviceMesh: a mesh over group '", st.group->name(),
                   "' (not the default group) needs DeviceMeshOptions::new_group; new_group "
                   "is called by every rank of the default group");
  DTRAIN_CHECK_ARG(st.group->rank() >= 0, "DeviceMesh: this rank is not a member of group '",
                   st.group->name(), "'");
  DTRAIN_CHECK_ARG(!mesh_shape.empty(), "DeviceMesh: mesh_shape is empty");
  int total = 1;
  for (int n : mesh_shape) {
    DTRAIN_CHECK_ARG(n >= 1, "DeviceMesh: mesh_shape [", detail::join(mesh_shape),
                     "] has a dimension below 1");
    total *= n;
  }
  DTRAIN_CHECK_ARG(total == st.group->size(), "DeviceMesh: mesh_shape [",
                   detail::join(mesh_shape), "] holds ", total, " ranks but group '",
                   st.group->name(), "' has ", st.group->size());
  std::vector<std::string> names = mesh_dim_names;
  if (names.empty())
    for (size_t d = 0; d < mesh_shape.size(); ++d) names.push_back("dim" + std::to_string(d));
  DTRAIN_CHECK_ARG(names.size() == mesh_shape.size(), "DeviceMesh: ", names.size(),
                   " mesh_dim_names for ", mesh_shape.size(), " dimensions");
  DTRAIN_CHECK_ARG(std::set<std::string>(names.begin(), names.end()).size() == names.size(),
                   "DeviceMesh: mesh_dim_names [", detail::join(names), "] repeat a name");
  st.shape = mesh_shape;
  st.strides.assign(mesh_shape.size(), 1);
  for (int d = static_cast<int>(mesh_shape.size()) - 2; d >= 0; --d)
    st.strides[d] = st.strides[d + 1] * mesh_shape[d + 1];
  int r = st.group->rank();
  for (size_t d = 0; d < mesh_shape.size(); ++d) {
    st.coordinate.push_back(r / st.strides[d]);
    r %= st.strides[d];
  }
  for (int d = 0; d < static_cast<int>(mesh_shape.size()); ++d)
    st.dims.push_back(detail::MeshDim{names[d], {d}, st.build({d})});
  dims_ = st.dims;
}

DeviceMesh::DeviceMesh(std::shared_ptr<detail::MeshState> root,
                       std::vector<detail::MeshDim> dims)
    : root_(std::move(root)), dims_(std::move(dims)) {}

const detail::MeshDim& DeviceMesh::dim(const std::string& name) const {
  for (const auto& d : dims_)
    if (d.name == name) return d;
  {
    std::lock_guard<std::mutex> lock(root_->mutex);
    auto it = root_->flattened.find(name);
    if (it != root_->flattened.end() && dims_.size() == root_->dims.size() &&
        dims_[0].name == root_->dims[0].name)
      return it->second;
  }
  std::vector<std::string> names = mesh_dim_names();
  throw InvalidArgument(detail::cat("DeviceMesh: no dimension '", name, "' in the mesh of [",
                                    detail::join(names), "]"));
}

const detail::MeshDim& DeviceMesh::dim(int index) const {
  DTRAIN_CHECK_ARG(index >= 0 && index < ndim(), "DeviceMesh: dimension ", index,
                   " is out of range for a mesh of ", ndim());
  return dims_[index];
}

DeviceMesh DeviceMesh::operator[](const std::string& name) const {
  return (*this)[std::vector<std::string>{name}];
}

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& names) const {
  DTRAIN_CHECK_ARG(!names.empty(), "DeviceMesh: no dimension named to slice");
  std::vector<detail::MeshDim> picked;
  std::set<int> seen;
  for (const auto& n : names) {
    picked.push_back(dim(n));
    for (int d : picked.back().root_dims)
      DTRAIN_CHECK_ARG(seen.insert(d).second, "DeviceMesh: the slice [", detail::join(names),
                       "] names a dimension twice");
  }
  return DeviceMesh(root_, std::move(picked));
}

DeviceMesh DeviceMesh::flatten(const std::string& name) const {
  std::vector<int> spanned;
  std::vector<std::string> names;
  for (const auto& d : dims_) {
    spanned.insert(spanned.end(), d.root_dims.begin(), d.root_dims.end());
    names.push_back(d.name);
  }
  std::sort(spanned.begin(), spanned.end());
  const auto flat_name = name.empty() ? detail::join(names, "_") : name;
  for (const auto& d : root_->dims)
    DTRAIN_CHECK_ARG(d.name != flat_name, "DeviceMesh: flatten's name '", flat_name,
                     "' is already a dimension of the mesh");
  std::lock_guard<std::mutex> lock(root_->mutex);
  auto it = root_->flattened.find(flat_name);
  if (it != root_->flattened.end()) {
    DTRAIN_CHECK_ARG(it->second.root_dims == spanned, "DeviceMesh: the name '", flat_name,
                     "' was given to another flattening");
    return DeviceMesh(root_, {it->second});
  }
  detail::MeshDim flat{flat_name, spanned,
                       spanned.size() == 1 ? root_->dims[spanned[0]].group : root_->build(spanned)};
  root_->flattened.emplace(flat_name, flat);
  return DeviceMesh(root_, {flat});
}

std::shared_ptr<ProcessGroup> DeviceMesh::get_group(const std::string& name) const {
  return dim(name).group;
}
std::shared_ptr<ProcessGroup> DeviceMesh::get_group(int index) const { return dim(index).group; }
std::shared_ptr<ProcessGroup> DeviceMesh::get_group() const {
  DTRAIN_CHECK_ARG(ndim() == 1, "DeviceMesh: get_group() without a dimension is for a 1-D mesh; "
                                "this one has ", ndim(), " dimensions [",
                   detail::join(mesh_dim_names()), "]");
  return dims_[0].group;
}
std::vector<std::shared_ptr<ProcessGroup>> DeviceMesh::get_all_groups() const {
  std::vector<std::shared_ptr<ProcessGroup>> out;
  for (const auto& d : dims_) out.push_back(d.group);
  return out;
}

int DeviceMesh::get_local_rank(const std::string& name) const { return dim(name).group->rank(); }
int DeviceMesh::get_local_rank(int index) const { return dim(index).group->rank(); }
std::vector<int> DeviceMesh::get_coordinate() const {
  std::vector<int> out;
  for (const auto& d : dims_) out.push_back(d.group->rank());
  return out;
}
int DeviceMesh::size(const std::string& name) const { return dim(name).group->size(); }
int DeviceMesh::size(int index) const { return dim(index).group->size(); }
int DeviceMesh::size() const {
  int n = 1;
  for (const auto& d : dims_) n *= d.group->size();
  return n;
}
std::vector<int> DeviceMesh::shape() const {
  std::vector<int> out;
  for (const auto& d : dims_) out.push_back(d.group->size());
  return out;
}
std::vector<std::string> DeviceMesh::mesh_dim_names() const {
  std::vector<std::string> out;
  for (const auto& d : dims_) out.push_back(d.name);
  return out;
}
int DeviceMesh::get_rank() const { return root_->group->rank(); }

// The sub-mesh's ranks: every combination of its dimensions' coordinates,
// row-major in its own order, the other coordinates this rank's.
std::vector<int> DeviceMesh::ranks() const {
  std::vector<int> out;
  const int n = size();
  for (int i = 0; i < n; ++i) {
    auto c = root_->coordinate;
    int rest = i;
    for (auto d = dims_.rbegin(); d != dims_.rend(); ++d) {
      int local = rest % d->group->size();
      rest /= d->group->size();
      for (auto rd = d->root_dims.rbegin(); rd != d->root_dims.rend(); ++rd) {
        c[*rd] = local % root_->shape[*rd];
        local /= root_->shape[*rd];
      }
    }
    out.push_back(root_->group->global_ranks()[root_->rank_at(c)]);
  }
  return out;
}

DeviceMesh init_device_mesh(const std::vector<int>& mesh_shape,
                            const std::vector<std::string>& mesh_dim_names,
                            const DeviceMeshOptions& options) {
  return DeviceMesh(mesh_shape, mesh_dim_names, options);
}

}  // namespace dtrain
