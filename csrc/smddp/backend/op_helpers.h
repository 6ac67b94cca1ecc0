// Helpers of the ProcessGroupSMDDP operations (backend_ops.cpp, backend_movement.cpp,
// backend_p2p.cpp, backend_sparse.cpp): staging of non-contiguous tensors, argument checks, and the
// descriptors that name an operation in errors and mismatch reports.
#pragma once

#include <ATen/MemoryOverlap.h>

#include <cstring>

#include "smddp/backend/backend.h"

namespace smddp {
namespace ops {

using c10d::OpType;
using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

inline at::Tensor contiguous_out(const at::Tensor& t) {
  return t.is_contiguous() ? t : at::empty(t.sizes(), t.options());
}

// Note [Outputs that share memory]
// An output whose elements share memory (an expand()ed tensor: stride 0 over a dimension
// of size > 1) cannot take Tensor::copy_, which refuses such a destination with a message
// that names neither smddp nor the rule. gloo writes every element through, so the last
// write to a location wins; copying only the last index along each stride-0 dimension
// gives the same values. (Tensor::copy_ reports overlap only for stride 0, so that is the
// only layout that needs this.) distinct_parts (device_staging.h) does the narrowing; the
// staging copies out use it too, so a staged call writes such an output as this path does.
inline void copy_back(const at::Tensor& staged, const at::Tensor& t) {
  if (staged.is_same(t)) return;
  auto parts = distinct_parts(t, staged);
  parts.first.copy_(parts.second);
}

// Turns `flag` (ProcessGroupSMDDP::coalescing_) off for a scope and restores it on exit,
// also when a part raises: the parts of a *_coalesced call are ordinary works.
class NotCoalescing {
 public:
  explicit NotCoalescing(bool& flag) : flag_(flag), was_(flag) { flag_ = false; }
  ~NotCoalescing() { flag_ = was_; }
  NotCoalescing(const NotCoalescing&) = delete;
  NotCoalescing& operator=(const NotCoalescing&) = delete;

 private:
  bool& flag_;
  bool was_;
};

// Note [Overlapping operands]
// An input that shares memory with the output is read while the output is written: by this
// rank (its own part is copied into place first), and in place by its peers when it is a
// pool tensor (Note [Zero-copy operands] in shm_algos.h), so where they overlap the peers
// read what was already overwritten. Overlap exactly at this rank's own part is the usual
// in-place form (FSDP2's all-gather input is its slot of the output; a reduce-scatter
// output may be its block of the input) and is safe: nobody else reads or writes there.
// Any other overlap gets a private copy of the input, as gloo's copies make it behave. An
// all-to-all has no such safe overlap (its own part moves first, over input not yet sent),
// so any overlap there gets the copy.

// Whether the bytes of `a` and `b` overlap.
inline bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* p = static_cast<const char*>(a.data_ptr());
  const auto* q = static_cast<const char*>(b.data_ptr());
  const size_t ab = a.numel() * a.element_size(), bb = b.numel() * b.element_size();
  return ab && bb && p < q + bb && q < p + ab;
}

// `in`, or a copy of it when it overlaps `out` anywhere but exactly at `own` bytes into
// the larger of the two (`in_is_part`: the input is the part, an all-gather).
inline at::Tensor apart_from(const at::Tensor& in, const at::Tensor& out, size_t own,
                             bool in_is_part) {
  if (!overlaps(in, out)) return in;
  const auto* i = static_cast<const char*>(in.data_ptr());
  const auto* o = static_cast<const char*>(out.data_ptr());
  if (in_is_part ? i == o + own : o == i + own) return in;
  return in.clone();
}

// In-place all-reduce of one tensor, staged through a contiguous copy if it is not one.
inline void allreduce_tensor(Communicator& comm, const at::Tensor& t, const Reduction& red,
                             const OpCtx& ctx) {
  at::Tensor c = t.contiguous();
  comm.allreduce(c.data_ptr(), c.numel(), red, ctx);
  copy_back(c, t);
}

inline OpArgs args_of(const at::Tensor& t, const char* op = nullptr) {
  OpArgs a;
  a.dtype = c10::toString(t.scalar_type());
  a.op = op;
  a.numel = t.numel();
  return a;
}

// The root of a rooted collective as an int, once its int64 value (c10d's rootRank) is known
// to be a rank of the group: narrowed first, a root of 2^32 + 1 became rank 1.
inline int checked_root(int64_t root, int size, const char* name) {
  TORCH_CHECK_VALUE(root >= 0 && root < size, "smddp: ", name, " root ", root,
                    " is not a rank of this group of ", size, " ranks (valid: 0..", size - 1,
                    "); pass the root's rank in this group");
  return static_cast<int>(root);
}

inline OpArgs rooted(OpArgs a, int root) {
  a.root = root;
  return a;
}

inline OpArgs peer_args_of(const at::Tensor& t, int peer, bool to_peer) {
  OpArgs a = args_of(t);
  a.peer = peer;
  a.to_peer = to_peer;
  return a;
}

inline CollDesc desc_of(const at::Tensor& t, int op, uint64_t count, uint64_t extra = 0) {
  CollDesc d;
  d.dtype_op = (static_cast<uint32_t>(t.scalar_type()) << 8) | static_cast<uint32_t>(op);
  d.count = count;
  d.extra = extra;
  return d;
}

inline void check_count(const std::vector<at::Tensor>& ts, const char* name) {
  TORCH_CHECK_VALUE(ts.size() == 1, "smddp: ", name, " expects exactly one tensor per call, got ",
                    ts.size());
}

inline void check_single(const std::vector<at::Tensor>& ts, const char* name) {
  check_count(ts, name);
  check_cpu(ts[0], name, "its tensor");
}

// The addresses of the tensors of one call, for ProcessGroupSMDDP::stage.
inline std::vector<const at::Tensor*> all_of(
    std::initializer_list<const std::vector<at::Tensor>*> lists) {
  std::vector<const at::Tensor*> out;
  for (const auto* l : lists) {
    for (const auto& t : *l) out.push_back(&t);
  }
  return out;
}

inline std::vector<const at::Tensor*> all_of(const std::vector<std::vector<at::Tensor>>& lists,
                                             const std::vector<at::Tensor>& more) {
  std::vector<const at::Tensor*> out;
  for (const auto& l : lists) {
    for (const auto& t : l) out.push_back(&t);
  }
  for (const auto& t : more) out.push_back(&t);
  return out;
}

inline std::vector<std::vector<at::Tensor>> mirror_lists(
    StagedOp& op, const std::vector<std::vector<at::Tensor>>& ls, bool in, bool out) {
  std::vector<std::vector<at::Tensor>> hs;
  for (const auto& l : ls) hs.push_back(op.mirror(l, in, out));
  return hs;
}

inline void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* name) {
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "smddp: ", name,
                   ": input and output dtypes differ (", a.scalar_type(), " vs ", b.scalar_type(),
                   ")");
}

