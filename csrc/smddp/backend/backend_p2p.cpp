// ProcessGroupSMDDP point-to-point operations: send, recv and receive from any rank.
#include "smddp/backend/op_helpers.h"

namespace smddp {

using namespace ops;  // NOLINT(build/namespaces): this file's own helpers

// Note [Eager point-to-point]: a send whose message fits the free space of its shared-memory
// ring is written in the caller's thread and its Work is complete at once (the tensor may
// be reused, as after any completed isend); a recv whose message is already complete in the
// ring is copied out the same way. Anything else is queued: sends on the send lane, receives
// with the other waiting receives (Note [Receives wait side by side] in receive_poller.cpp). Both
// skip the thread hand-off, which costs tens of microseconds on these VMs, and neither overtakes an
// operation queued before it (a receive is done at once only while no receive waits).
WorkPtr ProcessGroupSMDDP::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  const InUse use = enter();
  check_count(tensors, "send");
  if (auto op = stage({&tensors[0]}, "send")) {
    // The bytes must be on the host before the eager path may write them (Note [Eager
    // point-to-point]), so the device->host copy runs here, in the caller's thread.
    std::vector<at::Tensor> host = op->mirror(tensors, true, false);
    op->copy_in();
    return staged(op, [&] { return send(host, dst, tag); });
  }
  check_single(tensors, "send");
  TORCH_CHECK_VALUE(dst >= 0 && dst < size_ && dst != rank_, "smddp: send to invalid rank ", dst,
                    " from rank ", rank_, ": a rank cannot send to itself; peers are 0..",
                    size_ - 1, " except this rank");
  at::Tensor t = tensors[0];
  at::Tensor c = t.contiguous();
  const size_t bytes = c.numel() * c.element_size();
  if (exec_->try_send_now([&] {
        return comm_->try_send_now(c.data_ptr(), bytes, dst, static_cast<uint32_t>(tag));
      })) {
    return completed(OpType::SEND, tensors);
  }
  OpCtx ctx = live_comm().make_ctx("send", desc_of(t, 0, t.numel()), peer_args_of(t, dst, true),
                                   timeout_s());
  return submit(OpType::SEND, tensors, true, [this, c, bytes, dst, tag, ctx] {
    comm_->send(c.data_ptr(), bytes, dst, static_cast<uint32_t>(tag), ctx);
  });
}

WorkPtr ProcessGroupSMDDP::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  const InUse use = enter();
  check_count(tensors, "recv");
  if (auto op = stage({&tensors[0]}, "recv")) {
    std::vector<at::Tensor> host = op->mirror(tensors, false, true);
    return staged(op, [&] { return recv(host, src, tag); });
  }
  check_single(tensors, "recv");
  TORCH_CHECK_VALUE(src >= 0 && src < size_ && src != rank_, "smddp: recv from invalid rank ", src,
                    " on rank ", rank_, ": a rank cannot receive from itself; peers are 0..",
                    size_ - 1, " except this rank");
  at::Tensor t = tensors[0];
  if (t.is_contiguous() && exec_->try_receive_now([&] {
        return comm_->try_recv_now(t.data_ptr(), t.numel() * t.element_size(), src,
                                   static_cast<uint32_t>(tag));
      })) {
    return completed(OpType::RECV, tensors);
  }
  OpCtx ctx = live_comm().make_ctx("recv", desc_of(t, 0, t.numel()), peer_args_of(t, src, false),
                                   timeout_s());
  return submit_receive(make_work(OpType::RECV, tensors), t, src, tag, ctx);
}

// Note [Receives wait side by side] in receive_poller.cpp.
WorkPtr ProcessGroupSMDDP::submit_receive(c10::intrusive_ptr<SmddpWork> work, const at::Tensor& t,
                                          int src, int tag, const OpCtx& ctx) {
  // A staged receive (Note [Device staging]) copies the host mirror to the device once the
  // message is in it.
  std::shared_ptr<StagedOp> staged_op = std::move(pending_stage_);
  work->set_executor(exec_);
  at::Tensor c = contiguous_out(t);
  SmddpWork* w = work.get();  // the queued receive holds the work while it is attempted
  Communicator::RecvPoll poll;
  poll.data_owner = std::make_shared<at::Tensor>(c);  // Note [Direct receives over TCP]
  exec_->submit_receive(
      [this, t, c, src, tag, ctx = OpCtx(ctx), poll, w, staged_op]() mutable {
        int from = -1;
        if (!comm_->poll_recv(c.data_ptr(), c.numel() * c.element_size(), src,
                              static_cast<uint32_t>(tag), ctx, poll, &from)) {
          return false;
        }
        copy_back(c, t);
        if (staged_op) staged_op->copy_out();
        if (src == kAnyPeer) w->set_source_rank(from);
        return true;
      },
      SmddpWork::completion(work), src, tag, !comm_->p2p_in_shared_memory(src));
  return track(work);
}

// Note [Receive from any rank]: the receive waits until any peer's next message with this
// tag is there (shared-memory rings and TCP connections alike), takes it, and reports the
// sender through the Work's sourceRank().
WorkPtr ProcessGroupSMDDP::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const InUse use = enter();
  check_count(tensors, "recv");
  if (auto op = stage({&tensors[0]}, "recv")) {
    std::vector<at::Tensor> host = op->mirror(tensors, false, true);
    return staged(op, [&] { return recvAnysource(host, tag); });
  }
  check_single(tensors, "recv");
  at::Tensor t = tensors[0];
  OpCtx ctx = live_comm().make_ctx("recv", desc_of(t, 0, t.numel()),
                                   peer_args_of(t, kAnyPeer, false), timeout_s());
  return submit_receive(make_work(OpType::RECVANYSOURCE, tensors), t, kAnyPeer, tag, ctx);
}

}  // namespace smddp
