// ProcessGroupSMDDP collectives that move data without reducing it: the all-gathers,
// broadcast, gather, scatter, the all-to-alls and barrier. Validation on the caller's thread,
// then a closure on raw pointers for the executor; non-contiguous tensors are staged through
// a contiguous copy. The reductions are in backend_ops.cpp, point-to-point in backend_p2p.cpp.
#include "smddp/backend/op_helpers.h"

namespace smddp {

using namespace ops;  // NOLINT(build/namespaces): this file's own helpers

WorkPtr ProcessGroupSMDDP::_allgather_base(at::Tensor& output, at::Tensor& input,
                                           const c10d::AllgatherOptions& opts) {
  const InUse use = enter();
  const char* name = "all_gather_into_tensor";
  check_same_dtype(input, output, name);
  TORCH_CHECK_VALUE(output.numel() == input.numel() * size_, "smddp: ", name,
                    ": the output must have world_size (", size_, ") x input numel (",
                    input.numel(), ") = ", input.numel() * size_, " elements, got ",
                    output.numel());
  if (auto op = stage({&input, &output}, name)) {
    if (input.is_contiguous() && output.is_contiguous()) {  // Note [Staging pipeline]
      OpCtx ctx =
          live_comm().make_ctx(name, desc_of(input, 0, input.numel() * input.element_size()),
                               args_of(input), timeout_of(opts.timeout));
      at::Tensor in = input, out = output;
      return staged(op, [&] {
        return submit(OpType::_ALLGATHER_BASE, {output}, opts.asyncOp,
                      [this, op, in, out, ctx] { op->allgather(*comm_, in, out, ctx); });
      });
    }
    at::Tensor hin = op->mirror(input, true, false);
    at::Tensor hout = op->mirror(output, false, true);
    return staged(op, [&] { return _allgather_base(hout, hin, opts); });
  }
  check_cpu(input, name, "the input");
  check_cpu(output, name, "the output");
  const size_t bytes = input.numel() * input.element_size();
  OpCtx ctx = live_comm().make_ctx(name, desc_of(input, 0, bytes), args_of(input),
                                   timeout_of(opts.timeout));
  at::Tensor in = input, out = output;
  return submit(OpType::_ALLGATHER_BASE, {output}, opts.asyncOp, [this, in, out, bytes, ctx] {
    at::Tensor o = contiguous_out(out);
    // An input that is a view of this rank's slot of the output (FSDP2) is used as is.
    at::Tensor i = apart_from(in.contiguous(), o, rank_ * bytes, true);
    comm_->allgather(i.data_ptr(), o.data_ptr(), bytes, ctx);
    copy_back(o, out);
  });
}

WorkPtr ProcessGroupSMDDP::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                     std::vector<at::Tensor>& inputs,
                                     const c10d::AllgatherOptions& opts) {
  const InUse use = enter();
  check_count(inputs, "all_gather");
  if (auto op = stage(all_of(outputs, inputs), "all_gather")) {
    std::vector<at::Tensor> hin = op->mirror(inputs, true, false);
    auto hout = mirror_lists(*op, outputs, false, true);
    return staged(op, [&] { return allgather(hout, hin, opts); });
  }
  check_single(inputs, "all_gather");
  TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == size_,
                    "smddp: all_gather needs a list of world_size (", size_, ") output tensors");
  at::Tensor in = inputs[0];
  for (const auto& o : outputs[0]) {
    check_cpu(o, "all_gather", "an output");
    check_same_dtype(in, o, "all_gather");
    TORCH_CHECK_VALUE(o.numel() == in.numel(), "smddp: all_gather: every output must have ",
                      in.numel(), " elements like the input, got ", o.numel());
  }
  const size_t bytes = in.numel() * in.element_size();
  OpCtx ctx = live_comm().make_ctx("all_gather", desc_of(in, 0, bytes), args_of(in),
                                   timeout_of(opts.timeout));
  auto outs = outputs[0];
  int n = size_;
  return submit(OpType::ALLGATHER, outs, opts.asyncOp, [this, in, outs, bytes, ctx, n] {
    at::Tensor i = in.contiguous();
    at::Tensor flat = at::empty({n * i.numel()}, i.options());
    comm_->allgather(i.data_ptr(), flat.data_ptr(), bytes, ctx);
    for (int r = 0; r < n; ++r) {
      copy_back(flat.narrow(0, r * i.numel(), i.numel()).view(outs[r].sizes()), outs[r]);
    }
  });
}

