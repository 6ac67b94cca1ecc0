// ProcessGroupSMDDP reductions: all_reduce (also the direct call), its coalesced form,
// reduce and the reduce-scatters. Validation on the caller's thread, then a closure on raw
// pointers for the executor; non-contiguous tensors are staged through a contiguous copy. The
// other collectives are in backend_movement.cpp, point-to-point in backend_p2p.cpp, the
// all_reduce of sparse tensors in backend_sparse.cpp.
#include <limits>

#include "smddp/backend/op_helpers.h"

namespace smddp {

using namespace ops;  // NOLINT(build/namespaces): this file's own helpers
WorkPtr ProcessGroupSMDDP::allreduce(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) {
  const InUse use = enter();
  check_count(tensors, "all_reduce");
  if (tensors[0].layout() == at::kSparse) return allreduce_sparse(tensors[0], opts);
  if (any_complex(tensors)) {  // Note [Complex reductions]
    std::vector<at::Tensor> real = real_views(tensors, opts.reduceOp, "all_reduce");
    return complex_result(allreduce(real, opts), tensors);
  }
  if (auto op = stage({&tensors[0]}, "all_reduce")) {
    at::Tensor t = tensors[0];
    if (!t.is_contiguous()) {
      std::vector<at::Tensor> host = op->mirror(tensors, true, true);
      return staged(op, [&] { return allreduce(host, opts); });
    }
    // Note [Staging pipeline] in device_staging.h.
    Reduction red = reduction_of(opts.reduceOp, t, "all_reduce");
    OpCtx ctx = live_comm().make_ctx("all_reduce", desc_of(t, int(red.op), t.numel()),
                                     args_of(t, redop_name(red.op)), timeout_of(opts.timeout));
    return staged(op, [&] {
      return submit(OpType::ALLREDUCE, tensors, opts.asyncOp,
                    [this, op, t, red, ctx] { op->allreduce(*comm_, t, red, ctx); });
    });
  }
  check_cpu(tensors[0], "all_reduce", "its tensor");
  at::Tensor t = tensors[0];
  Reduction red = reduction_of(opts.reduceOp, t, "all_reduce");
  OpCtx ctx = live_comm().make_ctx("all_reduce", desc_of(t, int(red.op), t.numel()),
                                   args_of(t, redop_name(red.op)), timeout_of(opts.timeout));
  return submit(OpType::ALLREDUCE, tensors, opts.asyncOp,
                [this, t, red, ctx] { allreduce_tensor(*comm_, t, red, ctx); });
}

void ProcessGroupSMDDP::allreduce_direct(const at::Tensor& tensor, const c10d::ReduceOp& op) {
  const InUse use = enter();
  check_cpu(tensor, "all_reduce", "its tensor");
  if (tensor.is_neg() || tensor.is_conj()) {
    // A view whose values are its storage negated or conjugated (torch._neg_view, .conj()):
    // reduce the values, not the storage (MAX of negated values is not MIN of the stored
    // ones), then write them back through the view.
    at::Tensor values = tensor.resolve_conj().resolve_neg();
    allreduce_direct(values, op);
    copy_back(values, tensor);
    return;
  }
  issued_.fetch_add(1);  // a collective like any other (getSequenceNumberForGroup)
  at::Tensor t = tensor;
  if (t.is_complex()) t = real_views({t}, op, "all_reduce")[0];  // Note [Complex reductions]
  Reduction red = reduction_of(op, t, "all_reduce");
  OpCtx ctx = live_comm().make_ctx("all_reduce", desc_of(t, int(red.op), t.numel()),
                                   args_of(t, redop_name(red.op)), timeout_s());
  exec_->run_now([&] { allreduce_tensor(*comm_, t, red, ctx); });
}

WorkPtr ProcessGroupSMDDP::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceCoalescedOptions& opts) {
  const InUse use = enter();
  TORCH_CHECK_VALUE(!tensors.empty(), "smddp: all_reduce_coalesced needs at least one tensor");
  if (any_complex(tensors)) {  // Note [Complex reductions]
    std::vector<at::Tensor> real = real_views(tensors, opts.reduceOp, "all_reduce_coalesced");
    return complex_result(allreduce_coalesced(real, opts), tensors);
  }
  if (auto op = stage(all_of({&tensors}), "all_reduce_coalesced")) {
    std::vector<at::Tensor> host = op->mirror(tensors, true, true);
    return staged(op, [&] { return allreduce_coalesced(host, opts); });
  }
  for (const auto& t : tensors) {
    check_cpu(t, "all_reduce_coalesced", "a tensor");
    TORCH_CHECK_TYPE(t.scalar_type() == tensors[0].scalar_type(),
                     "smddp: all_reduce_coalesced reduces tensors of one dtype together, got ",
                     tensors[0].scalar_type(), " and ", t.scalar_type(),
                     "; coalesce each dtype in its own call");
  }
  Reduction red = reduction_of(opts.reduceOp, tensors[0], "all_reduce_coalesced");
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  OpCtx ctx =
      live_comm().make_ctx("all_reduce_coalesced", desc_of(tensors[0], int(red.op), total),
                           args_of(tensors[0], redop_name(red.op)), timeout_of(opts.timeout));
  auto ts = tensors;
  return submit(OpType::ALLREDUCE_COALESCED, tensors, opts.asyncOp, [this, ts, red, ctx] {
    // One collective over the concatenation, then scattered back.
    at::Tensor flat = flat_cat(ts);
    comm_->allreduce(flat.data_ptr(), flat.numel(), red, ctx);
    int64_t off = 0;
    for (const auto& t : ts) {
      copy_back(flat.narrow(0, off, t.numel()).view(t.sizes()), t);
      off += t.numel();
    }
  });
}

