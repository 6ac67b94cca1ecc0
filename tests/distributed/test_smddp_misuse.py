"""smddp under calls a correct training script does not make: operands that overlap, ranks
configured differently, a destroyed group used again, waits with a timeout, huge timeouts.
Each case once crashed, hung or returned wrong values; gloo's behaviour is the reference."""

import os
import sys
import threading
import time

import pytest

from tests.distributed.launcher import run_distributed
from tests.distributed.smddp_rank_helpers import await_told, tell
from tests.distributed.smddp_rank_helpers import cpu_backend as _cpu
from torch_sagemaker.smddp import backend

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not backend.is_available(), reason="smddp extension not built"),
]


def _overlapping_operands():
    """Inputs that overlap the output elsewhere than at this rank's own part, in ordinary
    memory and in the pool, on smddp and gloo: every rank's results."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    n = 1 << 18  # 1 MiB of float32 per rank: above the zero-copy threshold
    out = {}
    for name, group in (("smddp", None), ("gloo", gloo)):
        # all_gather_into_tensor, input shifted by one element inside the output (no pool).
        buf = torch.arange(9.0) + 100 * me
        dist.all_gather_into_tensor(buf[0:8], buf[1:5], group=group)
        out[(name, "shifted")] = buf.tolist()
        # all_gather_into_tensor, pool output, input the *other* rank's slot of it.
        pooled = _cpu().allocate_tensor(2 * n, dtype=torch.float32, device=torch.device("cpu"))
        pooled.fill_(-1)
        other = pooled[(1 - me) * n : (2 - me) * n]
        other.copy_(torch.arange(n, dtype=torch.float32) + 1e6 * me)
        dist.all_gather_into_tensor(pooled, other, group=group)
        out[(name, "pool gather")] = pooled.clone()
        # reduce_scatter_tensor, pool input, output the other rank's block of it.
        pooled.copy_(torch.arange(2 * n, dtype=torch.float32) * (me + 1))
        dist.reduce_scatter_tensor(pooled[(1 - me) * n : (2 - me) * n], pooled, group=group)
        out[(name, "pool scatter")] = pooled.clone()
    # The usual in-place forms still read in place (zero copy): FSDP2's all-gather input is
    # its own slot of the output, a reduce-scatter output its own block of the input.
    stats = backend.pool_stats(dist.group.WORLD)
    before = stats["zero_copy_ops"]
    pooled = _cpu().allocate_tensor(2 * n, dtype=torch.float32, device=torch.device("cpu"))
    pooled[me * n : (me + 1) * n] = float(me + 1)
    dist.all_gather_into_tensor(pooled, pooled[me * n : (me + 1) * n])
    gathered = pooled.clone()
    pooled.copy_(torch.arange(2 * n, dtype=torch.float32))
    dist.reduce_scatter_tensor(pooled[me * n : (me + 1) * n], pooled)
    scattered = pooled[me * n : (me + 1) * n].clone()
    zero_copy = backend.pool_stats(dist.group.WORLD)["zero_copy_ops"] - before
    return out, gathered, scattered, zero_copy


def test_overlapping_operands_give_gloos_results_and_in_place_stays_zero_copy():
    import torch

    n = 1 << 18
    for rank, (out, gathered, scattered, zero_copy) in enumerate(
        run_distributed(_overlapping_operands, backend="smddp")
    ):
        for case in ("shifted", "pool gather", "pool scatter"):
            smddp, gloo = out[("smddp", case)], out[("gloo", case)]
            if isinstance(smddp, list):
                assert smddp == gloo, (rank, case, smddp, gloo)
            else:
                assert torch.equal(smddp, gloo), (rank, case, (smddp != gloo).sum().item())
        assert out[("smddp", "shifted")][:8] == [1, 2, 3, 4, 101, 102, 103, 104]
        assert gathered.view(2, n)[:, 0].tolist() == [1.0, 2.0]
        assert torch.equal(scattered, torch.arange(n, dtype=torch.float32) * 2 + 2 * rank * n)
        assert zero_copy == 2, zero_copy


def _all_to_all_in_place():
    """In-place all_to_all_single with unequal splits (own part moves first) on both backends."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    splits = [[1, 3], [3, 1]][me]  # rank 0 keeps 1 row, sends 3; rank 1 sends 3, keeps 1
    out = {}
    for name, group in (("smddp", None), ("gloo", gloo)):
        t = torch.arange(4.0) + 10 * me
        dist.all_to_all_single(t, t.clone(), splits, splits, group=group)
        u = torch.arange(4.0) + 10 * me
        dist.all_to_all_single(u, u, splits, splits, group=group)  # the same memory
        out[name] = (t.tolist(), u.tolist())
    return out