// c10d's all_gather_coalesced: outputs[r][i] receives input i of rank r. The inputs travel
// as one all-gather of their bytes, concatenated.
WorkPtr ProcessGroupSMDDP::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::AllgatherOptions& opts) {
  const InUse use = enter();
  const char* name = "all_gather_coalesced";
  TORCH_CHECK_VALUE(!inputs.empty(), "smddp: ", name, " needs at least one input tensor");
  if (auto op = stage(all_of(outputs, inputs), name)) {
    std::vector<at::Tensor> hin = op->mirror(inputs, true, false);
    auto hout = mirror_lists(*op, outputs, false, true);
    return staged(op, [&] { return allgather_coalesced(hout, hin, opts); });
  }
  TORCH_CHECK_VALUE(static_cast<int>(outputs.size()) == size_, "smddp: ", name,
                    " needs one output list per rank (world_size ", size_, "), got ",
                    outputs.size());
  std::vector<size_t> offsets;
  size_t bytes = 0;
  for (const auto& in : inputs) {
    check_cpu(in, name, "an input");
    offsets.push_back(bytes);
    bytes += in.numel() * in.element_size();
  }
  std::vector<at::Tensor> flat_outputs;
  for (int r = 0; r < size_; ++r) {
    TORCH_CHECK_VALUE(outputs[r].size() == inputs.size(), "smddp: ", name, ": output list ", r,
                      " has ", outputs[r].size(), " tensors but there are ", inputs.size(),
                      " inputs; each rank's list needs one output per input");
    for (size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& o = outputs[r][i];
      check_cpu(o, name, "an output");
      check_same_dtype(inputs[i], o, name);
      TORCH_CHECK_VALUE(o.numel() == inputs[i].numel(), "smddp: ", name, ": output ", i,
                        " of rank ", r, " has ", o.numel(), " elements but input ", i, " has ",
                        inputs[i].numel());
      flat_outputs.push_back(o);
    }
  }
  OpCtx ctx = live_comm().make_ctx(name, desc_of(inputs[0], 0, bytes), args_of(inputs[0]),
                                   timeout_of(opts.timeout));
  auto ins = inputs;
  auto outs = outputs;
  const int n = size_;
  return submit(OpType::ALLGATHER_COALESCED, flat_outputs, opts.asyncOp,
                [this, ins, outs, offsets, bytes, ctx, n] {
                  at::Tensor send = at::empty({static_cast<int64_t>(bytes)}, at::kByte);
                  char* s = static_cast<char*>(send.data_ptr());
                  for (size_t i = 0; i < ins.size(); ++i) {
                    at::Tensor c = ins[i].contiguous();
                    if (c.numel())
                      std::memcpy(s + offsets[i], c.data_ptr(), c.numel() * c.element_size());
                  }
                  at::Tensor all = at::empty({static_cast<int64_t>(bytes) * n}, at::kByte);
                  comm_->allgather(s, all.data_ptr(), bytes, ctx);
                  const char* a = static_cast<const char*>(all.data_ptr());
                  for (int r = 0; r < n; ++r) {
                    for (size_t i = 0; i < ins.size(); ++i) {
                      const at::Tensor& o = outs[r][i];
                      at::Tensor c = contiguous_out(o);
                      if (c.numel())
                        std::memcpy(c.data_ptr(), a + r * bytes + offsets[i],
                                    c.numel() * c.element_size());
                      copy_back(c, o);
                    }
                  }
                });
}

