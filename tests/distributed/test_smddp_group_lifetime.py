"""smddp groups destroyed or aborted while in use: a destroyed group used again, a destroy
during a call on the group, an abort on one rank, and a work's callback that destroys its
own group or waits for later work of its lane. Each case once crashed or hung; gloo's
behaviour is the reference."""

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
