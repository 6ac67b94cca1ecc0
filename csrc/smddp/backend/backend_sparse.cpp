// ProcessGroupSMDDP's all-reduce of sparse COO tensors (Note [Sparse all-reduce]).
#include "smddp/backend/op_helpers.h"

namespace smddp {

using namespace ops;  // NOLINT(build/namespaces): this file's own helpers

// Note [Sparse all-reduce]
// gloo sums sparse COO tensors (the gradients of nn.Embedding(sparse=True) under DDP), and
// so do we, with its semantics: SUM only; every rank's tensor has the same sizes, sparse and
// dense dimensions and dtype; the sum, coalesced, replaces the tensor's indices and values in
// place. It takes three collectives, numbered in the group's order like any other:
//  1. an all-gather of a fixed-size header per rank (nnz, dimensions, dtype, sizes), which
//     every rank checks the same way, so a mismatch raises the same error on all of them
//     instead of hanging;
//  2. the indices and 3. the values of every rank, as all-to-alls in which each rank sends
//     its part to every peer (an all-gather of unequal parts: no padding, and the parts land
//     concatenated in rank order).
// Every rank then coalesces the concatenation, which sums duplicate indices: the same
// computation on the same bytes everywhere, so all ranks hold the same result. The gathered
// indices are validated against the sizes before they are used. Errors name global ranks.
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

// Every rank's rows of `rows` (a contiguous tensor whose first dimension is its nnz),
// concatenated in rank order; `nnz[r]`: rank r's row count. An all-to-all in which each rank
// sends the same bytes to every peer and receives each peer's at its offset: an all-gather
// of unequal parts, with no padding and no concatenation afterwards.
at::Tensor gather_rows(Communicator& comm, const at::Tensor& rows, const std::vector<int64_t>& nnz,
                       int me, const OpCtx& like) {
  const char* what = "the sparse all_reduce's gathered indices or values";
  size_t row_bytes = rows.element_size();
  for (int64_t d = 1; d < rows.dim(); ++d) {
    row_bytes = checked_mul(row_bytes, static_cast<size_t>(rows.size(d)), what);
  }
  std::vector<Span> send(nnz.size()), recv(nnz.size());
  size_t total_rows = 0, off = 0;
  for (size_t r = 0; r < nnz.size(); ++r) {
    const size_t len = checked_mul(static_cast<size_t>(nnz[r]), row_bytes, what);
    send[r] = {0, checked_mul(static_cast<size_t>(nnz[me]), row_bytes, what)};
    recv[r] = {off, len};
    off = checked_add(off, len, what);
    total_rows = checked_add(total_rows, static_cast<size_t>(nnz[r]), what);
  }
  TORCH_CHECK_VALUE(total_rows <= static_cast<size_t>(INT64_MAX), "smddp: ", what, " has ",
                    total_rows, " rows");
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] = static_cast<int64_t>(total_rows);
  at::Tensor all = at::empty(shape, rows.options());
  if (off == 0) return all;
  OpCtx ctx = like;
  ctx.desc.count = off;
  comm.alltoall(rows.data_ptr(), send, all.data_ptr(), recv, ctx);
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
    const std::vector<int>& global = comm_->config().global_ranks;
    for (int r = 0; r < n; ++r) check_header(all[r], global[r]);
    std::vector<int64_t> nnz(n);
    for (int r = 0; r < n; ++r) {
      TORCH_CHECK_VALUE(same_layout(all[r], all[0]), "smddp: all_reduce of sparse tensors: rank ",
                        global[r], "'s tensor has sizes ", sizes_of(all[r]), " but rank ",
                        global[0], "'s has ", sizes_of(all[0]),
                        "; every rank's tensor must have the same sizes, sparse and dense "
                        "dimensions and dtype");
      nnz[r] = all[r].nnz;
    }
    // Indices travel as rows ([nnz, sparse_dim]) and come back transposed, as a view.
    at::Tensor sum_indices =
        gather_rows(*comm_, in._indices().t().contiguous(), nnz, rank_, header_ctx).t();
    at::Tensor sum_values = gather_rows(*comm_, in._values().contiguous(), nnz, rank_, header_ctx);
    at::_validate_sparse_coo_tensor_args(sum_indices, sum_values, in.sizes());
    at::Tensor sum =
        at::_sparse_coo_tensor_unsafe(sum_indices, sum_values, in.sizes(), in.options()).coalesce();
    at::Tensor out = t;  // the caller's tensor, which gloo's result replaces in place too
    out.copy_(sum);
  });
}

}  // namespace smddp