WorkPtr ProcessGroupSMDDP::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::AllgatherOptions& opts) {
  const InUse use = enter();
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(),
                    "smddp: all_gather_into_tensor_coalesced needs as many outputs as inputs");
  std::vector<WorkPtr> parts;
  {
    NotCoalescing parts_alone(coalescing_);
    for (size_t k = 0; k < inputs.size(); ++k)
      parts.push_back(_allgather_base(outputs[k], inputs[k], opts));
  }
  return track(c10::make_intrusive<CoalescedWork>(std::move(parts)));
}

WorkPtr ProcessGroupSMDDP::broadcast(std::vector<at::Tensor>& tensors,
                                     const c10d::BroadcastOptions& opts) {
  const InUse use = enter();
  check_count(tensors, "broadcast");
  if (auto op = stage({&tensors[0]}, "broadcast")) {
    const bool root = rank_ == opts.rootRank;
    std::vector<at::Tensor> host = op->mirror(tensors, root, !root);
    return staged(op, [&] { return broadcast(host, opts); });
  }
  check_single(tensors, "broadcast");
  at::Tensor t = tensors[0];
  const int root = checked_root(opts.rootRank, size_, "broadcast");
  const size_t bytes = t.numel() * t.element_size();
  OpCtx ctx = live_comm().make_ctx("broadcast", desc_of(t, 0, bytes, root),
                                   rooted(args_of(t), root), timeout_of(opts.timeout));
  return submit(OpType::BROADCAST, tensors, opts.asyncOp, [this, t, bytes, root, ctx] {
    at::Tensor c = t.contiguous();
    comm_->broadcast(c.data_ptr(), bytes, root, ctx);
    copy_back(c, t);
  });
}

WorkPtr ProcessGroupSMDDP::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const c10d::GatherOptions& opts) {
  const InUse use = enter();
  check_count(inputs, "gather");
  if (auto op = stage(all_of(outputs, inputs), "gather")) {
    std::vector<at::Tensor> hin = op->mirror(inputs, true, false);
    auto hout = mirror_lists(*op, outputs, false, true);
    return staged(op, [&] { return gather(hout, hin, opts); });
  }
  check_single(inputs, "gather");
  const int root = checked_root(opts.rootRank, size_, "gather");
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs = root_list(outputs, in, rank_ == root, size_, "gather", true);
  const size_t bytes = in.numel() * in.element_size();
  OpCtx ctx = live_comm().make_ctx("gather", desc_of(in, 0, bytes, root), rooted(args_of(in), root),
                                   timeout_of(opts.timeout));
  return submit(OpType::GATHER, outs, opts.asyncOp, [this, in, outs, bytes, ctx, root] {
    // Note [Rooted collectives] in shm_rooted.h; `outs` is empty except on the root, where
    // each rank's bytes land in its output directly (staged only if not contiguous).
    at::Tensor i = in.contiguous();
    std::vector<at::Tensor> staged;
    std::vector<char*> dst;
    for (const auto& o : outs) {
      staged.push_back(contiguous_out(o));
      dst.push_back(static_cast<char*>(staged.back().data_ptr()));
    }
    comm_->gather(i.data_ptr(), bytes, dst, root, ctx);
    for (size_t r = 0; r < outs.size(); ++r) copy_back(staged[r], outs[r]);
  });
}