WorkPtr ProcessGroupSMDDP::reduce(std::vector<at::Tensor>& tensors,
                                  const c10d::ReduceOptions& opts) {
  const InUse use = enter();
  check_count(tensors, "reduce");
  if (any_complex(tensors)) {  // Note [Complex reductions]
    std::vector<at::Tensor> real = real_views(tensors, opts.reduceOp, "reduce");
    return complex_result(reduce(real, opts), tensors);
  }
  if (auto op = stage({&tensors[0]}, "reduce")) {
    std::vector<at::Tensor> host = op->mirror(tensors, true, rank_ == opts.rootRank);
    return staged(op, [&] { return reduce(host, opts); });
  }
  check_single(tensors, "reduce");
  at::Tensor t = tensors[0];
  const int root = checked_root(opts.rootRank, size_, "reduce");
  Reduction red = reduction_of(opts.reduceOp, t, "reduce");
  OpCtx ctx =
      live_comm().make_ctx("reduce", desc_of(t, int(red.op), t.numel(), root),
                           rooted(args_of(t, redop_name(red.op)), root), timeout_of(opts.timeout));
  int me = rank_;
  return submit(OpType::REDUCE, tensors, opts.asyncOp, [this, t, red, ctx, root, me] {
    // Note [Rooted collectives] in shm_rooted.h: the other ranks' tensors are only read.
    at::Tensor c = t.contiguous();
    comm_->reduce(c.data_ptr(), c.numel(), red, root, ctx);
    if (me == root) copy_back(c, t);
  });
}

WorkPtr ProcessGroupSMDDP::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                const c10d::ReduceScatterOptions& opts) {
  const InUse use = enter();
  const char* name = "reduce_scatter_tensor";
  check_same_dtype(input, output, name);
  if (input.is_complex()) {  // Note [Complex reductions]
    std::vector<at::Tensor> real = real_views({input, output}, opts.reduceOp, name);
    return complex_result(_reduce_scatter_base(real[1], real[0], opts), {output});
  }
  TORCH_CHECK_VALUE(input.numel() == output.numel() * size_, "smddp: ", name,
                    ": the input must have world_size (", size_, ") x output numel (",
                    output.numel(), ") = ", output.numel() * size_, " elements, got ",
                    input.numel());
  if (auto op = stage({&input, &output}, name)) {
    if (input.is_contiguous() && output.is_contiguous()) {  // Note [Staging pipeline]
      Reduction red = reduction_of(opts.reduceOp, input, name);
      OpCtx ctx =
          live_comm().make_ctx(name, desc_of(input, int(red.op), output.numel()),
                               args_of(output, redop_name(red.op)), timeout_of(opts.timeout));
      at::Tensor in = input, out = output;
      return staged(op, [&] {
        return submit(
            OpType::_REDUCE_SCATTER_BASE, {output}, opts.asyncOp,
            [this, op, in, out, red, ctx] { op->reduce_scatter(*comm_, in, out, red, ctx); });
      });
    }
    at::Tensor hin = op->mirror(input, true, false);
    at::Tensor hout = op->mirror(output, false, true);
    return staged(op, [&] { return _reduce_scatter_base(hout, hin, opts); });
  }
  check_cpu(input, name, "the input");
  check_cpu(output, name, "the output");
  Reduction red = reduction_of(opts.reduceOp, input, name);
  OpCtx ctx = live_comm().make_ctx(name, desc_of(input, int(red.op), output.numel()),
                                   args_of(output, redop_name(red.op)), timeout_of(opts.timeout));
  at::Tensor in = input, out = output;
  return submit(OpType::_REDUCE_SCATTER_BASE, {output}, opts.asyncOp, [this, in, out, red, ctx] {
    at::Tensor o = contiguous_out(out);
    at::Tensor i = apart_from(in.contiguous(), o, rank_ * o.numel() * o.element_size(), false);
    comm_->reduce_scatter(i.data_ptr(), o.data_ptr(), o.numel(), red, ctx);
    copy_back(o, out);
  });
}

