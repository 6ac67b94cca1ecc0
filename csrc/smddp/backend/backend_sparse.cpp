// ProcessGroupSMDDP's all-reduce of sparse COO tensors (Note [Sparse all-reduce]).
#include "smddp/backend/op_helpers.h"

namespace smddp {

using namespace ops;  // NOLINT(build/namespaces): this file's own helpers

// Note [Sparse all-reduce]
// gloo sums sparse COO tensors (the gradients of nn.Embedding(sparse=True) under DDP), and
// so do we, with its semantics: SUM only; every rank's tensor has the same sizes, sparse and
// dense dimensions and dtype; the sum, coalesced, replaces the tensor's indices and values in
// place. It takes three all-gathers, numbered in the group's order like any collective:
//  1. a fixed-size header per rank (nnz, dimensions, dtype, sizes), which every rank checks
//     the same way, so a mismatch raises the same error on all of them instead of hanging;
//  2. the indices and 3. the values of every rank, each padded to the largest nnz, so that
//     the parts are equal (the padding costs at most world-1 times the largest part).
// Every rank then concatenates the parts in rank order and coalesces, which sums duplicate
// indices: the same computation on the same bytes everywhere, so all ranks hold the same
// result. The gathered indices are validated against the sizes before they are used.
namespace {

constexpr int64_t kMaxSparseDims = 64;

struct SparseHeader {
  int64_t nnz, sparse_dim, dense_dim, dtype, ndim;
  int64_t sizes[kMaxSparseDims];
};
static_assert(sizeof(SparseHeader) == 8 * (5 + kMaxSparseDims), "packed int64 fields");

std::string sizes_of(const SparseHeader& h) {
  std::string s = "[";
  for (int64_t d = 0; d < h.ndim; ++d) s += (d ? ", " : "") + std::to_string(h.sizes[d]);
  return s + "] (sparse_dim " + std::to_string(h.sparse_dim) + ", dense_dim " +
         std::to_string(h.dense_dim) + ", " + c10::toString(static_cast<at::ScalarType>(h.dtype)) +
         ")";
}

bool same_layout(const SparseHeader& a, const SparseHeader& b) {
  if (a.sparse_dim != b.sparse_dim || a.dense_dim != b.dense_dim || a.dtype != b.dtype ||
      a.ndim != b.ndim)
    return false;
  return std::equal(a.sizes, a.sizes + a.ndim, b.sizes);
}

// A header from rank `r` that can be read safely (its sizes are then compared).
void check_header(const SparseHeader& h, int r) {
  TORCH_CHECK_VALUE(h.nnz >= 0 && h.ndim >= 0 && h.ndim <= kMaxSparseDims && h.dtype >= 0 &&
                        h.dtype < static_cast<int64_t>(at::ScalarType::NumOptions),
                    "smddp: all_reduce of sparse tensors: rank ", r,
                    " sent a header that is not valid (nnz ", h.nnz, ", ", h.ndim,
                    " dimensions, dtype ", h.dtype, ")");
}

// Every rank's part padded to `max_nnz` rows along `dim` of `part`, all-gathered: the
// result's first dimension is the rank.
at::Tensor gather_padded(Communicator& comm, const at::Tensor& part, int64_t dim, int64_t max_nnz,
                         int size, const OpCtx& like) {
  std::vector<int64_t> shape = part.sizes().vec();
  const char* what = "the sparse all_reduce's gathered indices or values";
  size_t bytes = checked_mul(static_cast<size_t>(max_nnz), part.element_size(), what);
  for (int64_t d = 0; d < part.dim(); ++d) {
    if (d != dim) bytes = checked_mul(bytes, static_cast<size_t>(shape[d]), what);
  }
  checked_mul(bytes, static_cast<size_t>(size), what);  // the gathered tensor
  shape[dim] = max_nnz;
  at::Tensor mine = at::zeros(shape, part.options());
  mine.narrow(dim, 0, part.size(dim)).copy_(part);
  shape.insert(shape.begin(), size);
  at::Tensor all = at::empty(shape, part.options());
  if (bytes == 0) return all;
  OpCtx ctx = like;
  ctx.desc.count = bytes;
  comm.allgather(mine.data_ptr(), all.data_ptr(), bytes, ctx);
  return all;
}

}  // namespace

WorkPtr ProcessGroupSMDDP::allreduce_sparse(const at::Tensor& t,
                                            const c10d::AllreduceOptions& opts) {
  const char* name = "all_reduce";
  TORCH_CHECK_VALUE(t.device().is_cpu(), "smddp: ", name, " got a sparse tensor on device ",
                    t.device(), "; sparse tensors are summed on the CPU only: pass tensor.cpu()");
  TORCH_CHECK_VALUE(opts.reduceOp == c10d::ReduceOp::SUM, "smddp: ", name,
                    " of sparse tensors supports ReduceOp.SUM only (as gloo), got ",
                    redop_name(static_cast<RedOp>(static_cast<int>(opts.reduceOp.op_))));
  TORCH_CHECK_VALUE(t.dim() <= kMaxSparseDims, "smddp: ", name, " of a sparse tensor with ",
                    t.dim(), " dimensions; at most ", kMaxSparseDims, " are supported");
  const double timeout = timeout_of(opts.timeout);
  OpCtx header_ctx = live_comm().make_ctx("all_reduce (sparse)", CollDesc{},
                                          args_of(t, redop_name(RedOp::SUM)), timeout);
  header_ctx.desc.count = sizeof(SparseHeader);
  const int n = size_;
  return submit(OpType::ALLREDUCE, {t}, opts.asyncOp, [this, t, header_ctx, n] {
    at::Tensor in = t.coalesce();
    SparseHeader mine{};
    mine.nnz = in._nnz();
    mine.sparse_dim = in.sparse_dim();
    mine.dense_dim = in.dense_dim();
    mine.dtype = static_cast<int64_t>(in.scalar_type());
    mine.ndim = in.dim();
    for (int64_t d = 0; d < in.dim(); ++d) mine.sizes[d] = in.size(d);
    std::vector<SparseHeader> all(n);
    comm_->allgather(&mine, all.data(), sizeof(SparseHeader), header_ctx);
    int64_t max_nnz = 0;
    for (int r = 0; r < n; ++r) check_header(all[r], r);
    for (int r = 0; r < n; ++r) {
      TORCH_CHECK_VALUE(same_layout(all[r], all[0]), "smddp: all_reduce of sparse tensors: rank ",
                        r, "'s tensor has sizes ", sizes_of(all[r]), " but rank 0's has ",
                        sizes_of(all[0]),
                        "; every rank's tensor must have the same sizes, sparse and dense "
                        "dimensions and dtype");
      max_nnz = std::max(max_nnz, all[r].nnz);
    }
    at::Tensor indices = gather_padded(*comm_, in._indices(), 1, max_nnz, n, header_ctx);
    at::Tensor values = gather_padded(*comm_, in._values(), 0, max_nnz, n, header_ctx);
    std::vector<at::Tensor> index_parts, value_parts;
    for (int r = 0; r < n; ++r) {
      index_parts.push_back(indices[r].narrow(1, 0, all[r].nnz));
      value_parts.push_back(values[r].narrow(0, 0, all[r].nnz));
    }
    at::Tensor sum_indices = at::cat(index_parts, 1), sum_values = at::cat(value_parts, 0);
    at::_validate_sparse_coo_tensor_args(sum_indices, sum_values, in.sizes());
    at::Tensor sum =
        at::_sparse_coo_tensor_unsafe(sum_indices, sum_values, in.sizes(), in.options()).coalesce();
    at::Tensor out = t;  // the caller's tensor, which gloo's result replaces in place too
    out.copy_(sum);
  });
}

}  // namespace smddp