WorkPtr ProcessGroupSMDDP::scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ScatterOptions& opts) {
  const InUse use = enter();
  check_count(outputs, "scatter");
  if (auto op = stage(all_of(inputs, outputs), "scatter")) {
    auto hin = mirror_lists(*op, inputs, true, false);
    std::vector<at::Tensor> hout = op->mirror(outputs, false, true);
    return staged(op, [&] { return scatter(hout, hin, opts); });
  }
  check_single(outputs, "scatter");
  const int root = checked_root(opts.rootRank, size_, "scatter");
  at::Tensor out = outputs[0];
  std::vector<at::Tensor> ins = root_list(inputs, out, rank_ == root, size_, "scatter", false);
  const size_t bytes = out.numel() * out.element_size() * size_;
  OpCtx ctx = live_comm().make_ctx("scatter", desc_of(out, 0, bytes, root),
                                   rooted(args_of(out), root), timeout_of(opts.timeout));
  return submit(OpType::SCATTER, outputs, opts.asyncOp, [this, ins, out, root, ctx] {
    // Note [Rooted collectives] in shm_rooted.h; `ins` is empty except on the root, which
    // reads each rank's input in place (staged only if not contiguous).
    std::vector<at::Tensor> staged;
    std::vector<const char*> src;
    for (const auto& i : ins) {
      staged.push_back(i.contiguous());
      src.push_back(static_cast<const char*>(staged.back().data_ptr()));
    }
    at::Tensor o = contiguous_out(out);
    comm_->scatter(src, out.numel() * out.element_size(), o.data_ptr(), root, ctx);
    copy_back(o, out);
  });
}

WorkPtr ProcessGroupSMDDP::alltoall_base(at::Tensor& output, at::Tensor& input,
                                         std::vector<int64_t>& output_splits,
                                         std::vector<int64_t>& input_splits,
                                         const c10d::AllToAllOptions& opts) {
  const InUse use = enter();
  const char* name = "all_to_all_single";
  if (auto op = stage({&input, &output}, name)) {
    at::Tensor hin = op->mirror(input, true, false);
    at::Tensor hout = op->mirror(output, false, true);
    return staged(op, [&] { return alltoall_base(hout, hin, output_splits, input_splits, opts); });
  }
  check_cpu(input, name, "the input");
  check_cpu(output, name, "the output");
  check_same_dtype(input, output, name);
  auto spans = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* what) {
    const int64_t rows = t.dim() ? t.size(0) : 1;
    // The tensor exists, so its byte count fits; every span below is a part of it.
    const size_t row_bytes = rows ? size_t(t.numel()) * t.element_size() / size_t(rows) : 0;
    std::vector<Span> out(size_);
    if (splits.empty()) {
      TORCH_CHECK_VALUE(rows % size_ == 0, "smddp: ", name, ": the ", what, " has ", rows,
                        " rows, not divisible by world_size ", size_, "; pass split sizes");
      for (int r = 0; r < size_; ++r)
        out[r] = {size_t(r * rows / size_) * row_bytes, size_t(rows / size_) * row_bytes};
      return out;
    }
    TORCH_CHECK_VALUE(static_cast<int>(splits.size()) == size_, "smddp: ", name, ": ", what,
                      " split sizes must have world_size (", size_, ") entries, got ",
                      splits.size());
    // Each split is checked against the rows still left, never summed first: split sizes
    // whose sum wraps around 64 bits must not pass as a match (they crashed every rank).
    int64_t left = rows;
    for (int r = 0; r < size_; ++r) {
      TORCH_CHECK_VALUE(splits[r] >= 0, "smddp: ", name, ": ", what, " split size ", r, " is ",
                        splits[r], "; split sizes must be >= 0");
      TORCH_CHECK_VALUE(splits[r] <= left, "smddp: ", name, ": ", what, " split sizes ",
                        c10::IntArrayRef(splits), " add up to more than the ", rows,
                        " rows of the ", what, " (split ", r, " is ", splits[r], " with ", left,
                        " rows left); they must sum to exactly its number of rows");
      out[r] = {size_t(rows - left) * row_bytes, size_t(splits[r]) * row_bytes};
      left -= splits[r];
    }
    TORCH_CHECK_VALUE(left == 0, "smddp: ", name, ": ", what, " split sizes sum to ", rows - left,
                      " but the ", what, " has ", rows, " rows");
    return out;
  };
  std::vector<Span> send = spans(input, input_splits, "input");
  std::vector<Span> recv = spans(output, output_splits, "output");
  OpCtx ctx =
      live_comm().make_ctx(name, desc_of(input, 0, 0), args_of(input), timeout_of(opts.timeout));
  at::Tensor in = input, out = output;
  return submit(OpType::ALLTOALL_BASE, {output}, opts.asyncOp, [this, in, out, send, recv, ctx] {
    at::Tensor o = contiguous_out(out);
    at::Tensor i = in.contiguous();
    if (overlaps(i, o)) i = i.clone();  // Note [Overlapping operands]
    comm_->alltoall(i.data_ptr(), send, o.data_ptr(), recv, ctx);
    copy_back(o, out);
  });
}