def test_all_to_all_in_place_equals_out_of_place():
    for out in run_distributed(_all_to_all_in_place, backend="smddp"):
        assert out["smddp"][1] == out["smddp"][0] == out["gloo"][0], out


def _settings_differ_on_rank_1(variable, value):
    import torch.distributed as dist

    before = os.environ.get(variable)
    if dist.get_rank() == 1:
        os.environ[variable] = value
    try:
        dist.new_group([0, 1])
    except ValueError as e:
        return str(e)
    finally:
        if before is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = before
    return "no error"


@pytest.mark.parametrize(
    "variable, value",
    [("SMDDP_ONESHOT_BYTES", "0"), ("SMDDP_CHUNK_BYTES", "64K"), ("SMDDP_NET_ALGO", "ring")],
)
def test_ranks_with_different_algorithm_settings_fail_at_group_creation(variable, value):
    # Before: wrong all-reduce sums (one-shot threshold), wrong reduce-scatters and then a
    # hang (chunk size), with no error.
    messages = run_distributed(_settings_differ_on_rank_1, variable, value, backend="smddp")
    for message in messages:
        assert (
            f"has {variable}=" in message and "every rank of a group must use the same" in message
        )


def _one_rank_pinned_to_one_cpu():
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    cpus = os.sched_getaffinity(0)
    if me == 1:
        os.sched_setaffinity(0, {min(cpus)})  # 2 local ranks > 1 CPU: "oversubscribed"
    try:
        group = dist.new_group([0, 1])
        n = 3 << 18  # 3 MiB per rank: several chunks of either automatic size
        x = torch.arange(2 * n, dtype=torch.float32) * (me + 1)
        y = torch.empty(n)
        dist.reduce_scatter_tensor(y, x, group=group)
        z = torch.arange(4 * n, dtype=torch.float32) + me
        dist.all_reduce(z, group=group)
    finally:
        # Every thread of the process: the group's threads started while it was pinned.
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:
                pass  # the thread has ended
    want = torch.arange(2 * n, dtype=torch.float32)[me * n : (me + 1) * n] * 3
    return torch.equal(y, want), torch.equal(z, torch.arange(4 * n, dtype=torch.float32) * 2 + 1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_ranks_with_different_cpu_affinity_agree_on_the_chunk_size():
    # Before: each rank chose its automatic chunk from its own affinity mask, and the
    # pinned rank read its peer's buffer at the wrong steps.
    assert run_distributed(_one_rank_pinned_to_one_cpu, backend="smddp") == [(True, True)] * 2


def _inspect_destroyed_group():
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    dist.all_reduce(torch.ones(4), group=group)
    cpu = _cpu(group)
    dist.destroy_process_group(group)
    errors = {}
    for name, call in {
        "pool_stats": lambda: backend.pool_stats(group),
        "group_settings": lambda: backend.group_settings(group),
        "allocate_tensor": lambda: cpu.allocate_tensor(
            8, dtype=torch.float32, device=torch.device("cpu")
        ),
        "all_reduce": lambda: cpu.allreduce([torch.ones(2)]),
    }.items():
        try:
            call()
            errors[name] = "no error"
        except (RuntimeError, ValueError) as e:
            errors[name] = str(e)
    return cpu.supports_tensor_alloc(torch.device("cpu")), errors


def test_a_destroyed_group_raises_instead_of_crashing():
    # Before: SIGSEGV on every rank (the communicator was gone).
    for supports, errors in run_distributed(_inspect_destroyed_group, backend="smddp"):
        assert supports is False
        for name, message in errors.items():
            assert "was shut down" in message, (name, message)


def _once_inside(c_function: str, entered: threading.Event) -> None:
    """Sets ``entered`` when the calling thread next calls the C function ``c_function``.

    A profile hook sees the call just before the C function runs. The function (a torch
    binding) releases the GIL once it is inside; so when another thread that holds the GIL
    sees ``entered`` set and this thread's innermost frame outside the hook
    (``_wait_inside``), this thread is inside that call, not about to make it.
    """

    def hook(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", None) == c_function:
            sys.setprofile(None)
            entered.set()

    sys.setprofile(hook)


def _wait_inside(thread: threading.Thread, entered: threading.Event) -> None:
    """Until ``thread`` is inside the call ``_once_inside`` watches (at most 60 s)."""
    assert entered.wait(60), "the call was never made"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(thread.ident)
        if frame is None or frame.f_code.co_name != "hook":
            return
        time.sleep(0.001)
    raise TimeoutError("the thread stayed in the profile hook")


def _wait_blocked_in(ident: int, function: str, returned: threading.Event) -> None:
    """Until thread ``ident`` is blocked inside the Python function ``function`` (at most 60 s),
    or ``returned`` is set.

    Blocked: ``function`` is on its stack and its innermost frame stays at one instruction
    for 50 ms. This thread sleeps without the GIL between looks, so a thread that could run
    Python code would have moved on; one that stays put waits in a C call that released the
    GIL (for destroy: the wait for the call in flight).
    """
    last, since = None, time.monotonic()
    deadline = since + 60
    while not returned.is_set() and time.monotonic() < deadline:
        frame = sys._current_frames().get(ident)
        stack, inner = [], frame
        while frame is not None:
            stack.append(frame.f_code.co_name)
            frame = frame.f_back
        now = (id(inner), inner.f_lasti) if inner is not None and function in stack else None
        if now is None or now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.05:
            return
        time.sleep(0.005)


def _destroy_during_a_call(mode):
    """Destroys a group while another thread of this rank is inside a call on it: a
    synchronous all_reduce (run in that thread), or a Work.wait() (which may run the queued
    work there). In "sync" and "wait" modes rank 0 destroys while its call is inside the
    backend waiting for rank 1, which makes its part only once rank 0's destroy waits; in "late
    peer" mode rank 1 never calls, and the group's timeout ends the call; in "abort" mode
    rank 1 never calls either, and rank 0 aborts the group. Events are ordered by store keys
    and by watching the calling thread (``_wait_inside``), not by sleeps."""
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp import SMDDPOptions

    me = dist.get_rank()
    group = dist.new_group([0, 1], pg_options=SMDDPOptions(timeout=30 if mode == "abort" else 3))
    dist.barrier()
    outcome = {}
    entered = threading.Event()
    destroying, done = f"destroy during a call {mode}: destroying", f"... {mode}: done"

    def call():
        t = torch.ones(1 << 16)
        try:
            if mode == "wait":
                work = dist.all_reduce(t, group=group, async_op=True)
                _once_inside("wait", entered)
                work.wait()
            else:
                _once_inside("allreduce", entered)  # ProcessGroup.allreduce
                dist.all_reduce(t, group=group)
            outcome["result"] = t[:2].tolist()
        except (RuntimeError, ValueError) as e:
            # When destroy has already dropped the group, torch's exception logger fails to
            # name its backend and raises ValueError from smddp's error, which is its context.
            outcome["error"] = f"{e} | {e.__context__}"
        finally:
            sys.setprofile(None)

    caller = threading.Thread(target=call)
    if me == 0:
        caller.start()
        _wait_inside(caller, entered)
        # Inside the binding is not yet inside the backend: between the binding's release of
        # the GIL and the backend's entry, torch's dispatch runs, and a destroy that came
        # first failed the call as "shut down" (4 of 5 runs on an idle machine). Blocked
        # there for 50 ms, with the GIL free, it waits for the collective itself.
        _wait_blocked_in(caller.ident, "call", threading.Event())
        returned, watcher = threading.Event(), None
        if mode in ("sync", "wait"):
            # Rank 1 makes its part once this rank's destroy waits for the call (or returned).
            main = threading.get_ident()

            def watch():
                _wait_blocked_in(main, "destroy_process_group", returned)
                tell(destroying)

            watcher = threading.Thread(target=watch)
            watcher.start()
        start = time.monotonic()
        if mode == "abort":
            dist.distributed_c10d._abort_process_group(group)
        else:
            dist.destroy_process_group(group)
        took = time.monotonic() - start
        returned.set()
        if watcher is not None:
            watcher.join()
        caller.join()
        tell(done)
        return outcome, took
    if mode in ("late peer", "abort"):
        await_told(done)  # rank 1 never calls; it leaves the group once rank 0 is through
        dist.destroy_process_group(group)
        return outcome, 0.0
    await_told(destroying)  # rank 0's call is in flight: its destroy must wait for it
    caller.start()
    caller.join()
    dist.destroy_process_group(group)
    await_told(done)
    return outcome, 0.0


@pytest.mark.parametrize("mode", ["sync", "wait", "late peer", "abort"])
def test_destroying_a_group_during_a_call_on_it_waits_for_the_call(mode):
    # Before: the communicator was freed under the call, and rank 0 died with SIGSEGV.
    results = run_distributed(_destroy_during_a_call, mode, backend="smddp")
    if mode == "late peer":
        outcome, took = results[0]
        assert "timed out" in outcome.get("error", ""), outcome
        assert took < 6, took  # the call's 3 s timeout, not the default 30 min
    elif mode == "abort":
        outcome, took = results[0]
        assert "was aborted" in outcome.get("error", ""), outcome
        assert took < 10, took  # at once, not after the call's 30 s timeout
    else:
        for outcome, _ in results:
            assert outcome == {"result": [2.0, 2.0]}, outcome
        # Rank 1 made its part only after rank 0's destroy had waited 50 ms for the call.
        assert results[0][1] >= 0.05, results[0][1]


def _abort_on_one_rank():
    """Rank 0 aborts a group; rank 1 then calls a collective on it: its error and how long
    it took (the group's timeout is 30 s)."""
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp import SMDDPOptions

    group = dist.new_group([0, 1], pg_options=SMDDPOptions(timeout=30))
    dist.all_reduce(torch.ones(1), group=group)
    if dist.get_rank() == 0:
        dist.distributed_c10d._abort_process_group(group)
        dist.barrier()
        return None
    dist.barrier()
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=group)
        outcome = "no error"
    except RuntimeError as e:
        outcome = str(e)
    return outcome, time.monotonic() - start


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_an_abort_on_one_rank_fails_the_peers_collectives_at_once(transport):
    # Before: over shared memory the peer waited for the group's whole 30 s timeout (Note
    # [Abort tells the peers]); across hosts the closed sockets told it.
    env = {"SMDDP_FORCE_LOCAL_SIZE": "1"} if transport == "tcp" else {}
    _, (outcome, took) = run_distributed(_abort_on_one_rank, backend="smddp", env=env)
    assert "no error" not in outcome and took < 10, (outcome, took)
    if transport == "shm":
        assert "aborted on rank 0" in outcome, outcome
    # Over TCP no notice is sent: rank 1 learns of the abort from the sockets rank 0 closed,
    # and which of its reads sees that first (hence the wording) is a race; the claim is
    # the timing above.


def _attached():
    """Rank 0 says its callbacks are attached; rank 1 waits for it before its part. Without
    it, on a loaded machine, rank 0's Work could complete before its callback is attached,
    and the callback would run inline in the main thread, not where the test means it to."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        store.set("callbacks attached", "1")
    else:
        store.wait(["callbacks attached"])
        store.delete_key("callbacks attached")  # the rank processes serve the next test too


def _destroy_from_a_callback(how):
    """A future callback that destroys (or aborts) the group of its own Work. Rank 1 issues
    its part late, so rank 0's callbacks are attached before its Works can complete and run
    where the Works complete: on the pool thread running the group's lane ("pool thread",
    "abort"), or in the thread that waits for a receive and runs the receive rounds itself
    ("recv"). An all_reduce queued behind the first must still run (destroy) or fail
    (abort)."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    group = dist.new_group([0, 1], backend="smddp")
    dist.all_reduce(torch.ones(1), group=group)  # set up before anything is queued
    cpu = _cpu(group)
    events = []

    def destroy(fut):
        events.append(
            "main thread" if threading.current_thread() is threading.main_thread() else "pool"
        )
        try:
            if how == "abort":
                # Rank 1's part of the queued all_reduce arrives meanwhile: before Note [Abort
                # fails the queued work], rank 0 then ran it to success after the abort. The
                # sleep widens the window in which the old bug shows (nothing tells when the
                # peer's part has arrived); the test passes or fails the same without it.
                time.sleep(0.3)
                dist.distributed_c10d._abort_process_group(group)
            else:
                dist.destroy_process_group(group)
            events.append("destroyed")
        except Exception as e:  # noqa: BLE001 - reported to the test
            events.append(f"{type(e).__name__}: {e}")

    if me == 1:
        _attached()
    first, second = torch.ones(1 << 12), torch.full((1 << 12,), 2.0)
    if how == "recv":
        if me == 0:
            work = dist.irecv(first, src=1, group=group)
            work.get_future().then(destroy)
            _attached()
            work.wait()
        else:
            dist.send(torch.full((1 << 12,), 2.0), dst=0, group=group)
            dist.destroy_process_group(group)
    else:
        work = dist.all_reduce(first, group=group, async_op=True)
        behind = dist.all_reduce(second, group=group, async_op=True)
        chained = work.get_future().then(destroy)
        if me == 0:
            _attached()
        chained.wait()
        try:
            behind.wait()
        except RuntimeError as e:  # abort fails the work still queued; destroy lets it run
            second[0] = -1.0 if "was aborted" in str(e) else -2.0
    try:
        cpu.allreduce([torch.ones(1)])
        after = "no error"
    except RuntimeError as e:
        after = str(e)
    world = torch.ones(1)
    dist.all_reduce(world)  # the default group is untouched
    return events, first[0].item(), second[0].item(), after, world.item()


