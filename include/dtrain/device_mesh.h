#pragma once

// torch.distributed.device_mesh for libtorch: the ranks laid out as an
// n-dimensional array (row-major: rank = sum of coordinate x stride), with
// a process group along each dimension, built once.
//
//   auto mesh = dtrain::init_device_mesh({2, 2}, {"pp", "dp"});   // 4 ranks
//   auto dp = mesh.get_group("dp");          // the ranks that differ only in "dp"
//   int stage = mesh.get_local_rank("pp");   // this rank's coordinate along "pp"
//   auto sub = mesh["dp"];                   // a 1-D mesh (its groups are shared)
//   auto both = mesh.flatten("pp_dp");       // one dimension over all ranks (a new group)
//
// Building a mesh (and flatten) is collective: every rank of the mesh's
// group calls it with the same arguments, in the same order as its other
// group creations.

#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "dtrain/arg.h"
#include "dtrain/distributed.h"
#include "dtrain/process_group.h"

namespace dtrain {

struct DeviceMeshOptions {
  // The ranks the mesh lays out: this group's, in its order; null: the
  // default group.
  DTRAIN_ARG(std::shared_ptr<ProcessGroup>, group) = nullptr;
  // Options of the groups it creates through new_group (backend, timeout).
  DTRAIN_ARG(NewGroupOptions, group_options) = NewGroupOptions();
  // How a group of the mesh is built from its global ranks, called only on
  // the ranks it holds; for groups of your own making (tests, custom
  // launchers). Unset: dtrain::new_group, which every rank of the default
  // group calls for every group of the mesh, so `group` must then be the
  // default group.
  DTRAIN_ARG(std::function<std::shared_ptr<ProcessGroup>(const std::vector<int>& ranks)>,
             new_group) = nullptr;
};

namespace detail {
struct MeshState;
// One dimension of a (sub-)mesh: the whole mesh's dimensions it spans (one,
// or several once flattened) and its group.
struct MeshDim {
  std::string name;
  std::vector<int> root_dims;
  std::shared_ptr<ProcessGroup> group;
};
}  // namespace detail

class DeviceMesh {
 public:
  // The whole mesh: `mesh_shape`'s product must be the group's size;
  // `mesh_dim_names` empty (dimensions are then "dim0", "dim1", ...) or one
  // distinct name per dimension.
  DeviceMesh(const std::vector<int>& mesh_shape, const std::vector<std::string>& mesh_dim_names,
             const DeviceMeshOptions& options = DeviceMeshOptions());

  // The sub-mesh of one or several dimensions (in the order given),
  // sharing this mesh's groups; a name made by flatten() works too.
  DeviceMesh operator[](const std::string& name) const;
  DeviceMesh operator[](const std::vector<std::string>& names) const;
  // mesh[{"dp", "pp"}] (without it, the braces could also make one string).
  DeviceMesh operator[](std::initializer_list<std::string> names) const {
    return (*this)[std::vector<std::string>(names)];
  }
  // This mesh's dimensions as one (named `name`, by default the names
  // joined by "_"), with a group over the ranks that differ only in them.
  // Collective on every rank of the whole mesh; the name then also works
  // with the whole mesh's operator[].
  DeviceMesh flatten(const std::string& name = "") const;

  std::shared_ptr<ProcessGroup> get_group(const std::string& name) const;
  std::shared_ptr<ProcessGroup> get_group(int dim) const;
  // A 1-D mesh's one group.
  std::shared_ptr<ProcessGroup> get_group() const;
  std::vector<std::shared_ptr<ProcessGroup>> get_all_groups() const;
  // This rank's coordinate along a dimension.
  int get_local_rank(const std::string& name) const;
  int get_local_rank(int dim) const;
  // This rank's coordinate along each dimension.
  std::vector<int> get_coordinate() const;
  int size(const std::string& name) const;
  int size(int dim) const;
  int size() const;  // ranks in this mesh
  int ndim() const { return static_cast<int>(dims_.size()); }
  std::vector<int> shape() const;
  std::vector<std::string> mesh_dim_names() const;
  // The ranks of this (sub-)mesh that holds this rank, row-major.
  std::vector<int> ranks() const;
  // This rank in the mesh's group (the whole mesh's ranks).
  int get_rank() const;

 private:
  DeviceMesh(std::shared_ptr<detail::MeshState> root, std::vector<detail::MeshDim> dims);
  const detail::MeshDim& dim(const std::string& name) const;
  const detail::MeshDim& dim(int index) const;

  std::shared_ptr<detail::MeshState> root_;
  std::vector<detail::MeshDim> dims_;
};

// torch.distributed.init_device_mesh: a mesh over the default group (or
// options.group()).
DeviceMesh init_device_mesh(const std::vector<int>& mesh_shape,
                            const std::vector<std::string>& mesh_dim_names = {},
                            const DeviceMeshOptions& options = DeviceMeshOptions());

}  // namespace dtrain