WorkPtr ProcessGroupSMDDP::alltoall(std::vector<at::Tensor>& outputs,
                                    std::vector<at::Tensor>& inputs,
                                    const c10d::AllToAllOptions& opts) {
  const InUse use = enter();
  TORCH_CHECK_VALUE(
      static_cast<int>(inputs.size()) == size_ && static_cast<int>(outputs.size()) == size_,
      "smddp: all_to_all needs world_size (", size_, ") inputs and outputs");
  // One dtype for every tensor of both lists, as gloo requires: the pieces travel as one
  // buffer, whose byte spans come from each tensor's own element size, while flat_cat
  // (at::cat) promoted mixed pieces to a common dtype, so the bytes sent did not match the
  // spans and a rank's outputs came back wrong without an error.
  const at::ScalarType dtype = inputs[0].scalar_type();
  for (int r = 0; r < size_; ++r) {
    for (const auto* list : {&inputs, &outputs}) {
      const char* what = list == &inputs ? "inputs" : "outputs";
      TORCH_CHECK_TYPE((*list)[r].scalar_type() == dtype, "smddp: all_to_all takes tensors of one ",
                       "dtype, but inputs[0] is ", dtype, " and ", what, "[", r, "] is ",
                       (*list)[r].scalar_type(), "; every input and output must have one dtype");
    }
  }
  if (auto op = stage(all_of({&inputs, &outputs}), "all_to_all")) {
    std::vector<at::Tensor> hin = op->mirror(inputs, true, false);
    std::vector<at::Tensor> hout = op->mirror(outputs, false, true);
    return staged(op, [&] { return alltoall(hout, hin, opts); });
  }
  std::vector<Span> send(size_), recv(size_);
  size_t so = 0, ro = 0;
  for (int r = 0; r < size_; ++r) {
    check_cpu(inputs[r], "all_to_all", "an input");
    check_cpu(outputs[r], "all_to_all", "an output");
    send[r] = {so, size_t(inputs[r].numel() * inputs[r].element_size())};
    recv[r] = {ro, size_t(outputs[r].numel() * outputs[r].element_size())};
    so += send[r].len;
    ro += recv[r].len;
  }
  OpCtx ctx = live_comm().make_ctx("all_to_all", desc_of(inputs[0], 0, 0), args_of(inputs[0]),
                                   timeout_of(opts.timeout));
  auto ins = inputs, outs = outputs;
  return submit(OpType::ALLTOALL, outputs, opts.asyncOp, [this, ins, outs, send, recv, ctx, ro] {
    at::Tensor flat_in = flat_cat(ins);
    at::Tensor flat_out = at::empty({static_cast<int64_t>(ro)}, at::kByte);
    comm_->alltoall(flat_in.data_ptr(), send, flat_out.data_ptr(), recv, ctx);
    for (size_t r = 0; r < outs.size(); ++r) {
      auto bytes = flat_out.narrow(0, recv[r].off, recv[r].len);
      copy_back(bytes.view(outs[r].scalar_type()).view(outs[r].sizes()), outs[r]);
    }
  });
}

WorkPtr ProcessGroupSMDDP::barrier(const c10d::BarrierOptions& opts) {
  const InUse use = enter();
  OpCtx ctx = live_comm().make_ctx("barrier", CollDesc{}, OpArgs{}, timeout_of(opts.timeout));
  return submit(OpType::BARRIER, {}, opts.asyncOp, [this, ctx] { comm_->barrier(ctx); });
}

}  // namespace smddp