@pytest.mark.parametrize("how", ["pool thread", "recv", "abort"])
def test_a_callback_that_destroys_its_own_group_returns(how):
    # Before: shutdown() waited for the executor to go idle, i.e. for the thread running the
    # callback, and rank 0 hung with no timeout (gloo returns).
    results = run_distributed(_destroy_from_a_callback, how, backend="smddp", timeout=60)
    for rank, (events, first, second, refused, world) in enumerate(results):
        assert "was shut down" in refused, (rank, refused)
        assert world == 2.0
        if how == "recv":
            if rank == 0:  # rank 1 only sends: no callback there
                assert (events[1:], first) == (["destroyed"], 2.0), (rank, events, first)
            continue
        assert events[1:] == ["destroyed"], (rank, events)
        if rank == 0:
            # Rank 0's callback is attached before its Work can complete (_attached), so it
            # runs on the pool thread; rank 1's, attached after rank 0 went on, may find its
            # Work complete and run inline in the main thread: either place is right there.
            assert events[0] == "pool", (rank, events)
        assert (first, second) == (2.0, -1.0 if how == "abort" else 4.0), (rank, first, second)


def _callback_waits_for_its_lane(how):
    """A future callback, run by the pool thread of the lane that completed its Work, calls
    something that waits for later work of the same lane: all_reduce_direct (which runs
    after the queued collectives) or a blocking send behind an isend (16 MiB, more than the
    ring holds, so it cannot go out at once)."""
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp.direct import all_reduce_direct

    me = dist.get_rank()
    results = []
    if how == "all_reduce_direct":

        def callback(fut):
            t = torch.ones(4)
            all_reduce_direct(t)
            results.append(t[0].item())

        if me == 1:
            _attached()  # rank 0's callback is attached before its Work can complete
        first = dist.all_reduce(torch.ones(4), async_op=True)
        behind = dist.all_reduce(torch.ones(4), async_op=True)
        chained = first.get_future().then(callback)
        if me == 0:
            _attached()
        chained.wait()
        behind.wait()
        return results
    n = 4 << 20
    if me == 0:

        def callback(fut):
            dist.send(torch.full((n,), 2.0), dst=1)
            results.append("sent")

        chained = dist.isend(torch.ones(n), dst=1).get_future().then(callback)
        _attached()
        chained.wait()
    else:
        _attached()
        a, b = torch.zeros(n), torch.zeros(n)
        dist.recv(a, src=0)
        dist.recv(b, src=0)
        results += [a.sum().item(), b.sum().item()]
    return results