WorkPtr ProcessGroupSMDDP::reduce_scatter(std::vector<at::Tensor>& outputs,
                                          std::vector<std::vector<at::Tensor>>& inputs,
                                          const c10d::ReduceScatterOptions& opts) {
  const InUse use = enter();
  check_count(outputs, "reduce_scatter");
  if (any_complex(outputs) || (inputs.size() == 1 && any_complex(inputs[0]))) {
    // Note [Complex reductions]
    std::vector<at::Tensor> out = real_views(outputs, opts.reduceOp, "reduce_scatter");
    std::vector<std::vector<at::Tensor>> in;
    for (const auto& l : inputs) in.push_back(real_views(l, opts.reduceOp, "reduce_scatter"));
    return complex_result(reduce_scatter(out, in, opts), outputs);
  }
  if (auto op = stage(all_of(inputs, outputs), "reduce_scatter")) {
    auto hin = mirror_lists(*op, inputs, true, false);
    std::vector<at::Tensor> hout = op->mirror(outputs, false, true);
    return staged(op, [&] { return reduce_scatter(hout, hin, opts); });
  }
  check_single(outputs, "reduce_scatter");
  TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == size_,
                    "smddp: reduce_scatter needs a list of world_size (", size_, ") inputs");
  at::Tensor out = outputs[0];
  bool equal = true;
  for (const auto& i : inputs[0]) {
    check_cpu(i, "reduce_scatter", "an input");
    check_same_dtype(i, out, "reduce_scatter");
    equal = equal && i.numel() == out.numel();
  }
  Reduction red = reduction_of(opts.reduceOp, out, "reduce_scatter");
  if (!equal) return reduce_scatter_unequal(out, inputs[0], red, opts);
  OpCtx ctx = live_comm().make_ctx("reduce_scatter", desc_of(out, int(red.op), out.numel()),
                                   args_of(out, redop_name(red.op)), timeout_of(opts.timeout));
  auto ins = inputs[0];
  return submit(OpType::REDUCE_SCATTER, outputs, opts.asyncOp, [this, ins, out, red, ctx] {
    at::Tensor flat = flat_cat(ins);
    at::Tensor o = contiguous_out(out);
    comm_->reduce_scatter(flat.data_ptr(), o.data_ptr(), o.numel(), red, ctx);
    copy_back(o, out);
  });
}

// Note [Reduce-scatter of unequal parts] in comm_algos.cpp: input_list[p] is the part rank p
// receives, shaped like its output, so the parts may differ in size between ranks. The
// inputs are concatenated as in the equal-size form (one copy of the input); the parts'
// sizes, which every rank passes alike, cut the concatenation and join the descriptor.
WorkPtr ProcessGroupSMDDP::reduce_scatter_unequal(const at::Tensor& out,
                                                  const std::vector<at::Tensor>& ins,
                                                  const Reduction& red,
                                                  const c10d::ReduceScatterOptions& opts) {
  const char* name = "reduce_scatter";
  TORCH_CHECK_VALUE(ins[rank_].numel() == out.numel(), "smddp: ", name, ": the output has ",
                    out.numel(), " elements but input ", rank_, ", this rank's part, has ",
                    ins[rank_].numel(), "; input_list[i] is the part rank i receives");
  // Sizes come from tensors that exist, but expand()ed views are large at no cost: their sum
  // and its bytes must fit before anything is allocated for them.
  const int64_t esz = out.element_size();
  std::vector<size_t> counts(size_);
  int64_t total = 0;
  for (int p = 0; p < size_; ++p) {
    const int64_t n = ins[p].numel();
    TORCH_CHECK_VALUE(!__builtin_add_overflow(total, n, &total) &&
                          total <= std::numeric_limits<int64_t>::max() / esz,
                      "smddp: ", name, ": the inputs add up to more bytes than a tensor ",
                      "can hold (input ", p, " has ", n, " elements)");
    counts[p] = static_cast<size_t>(n);
  }
  OpArgs args = args_of(out, redop_name(red.op));
  args.numel = total;  // the whole input: what sets calls of unequal parts apart in messages
  OpCtx ctx = live_comm().make_ctx("reduce_scatter (unequal parts)",
                                   desc_of(out, int(red.op), static_cast<uint64_t>(total)), args,
                                   timeout_of(opts.timeout));
  std::vector<at::Tensor> outs = {out};
  return submit(OpType::REDUCE_SCATTER, outs, opts.asyncOp, [this, ins, out, counts, red, ctx] {
    at::Tensor flat = flat_cat(ins);
    at::Tensor o = contiguous_out(out);
    comm_->reduce_scatter(flat.data_ptr(), o.data_ptr(), counts, red, ctx);
    copy_back(o, out);
  });
}

WorkPtr ProcessGroupSMDDP::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::ReduceScatterOptions& opts) {
  const InUse use = enter();
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(),
                    "smddp: reduce_scatter_tensor_coalesced needs as many outputs as inputs");
  std::vector<WorkPtr> parts;
  {
    NotCoalescing parts_alone(coalescing_);
    for (size_t k = 0; k < inputs.size(); ++k) {
      parts.push_back(_reduce_scatter_base(outputs[k], inputs[k], opts));
    }
  }
  return track(c10::make_intrusive<CoalescedWork>(std::move(parts)));
}

}  // namespace smddp