// The root's list of a gather's outputs (`outputs`) or a scatter's inputs: world_size
// tensors of `like`'s dtype and size, checked on the root and returned; none elsewhere.
inline std::vector<at::Tensor> root_list(const std::vector<std::vector<at::Tensor>>& lists,
                                         const at::Tensor& like, bool is_root, int size,
                                         const char* name, bool outputs) {
  const char* what = outputs ? "outputs" : "inputs";
  if (!is_root) {
    TORCH_CHECK_VALUE(lists.empty() || lists[0].empty(), "smddp: ", name, " takes ", what,
                      " only on the root rank");
    return {};
  }
  TORCH_CHECK_VALUE(lists.size() == 1 && static_cast<int>(lists[0].size()) == size, "smddp: ", name,
                    " needs a list of world_size (", size, ") ", what, " on the root");
  for (const auto& t : lists[0]) {
    check_cpu(t, name, outputs ? "an output" : "an input");
    check_same_dtype(outputs ? like : t, outputs ? t : like, name);
    TORCH_CHECK_VALUE(t.numel() == like.numel(), "smddp: ", name, ": ", what, " must have ",
                      like.numel(), " elements like the ", outputs ? "input" : "output", ", got ",
                      t.numel());
  }
  return lists[0];
}

// Note [Complex reductions]: a complex tensor is reduced as its real view (as
// torch.distributed's all_reduce does in Python before it reaches any backend), for the
// ops whose meaning is the same on the real and imaginary parts: SUM, AVG and PREMUL_SUM
// with a real factor. torch passes complex tensors of reduce, reduce_scatter and the
// functional collectives to the backend as they are, and gloo reduces them; so every
// reducing entry point takes the view itself. Other ops raise, naming the three.
inline bool any_complex(const std::vector<at::Tensor>& ts) {
  for (const auto& t : ts) {
    if (t.is_complex()) return true;
  }
  return false;
}

inline std::vector<at::Tensor> real_views(const std::vector<at::Tensor>& ts,
                                          const c10d::ReduceOp& op, const char* name) {
  TORCH_CHECK_VALUE(
      op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::AVG || op == c10d::ReduceOp::PREMUL_SUM,
      "smddp: ", name,
      " does not support this ReduceOp on complex tensors; use SUM, AVG or "
      "PREMUL_SUM");
  if (op == c10d::ReduceOp::PREMUL_SUM) {
    auto* sup = dynamic_cast<compat::PreMulSumSupplement*>(op.supplement_.get());
    TORCH_CHECK_VALUE(!sup || !sup->tensor_factor.defined() || !sup->tensor_factor.is_complex(),
                      "smddp: ", name, " takes a real PREMUL_SUM factor on complex tensors, got ",
                      sup->tensor_factor.item(), "; scale the tensor by it first and use SUM");
  }
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.is_complex() ? at::view_as_real(t) : t);
  return out;
}

// The work of a call made on real views, reported with the caller's complex tensors as its
// outputs (as gloo reports them); none for a call that completed synchronously.
inline WorkPtr complex_result(WorkPtr real, std::vector<at::Tensor> outputs) {
  if (!real) return real;
  return c10::make_intrusive<ResultAsWork>(std::move(real), std::move(outputs));
}

inline at::Tensor flat_cat(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> flat;
  for (const auto& t : ts) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

}  // namespace ops
}  // namespace smddp