@pytest.mark.parametrize("how", ["all_reduce_direct", "send"])
def test_a_callback_can_wait_for_later_work_of_its_own_lane(how):
    # Before: the callback waited for the lane's pool thread, i.e. for itself, past the
    # group's timeout (the send has no future on gloo; all_reduce_direct is smddp's).
    results = run_distributed(_callback_waits_for_its_lane, how, backend="smddp", timeout=60)
    n = 4 << 20
    if how == "send":
        assert results == [["sent"], [float(n), 2.0 * n]]
    else:
        assert results == [[2.0], [2.0]]


def _broadcast_outputs():
    """all_reduce, broadcast and recv into an expand()ed tensor (stride 0: every element is
    the same memory), on smddp and on gloo: the base tensors' values."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, group in (("smddp", None), ("gloo", gloo)):
        base = torch.full((1,), float(me + 1))
        dist.all_reduce(base.expand(4), group=group)
        out[(name, "all_reduce")] = base.item()
        base = torch.full((2, 1), float(me + 1))
        dist.broadcast(base.expand(2, 3), 0, group=group)
        out[(name, "broadcast")] = base.flatten().tolist()
    # The list all_gather copies into each output itself (gloo refuses expanded outputs).
    bases = [torch.zeros(1) for _ in range(2)]
    dist.all_gather([b.expand(3) for b in bases], torch.full((3,), me + 1.0))
    out[("smddp", "all_gather")] = [b.item() for b in bases]
    return out


def test_outputs_that_broadcast_one_element_take_the_result_as_on_gloo():
    # Before: torch's "more than one element of the written-to tensor refers to a single
    # memory location" from smddp's copy into the output, where gloo writes through.
    for out in run_distributed(_broadcast_outputs, backend="smddp"):
        for op in ("all_reduce", "broadcast"):
            assert out[("smddp", op)] == out[("gloo", op)], (op, out)
        assert out[("smddp", "all_reduce")] == 3.0
        assert out[("smddp", "all_gather")] == [1.0, 2.0]


def _coalesce_two_dtypes():
    import torch
    import torch.distributed as dist

    try:
        with dist._coalescing_manager():
            dist.all_reduce(torch.ones(3))
            dist.all_reduce(torch.ones(3, dtype=torch.float64))
        return "no error"
    except TypeError as e:
        message = str(e)
    t = torch.ones(2)
    dist.all_reduce(t)  # the group is still usable
    return message, t.tolist()


def test_coalescing_two_dtypes_names_the_rule():
    # Before: "input and output dtypes differ", in a call that has no output.
    for message, after in run_distributed(_coalesce_two_dtypes, backend="smddp"):
        assert "one dtype" in message and "Float and Double" in message, message
        assert after == [2.0, 2.0]


def _wait_with_timeout_on_a_late_peer():
    """Rank 0 waits 1 s for an all_reduce that rank 1 makes only after that wait returned
    (or, if it never does, after 20 s: then rank 0's wait returns late and the test fails)."""
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        await_told("late peer: rank 0's timed wait returned", timeout_s=20)
        dist.all_reduce(torch.ones(4))
        return None
    work = dist.all_reduce(torch.ones(4), async_op=True)
    start = time.monotonic()
    try:
        work.wait(timeout=__import__("datetime").timedelta(seconds=1))
        outcome = "completed"
    except RuntimeError as e:
        outcome = str(e)
    waited = time.monotonic() - start
    tell("late peer: rank 0's timed wait returned")
    work.wait()  # it still completes once the peer arrives
    return outcome, waited


def test_wait_with_a_timeout_returns_when_it_runs_out():
    # Before: wait(timeout=1 s) ran the collective itself and returned after the peer came.
    outcome, waited = run_distributed(_wait_with_timeout_on_a_late_peer, backend="smddp")[0]
    assert "timed out" in outcome and waited < 3, (outcome, waited)


def _group_with_timeout(seconds):
    import torch
    import torch.distributed as dist

    from torch_sagemaker.smddp import SMDDPOptions

    group = dist.new_group([0, 1], pg_options=SMDDPOptions(timeout=seconds))
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    return t.tolist()


def test_a_huge_timeout_means_waiting_long_not_failing_at_once():
    # Before: 1e10 s overflowed the deadline into the past; set-up "timed out" at once.
    assert run_distributed(_group_with_timeout, 1e10, backend="smddp") == [[2.0] * 4] * 2
