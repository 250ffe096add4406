"""Point-to-point that cannot hang on a transport whose sends block (issue #11, item 1): the
rendezvous validator against schedules written to deadlock or to cross messages, every lowered
schedule we generate against it, and the torchrun runtime itself on a simulated blocking
transport (threads, one per rank, a send completes only once its receive is posted)."""

from __future__ import annotations

import copy
import re
import threading
import time
import types
from collections import deque
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import schedules.comm as comm
from schedules import ScheduleError, build_schedule, insert_comms, parse_schedule, validate
from schedules.comm import SENDS, batches
from schedules.ir import Kind
from schedules.validate import rendezvous_run
from tests.conftest import even_times, quick_profile

# Rank 1 runs I/W (zero bubble): between its SEND_B0 and RECV_F1 sits W0, which needs nothing
# from rank 0, and between rank 0's SEND_F1 and RECV_B0 sits F2. Each rank posts its send alone,
# so with blocking sends each waits for a receive the other has not reached.
CROSSED = """\
0: 0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2
1: 1RECV_F0 1F0 1I0 1SEND_B0 1W0 1RECV_F1 1F1 1I1 1SEND_B1 1W1 1RECV_F2 1F2 1I2 1SEND_B2 1W2"""


def test_a_crossed_send_passes_eager_sends_and_deadlocks_under_rendezvous():
    s = parse_schedule(CROSSED, name="crossed")
    validate(s)  # sends that never block: runs
    with pytest.raises(ScheduleError) as e:
        validate(s, rendezvous=True)
    text = str(e.value)
    assert "deadlock when a send completes only once its receive is posted" in text
    assert "rank 0 waits at 0SEND_F1 for rank 1 to post the receive of activations 0->1 of " \
        "micro-batch 1" in text  # fmt: skip
    assert "rank 1 waits at 1SEND_B0 for rank 0 to post the receive of gradients 1->0 of " \
        "micro-batch 0" in text  # fmt: skip
    assert ">0SEND_F1<" in text and ">1SEND_B0<" in text  # the grid marks both ranks


def test_insert_comms_posts_the_crossed_messages_in_time_steps(monkeypatch):
    """Lowered with each send right after its action, this compute order is CROSSED itself;
    insert_comms sees that it would hang and posts each message at the end of the step that
    made it, at both ends."""
    compute = parse_schedule(CROSSED, name="crossed").compute_only()
    lowered = insert_comms(compute)
    validate(lowered, rendezvous=True)
    assert str(lowered) == (
        "0: 0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0B0 0RECV_B1 0B1 0RECV_B2 0B2\n"
        "1: 1RECV_F0 1F0 1RECV_F1 1I0 1SEND_B0 1RECV_F2 1W0 1F1 1I1 1SEND_B1 1W1 1F2 1I2 "
        "1SEND_B2 1W2"
    )
    # rank 1 takes micro-batch 2 in the batch that sends gradient 0, as rank 0 sends it
    assert ["1SEND_B0", "1RECV_F2"] in [[str(a) for a in b] for b in batches(lowered.ranks[1])]
    monkeypatch.setattr(comm, "_lockstep", lambda schedule: None)
    assert str(insert_comms(compute)) == str(parse_schedule(CROSSED))


def test_messages_taken_out_of_order_are_reported():
    s = parse_schedule(
        "0: 0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1\n"
        "1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
        name="crossed-order",
    )
    validate(s)  # gloo's tags would sort this out; NCCL has none
    with pytest.raises(ScheduleError, match="rank 0 sends activations 0->1 of micro-batch 1 to "
                       "rank 1 before activations 0->1 of micro-batch 0") as e:  # fmt: skip
        validate(s, rendezvous=True)
    assert ">0SEND_F1<" in str(e.value) and ">1RECV_F0<" in str(e.value)


def _generated():
    for name in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b"):
        for K in range(1, 9):
            for M in range(1, 17):
                try:
                    yield name, K, M, build_schedule(name, K, M)
                except ValueError:  # interleaved: K odd, or M not a multiple of the ranks
                    continue


def test_every_generated_schedule_meets_under_rendezvous():
    count = 0
    for name, K, M, sched in _generated():
        lowered = insert_comms(sched)
        validate(lowered, rendezvous=True)
        run = rendezvous_run(lowered)
        assert not run.stuck, (name, K, M)
        assert run.done == {a for acts in lowered.ranks.values() for a in acts}
        count += 1
    assert count > 300


def test_interleaved_needs_the_time_steps(monkeypatch):
    """Interleaved ranks send both ways at once: posting each send right after its action
    deadlocks there, and posting each message in the step that made it does not."""
    sched = build_schedule("interleaved-1f1b", 4, 4)
    mended = insert_comms(sched)
    monkeypatch.setattr(comm, "_lockstep", lambda schedule: None)
    plain = insert_comms(sched)
    validate(plain)  # fine while sends never block
    with pytest.raises(ScheduleError, match="deadlock when a send completes"):
        validate(plain, rendezvous=True)
    validate(mended, rendezvous=True)
    assert mended.ranks != plain.ranks
    # the same actions, each rank's compute in the same order
    for r in plain.ranks:
        assert sorted(mended.ranks[r]) == sorted(plain.ranks[r])
        assert [a for a in mended.ranks[r] if a.kind.is_compute] == [
            a for a in plain.ranks[r] if a.kind.is_compute
        ]


def _routes(S):
    skips = [(s, t) for t in range(S) for s in range(t - 1)]
    chain = [(s, s + 1) for s in range(S - 1)]
    if not skips:
        return st.just(chain)
    return st.lists(st.sampled_from(skips), unique=True).map(lambda x: chain + x)


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_routed_schedules_always_run_where_sends_never_block(data):
    """A captured graph's skips go straight to the stage that reads them. Lowered, they run
    where sends never block (gloo with its tags) and where they do (NCCL): each message in
    its own action where one would carry several, and taken in the order it was sent."""
    name = data.draw(st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]))
    K, M = data.draw(st.sampled_from([2, 4, 6])), data.draw(st.integers(1, 8))
    if name == "interleaved-1f1b" and M > K // 2 and M % (K // 2):
        M = K // 2
    sched = build_schedule(name, K, M)
    sched.routes = data.draw(_routes(K))
    lowered = insert_comms(sched)
    validate(lowered)
    # and they meet where sends block: a message per communication action where skips are
    validate(lowered, rendezvous=True)
    assert not rendezvous_run(lowered).stuck
    # the timed run with blocking sends vets every lowering tried as rendezvous_run does
    from schedules import Costs

    _vetted_alike(sched, Costs.uniform(sched.num_stages, transfer=[0.5] * (sched.num_stages - 1)))


def _vetted_alike(sched, costs):
    """Every lowering insert_comms tries: the timed run with blocking sends finishes exactly
    where rendezvous_run says it meets (what lets fastest_lowering vet and time in one run)."""
    from schedules import simulate
    from schedules.simulate import blocking_makespan

    tl = simulate(sched, costs, memory=False)
    tried = [comm._plain(sched), comm._lockstep(sched)]
    tried += [comm._timed(sched, tl, how) for how in comm._HOW]
    for lowered in tried:
        if lowered is not None:
            assert comm._meets(lowered) == (blocking_makespan(lowered, costs) is not None)


def test_skips_are_posted_one_message_per_action_in_the_step_that_made_them(monkeypatch):
    """Stage 3 takes activations from stages 0 and 2 (a skip), as a captured U-Net's last stage
    does. Each receive right before its forward hangs where sends block; a message per action
    (`3RECV_F0@0`, `3RECV_F0@2`), each posted in the step that made it, meets."""
    sched = build_schedule("1f1b", 4, 4)
    sched.routes = [(0, 1), (0, 3), (1, 2), (2, 3)]
    with monkeypatch.context() as m:
        m.setattr(comm, "_lockstep", lambda schedule: None)
        with pytest.raises(ScheduleError, match="deadlock when a send completes"):
            validate(insert_comms(sched), rendezvous=True)
    lowered = insert_comms(sched)
    validate(lowered, rendezvous=True)
    rank3 = [str(a) for a in lowered.ranks[3]]
    # the skip of micro-batch 0 is taken in the step stage 0 made it, long before stage 2's
    assert rank3.index("3RECV_F0@0") < rank3.index("3RECV_F1@0") < rank3.index("3RECV_F0@2")
    assert rank3.index("3RECV_F0@2") < rank3.index("3F0")
    assert all("@" in str(a) for acts in lowered.ranks.values() for a in acts
               if not a.kind.is_compute)  # fmt: skip
    # each message once, sent and taken
    sent = sorted(str(a) for acts in lowered.ranks.values() for a in acts if a.kind in SENDS)
    assert len(sent) == len(set(sent)) == 2 * 4 * len(sched.routes)


# -- the runtime on a transport whose sends block -------------------------------------------


class _Store:
    """The launch's key-value store, as the runtime uses it."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def add(self, key: str, n: int) -> int:
        with self.lock:
            value = int(self.keys.get(key, b"0")) + n
            self.keys[key] = str(value).encode()
            return value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        return self.keys[key]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self.lock:
            if key not in self.keys and expected == "":
                self.keys[key] = desired.encode()
            return self.keys.get(key, b"")


class _Work:
    def __init__(self, transport: BlockingTransport, parts: list[_Work] | None = None) -> None:
        self.transport, self._done, self.parts = transport, False, parts

    @property
    def done(self) -> bool:
        return all(p.done for p in self.parts) if self.parts is not None else self._done

    @done.setter
    def done(self, value: bool) -> None:
        self._done = value

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> None:
        t = self.transport
        with t.cond:
            if not t.cond.wait_for(lambda: self.done or t.failed, timeout=t.timeout):
                t.failed = True
                t.cond.notify_all()
            if not self.done:
                raise TimeoutError("a send or receive never met its other end: deadlock")


class BlockingTransport:
    """torch.distributed as the torchrun runtime uses it, for ranks that are threads of one
    process. A send completes only once its receive is posted (and a receive once its send
    is): the rendezvous NCCL may impose; and as with NCCL, a batch gives one handle, done
    when all of it is, and messages between two ranks meet in the order they are posted (the
    tags must agree, or the wrong message arrived: `crossed`)."""

    def __init__(self, world: int, timeout: float = 20.0) -> None:
        self.world, self.timeout = world, timeout
        self.local = threading.local()
        self.cond = threading.Condition()
        self.waiting: dict[tuple[str, int, int], deque] = {}
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.shared: list[Any] = [None]
        self.failed = False
        self.posted = 0
        self.queues: dict[int, deque] = {}  # per rank: its batches not yet complete
        self.crossed: list[tuple[int, int, int, int]] = []  # messages met out of order
        self.store = _Store()
        self.distributed_c10d = types.SimpleNamespace(_get_default_store=lambda: self.store)
        self.halted: dict[int, tuple[str, float]] = {}  # rank: the watchdog's message, when
        self.halts = 1  # how many ranks halt before every wait fails (the threads are let go)
        self.casts: list[torch.Tensor] = []  # what broadcasts sent, in turn
        # all-reduces within a group smaller than the world (_group_reduce)
        self.group_calls: dict[tuple[tuple[int, ...], int], int] = {}
        self.group_box: dict[tuple[tuple[int, ...], int], dict[int, torch.Tensor]] = {}
        self.group_reads: dict[tuple[tuple[int, ...], int], int] = {}
        self.cast_seen: dict[int, int] = {}  # per rank: how many of them it took

    def halt(self, message: str) -> None:
        """What a rank's watchdog does in place of ending the process: noted, and once
        `halts` ranks have halted, every rank's waits fail (the threads end)."""
        with self.cond:
            self.halted[self.rank_of_thread()] = (message, time.perf_counter())
            if len(self.halted) < self.halts:
                return
            self.failed = True
            self.cond.notify_all()
        threading.Timer(1.0, self.barrier.abort).start()

    def rank_of_thread(self) -> int:
        """The rank a watchdog thread watches (from its name)."""
        return int(threading.current_thread().name.rsplit(" ", 1)[1])

    class P2POp:
        def __init__(self, op: Any, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
            self.op, self.tensor, self.peer, self.tag = op, tensor, peer, tag

    @staticmethod
    def isend(*args: Any, **kw: Any) -> None:  # the op's name only: batch_isend_irecv posts
        raise AssertionError("the runtime posts sends through batch_isend_irecv")

    @staticmethod
    def irecv(*args: Any, **kw: Any) -> None:
        raise AssertionError("the runtime posts receives through batch_isend_irecv")

    def is_initialized(self) -> bool:
        return True

    def get_rank(self) -> int:
        return self.local.rank

    def get_world_size(self) -> int:
        return self.world

    def get_backend(self) -> str:
        return "blocking"

    def new_group(self, ranks: list[int]) -> tuple[int, ...]:
        return tuple(ranks)

    class ReduceOp:
        MIN, MAX, SUM = min, max, sum

    def all_reduce(self, t: torch.Tensor, op: Any = sum, group: Any = None) -> None:
        if group is not None and len(group) < self.world:
            self._group_reduce(t, op, tuple(group))
            return
        self.barrier.wait()
        with self.cond:
            self.shared.append(t.clone())
        self.barrier.wait()
        got = torch.stack(self.shared[1:])
        self.barrier.wait()
        t.copy_({min: got.amin(0), max: got.amax(0), sum: got.sum(0)}[op])
        if self.get_rank() == 0:
            del self.shared[1:]
        self.barrier.wait()

    def _group_reduce(self, t: torch.Tensor, op: Any, members: tuple[int, ...]) -> None:
        """An all-reduce among `members` alone (a group new_group made): the k-th call of
        each member meets the others' k-th."""
        me = self.get_rank()
        assert me in members, "a rank outside the group took part in its all-reduce"
        with self.cond:
            k = self.group_calls.get((members, me), 0)
            self.group_calls[(members, me)] = k + 1
            box = self.group_box.setdefault((members, k), {})
            box[me] = t.clone()
            self.cond.notify_all()
            if not self.cond.wait_for(
                lambda: len(box) == len(members) or self.failed, timeout=self.timeout
            ):
                raise TimeoutError("an all-reduce never met its group")
            if len(box) < len(members):
                raise RuntimeError("a rank failed: its group's all-reduce never completed")
            got = torch.stack([box[r] for r in members])
            t.copy_({min: got.amin(0), max: got.amax(0), sum: got.sum(0)}[op])
            self.group_reads[(members, k)] = self.group_reads.get((members, k), 0) + 1
            if self.group_reads[(members, k)] == len(members):
                del self.group_box[(members, k)], self.group_reads[(members, k)]

    def broadcast(self, t: torch.Tensor, src: int, group: Any = None) -> None:
        """As gloo's: the root sends and goes on; the others wait for what it sent."""
        me = self.get_rank()
        with self.cond:
            if me == src:
                self.casts.append(t.clone())
                self.cond.notify_all()
                return
            seen = self.cast_seen.get(me, 0)
            if (
                not self.cond.wait_for(
                    lambda: len(self.casts) > seen or self.failed, timeout=self.timeout
                )
                or len(self.casts) <= seen
            ):
                raise TimeoutError("a broadcast never came")
            t.copy_(self.casts[seen])
            self.cast_seen[me] = seen + 1

    def batch_isend_irecv(self, ops: list[Any]) -> list[_Work]:
        """Queue the batch behind this rank's earlier ones (NCCL runs a rank's communication
        in order, on one stream); it is posted once they have all completed."""
        me = self.get_rank()
        batch = [(op, _Work(self)) for op in ops]
        with self.cond:
            queue = self.queues.setdefault(me, deque())
            queue.append(batch)
            if len(queue) == 1:
                self._post(me, batch)
            self.cond.notify_all()
        return [_Work(self, [w for _, w in batch])]

    def _post(self, me: int, batch: list[tuple[Any, _Work]]) -> None:
        touched = {me}
        for op, work in batch:
            send = op.op is self.isend
            src, dst = (me, op.peer) if send else (op.peer, me)
            mine, theirs = ("send", "recv") if send else ("recv", "send")
            other = self.waiting.get((theirs, src, dst))
            if other:
                tensor, peer, tag = other.popleft()
                if tag != op.tag:  # NCCL has no tags: the wrong message would arrive
                    self.crossed.append((src, dst, tag, op.tag))
                (op.tensor if not send else tensor).copy_(tensor if not send else op.tensor)
                work.done = peer.done = True
                touched.add(op.peer)
            else:
                self.waiting.setdefault((mine, src, dst), deque()).append((op.tensor, work, op.tag))
            self.posted += 1
        for r in touched:  # a rank whose batch completed posts its next one
            queue = self.queues.get(r)
            while queue and all(w.done for _, w in queue[0]):
                queue.popleft()
                if queue:
                    self._post(r, queue[0])


class BufferedTransport(BlockingTransport):
    """torch.distributed under gloo, as the runtime uses it: a send is buffered (complete at
    once), a receive completes when its message has come; gloo coalesces nothing, so the
    runtime posts each operation by its own call (a batch is refused here)."""

    class P2POp:
        def __init__(self, op: Any, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
            self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, None, tag

    def __init__(self, world: int, timeout: float = 20.0) -> None:
        super().__init__(world, timeout)
        self.mail: dict[tuple[int, int], deque] = {}  # (sender, receiver): (tag, tensor)
        self.tags: list[int] = []  # of every send
        # one object each, as torch's functions are: the runtime tells ops apart by identity
        self.isend, self.irecv = self._isend, self._irecv  # type: ignore[method-assign]

    def get_backend(self) -> str:
        return "gloo"

    def batch_isend_irecv(self, ops: list[Any]) -> list[_Work]:
        raise AssertionError("under gloo the runtime posts each operation itself")

    def _isend(self, tensor: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> _Work:
        with self.cond:
            self.mail.setdefault((self.get_rank(), peer), deque()).append((tag, tensor.clone()))
            self.tags.append(tag)
            self.posted += 1
            self.cond.notify_all()

        class Sent(_Work):  # buffered, but as gloo says it: complete once waited for
            def wait(self) -> None:
                self.done = True

        return Sent(self)

    def _irecv(self, buf: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> _Work:
        transport, me = self, self.get_rank()

        class Received(_Work):
            def wait(self) -> None:
                with transport.cond:
                    box = transport.mail.setdefault((peer, me), deque())
                    if not transport.cond.wait_for(
                        lambda: box or transport.failed, timeout=transport.timeout
                    ):
                        raise TimeoutError("a receive never got its message")
                    if not box:
                        raise RuntimeError("a rank failed: its message never came")
                    got, data = box.popleft()
                    if got != tag:
                        transport.crossed.append((peer, me, got, tag))
                    buf.copy_(data)
                    self.done = True

        self.posted += 1
        return Received(self)


def _run_ranks(
    program: str | list[str],
    models: list,
    x,
    y,
    loss_fn,
    timeout: float = 20.0,
    transport: BlockingTransport | None = None,
):
    """Each rank of the emitted torchrun `program` (or each its own) in a thread on a
    BlockingTransport (or `transport`), with its own copy of the model (made beforehand: the
    RNG is not the threads'); returns (losses, pipes, transport, errors)."""
    world = len(models)
    transport = transport or BlockingTransport(world, timeout)
    programs = [program] * world if isinstance(program, str) else program
    spaces: list[dict] = []
    for text in programs:
        ns: dict = {}
        exec(compile(text, "program.py", "exec"), ns)
        ns["dist"] = transport
        ns["Pipeline"].halt = staticmethod(transport.halt)
        spaces.append(ns)
    pipes: list[Any] = [None] * world
    losses: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        transport.local.rank = r
        try:
            pipes[r] = spaces[r]["Pipeline"](models[r])
            losses[r] = pipes[r].train_step(x if r == 0 else None, y, loss_fn)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)
            with transport.cond:
                transport.failed = True
                transport.cond.notify_all()
            # free the others from a collective, once those leaving it have left
            threading.Timer(1.0, transport.barrier.abort).start()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 3)
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    return losses, pipes, transport, errors


@pytest.fixture(scope="module")
def mlp_profile():
    from profiler.examples import mlp

    model = mlp(width=32, depth=4, batch=8)
    return quick_profile(model, model.example_input, batch_sizes=[1, 2, 4])


CASES = [  # (schedule, recompute, devices, micro-batches)
    ("gpipe", "never", 2, 4),
    ("1f1b", "except_last", 3, 5),
    ("zb-h1", "always", 3, 4),
    ("interleaved-1f1b", "never", 2, 4),
    ("gpipe", "always", 4, 4),
    ("1f1b", "never", 4, 6),
    ("zb-h1", "except_last", 4, 5),
    ("interleaved-1f1b", "except_last", 4, 8),
]


@pytest.mark.parametrize("schedule,mode,K,M", CASES)
def test_the_runtime_meets_on_a_blocking_transport(mlp_profile, schedule, mode, K, M):
    """The emitted torchrun program itself, every rank a thread, every send blocking until its
    receive is posted: it finishes, and every rank's gradients are the un-pipelined model's."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline
    from profiler.examples import mlp

    plan = plan_pipeline(mlp_profile, Cluster.uniform(K, "1GiB"), 8, microbatches=M,
                         schedule=schedule, recompute=mode)  # fmt: skip
    program = emit_program(plan, target="torchrun")
    assert "RENDEZVOUS = False" not in program
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    loss_fn = torch.nn.CrossEntropyLoss()
    models = []
    for _ in range(K):
        torch.manual_seed(0)
        models.append(mlp(width=32, depth=4, batch=8))
    losses, pipes, transport, errors = _run_ranks(program, models, x, y, loss_fn)
    assert not errors, errors
    assert not transport.crossed
    torch.manual_seed(0)
    reference = mlp(width=32, depth=4, batch=8)
    expected = loss_fn(reference(x), y)
    expected.backward()
    assert transport.posted > 0
    for r, pipe in enumerate(pipes):
        assert abs(float(losses[r]) - float(expected.detach())) < 1e-5
        model = models[r]
        for s in sorted(pipe.local):
            a, b = pipe.STAGES[s]
            for i in range(a, b):
                for p, q in zip(model[i].parameters(), reference[i].parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "schedule,K,M", [("1f1b", 4, 4), ("zb-h1", 3, 4), ("interleaved-1f1b", 2, 4)]
)
def test_a_captured_unets_skips_meet_on_a_blocking_transport(schedule, K, M):
    """A captured U-Net's skips cross ranks past the next stage. Each message in its own
    action, the emitted program is proven to meet where sends block (no RENDEZVOUS = False),
    and it does: every rank finishes with the model's loss and its stages' gradients."""
    import copy

    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline
    from profiler.examples import unet
    from profiler.graph import capture

    model = unet(size=8)
    x = model.example_input
    # even times: a split by structure, where the skips cross past the next stage
    prof = even_times(quick_profile(capture(model, x), x, batch_sizes=[2]))
    plan = plan_pipeline(prof, Cluster.uniform(K, "1GiB"), x.shape[0], microbatches=M,
                         schedule=schedule)  # fmt: skip
    assert any(t > s + 1 for s, t in plan.routes)  # a skip past the next stage
    program = emit_program(plan, target="torchrun")
    assert "RENDEZVOUS = False" not in program
    assert re.search(r'\("recv_forward", \d+, \d+, \d+\)', program)  # a message per action
    y, loss_fn = torch.randn_like(x), torch.nn.functional.mse_loss
    copies = [copy.deepcopy(model) for _ in range(K)]
    layers = [capture(c, x) for c in copies]
    losses, pipes, transport, errors = _run_ranks(program, layers, x, y, loss_fn)
    assert not errors, errors
    assert not transport.crossed
    reference = copy.deepcopy(model)
    expected = loss_fn(reference(x), y)
    expected.backward()
    grads = {}
    for c in copies:
        grads.update({n: p.grad for n, p in c.named_parameters() if p.grad is not None})
    assert all(abs(float(v) - float(expected.detach())) < 1e-5 for v in losses)
    assert set(grads) == {n for n, p in reference.named_parameters() if p.grad is not None}
    for n, p in reference.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("schedule,K,M", [("1f1b", 2, 4), ("zb-h1", 3, 4)])
def test_under_gloo_each_operation_is_posted_by_itself(mlp_profile, schedule, K, M):
    """gloo coalesces nothing, and batch_isend_irecv costs a third more to post there than a
    call per operation: the runtime posts each by itself (and all of a batch before waiting),
    with the same gradients as the un-pipelined model."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(mlp_profile, Cluster.uniform(K, "1GiB"), 8, microbatches=M,
                         schedule=schedule, recompute="never")  # fmt: skip
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    loss_fn = torch.nn.CrossEntropyLoss()
    transport = BufferedTransport(K)
    losses, pipes, _, errors = _run_ranks(
        emit_program(plan, target="torchrun"), _models(K), x, y, loss_fn, transport=transport
    )
    assert not errors, errors
    assert not transport.crossed and transport.posted == 2 * 2 * (K - 1) * M
    # each message under its own tag (the receiver matches by it), none left unsent
    assert len(set(transport.tags)) == len(transport.tags) and 0 not in transport.tags
    assert not any(transport.mail.values())
    _assert_unpipelined(losses, pipes, x, y)


def test_posting_one_message_at_a_time_hangs_on_the_blocking_transport(mlp_profile, monkeypatch):
    """The transport can fail: the same 1f1b program with each send and receive posted as a
    batch of its own (as before issue #11) deadlocks on it, as it could under NCCL."""
    import codegen.emit as emit
    from planner.cluster import Cluster
    from planner.search import plan_pipeline
    from profiler.examples import mlp

    plan = plan_pipeline(mlp_profile, Cluster.uniform(2, "1GiB"), 8, microbatches=3,
                         schedule="1f1b", recompute="never")  # fmt: skip
    monkeypatch.setattr(emit, "batches", lambda acts: [[a] for a in acts])
    program = emit.emit_program(plan, target="torchrun")
    assert 'self.exchange(("send_forward", 0, 1))' in program
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(mlp(width=32, depth=4, batch=8))
    *_, errors = _run_ranks(program, models, x, y, torch.nn.CrossEntropyLoss(), timeout=3)
    assert errors and any("deadlock" in str(e) for e in errors)


_LOGGED = """

_forward = Pipeline.forward


def _logged_forward(self, s, m):
    dist.log.append((self.rank, "F", m))
    return _forward(self, s, m)


Pipeline.forward = _logged_forward
"""


class _LoggedGloo(BufferedTransport):
    """BufferedTransport, logging each receive as it is posted: (rank, "recv", tag)."""

    def __init__(self, world: int) -> None:
        super().__init__(world)
        self.log: list[tuple] = []
        plain = self._irecv

        def irecv(buf: torch.Tensor, peer: int, group: Any = None, tag: int = 0) -> Any:
            self.log.append((self.get_rank(), "recv", tag))
            return plain(buf, peer, group, tag)

        self.irecv = irecv  # type: ignore[method-assign]


class _LoggedBlocking(BlockingTransport):
    """BlockingTransport (a rank's operations in the order posted, as NCCL's batches run),
    logging each receive as it is posted."""

    def __init__(self, world: int) -> None:
        super().__init__(world)
        self.log: list[tuple] = []

    def batch_isend_irecv(self, ops: list[Any]) -> list[_Work]:
        self.log += [(self.get_rank(), "recv", op.tag) for op in ops if op.op is self.irecv]
        return super().batch_isend_irecv(ops)


@pytest.mark.parametrize("transport,ahead", [(_LoggedGloo, {1, 2}), (_LoggedBlocking, {2})])
def test_which_ranks_post_their_forward_receives_as_the_step_begins(mlp_profile, transport, ahead):
    """gpipe on 3 ranks: under gloo, ranks 1 and 2 post all 4 forward receives before their
    first forward; where a rank's operations run in the order posted (NCCL's batches), the
    middle rank does not (its sends on would queue behind them), the last one does. The
    gradients are the un-pipelined model's either way."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    K, M = 3, 4
    plan = plan_pipeline(mlp_profile, Cluster.uniform(K, "1GiB"), 8, microbatches=M,
                         schedule="gpipe", recompute="never")  # fmt: skip
    program = emit_program(plan, target="torchrun")
    assert "PREPOSTED = (1, 2)" in program
    torch.manual_seed(0)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    t = transport(K)
    losses, pipes, _, errors = _run_ranks(
        program + _LOGGED, _models(K), x, y, torch.nn.CrossEntropyLoss(), transport=t
    )
    assert not errors, errors
    for r in range(1, K):
        mine = [e for e in t.log if e[0] == r]
        first = mine.index((r, "F", 0))
        forward_receives = {e[2] for e in mine if e[1] == "recv" and e[2] <= K * K * M}
        before = {e[2] for e in mine[:first] if e[1] == "recv" and e[2] <= K * K * M}
        assert len(forward_receives) == M
        assert (before == forward_receives) == (r in ahead), (r, mine)
        assert len(before) == (M if r in ahead else 1)
    _assert_unpipelined(losses, pipes, x, y)


def _assert_unpipelined(losses: list, pipes: list, x: torch.Tensor, y: torch.Tensor) -> None:
    """Every rank's loss and its stages' gradients are the un-pipelined mlp's (_models)."""
    from profiler.examples import mlp

    torch.manual_seed(0)
    reference = mlp(width=32, depth=4, batch=8)
    expected = torch.nn.CrossEntropyLoss()(reference(x), y)
    expected.backward()
    for r, pipe in enumerate(pipes):
        assert abs(float(losses[r]) - float(expected.detach())) < 1e-5
        for s in sorted(pipe.local):
            a, b = pipe.STAGES[s]
            for i in range(a, b):
                for p, q in zip(pipe.layers[i].parameters(), reference[i].parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def _models(K: int) -> list:
    from profiler.examples import mlp

    out = []
    for _ in range(K):
        torch.manual_seed(0)
        out.append(mlp(width=32, depth=4, batch=8))
    return out


def test_ranks_running_different_plans_all_refuse_before_anything_is_sent(mlp_profile):
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    programs = [
        emit_program(
            plan_pipeline(
                mlp_profile, Cluster.uniform(2, "1GiB"), 8, microbatches=M, schedule="gpipe"
            ),  # fmt: skip
            target="torchrun",
        )
        for M in (2, 4)
    ]
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    *_, transport, errors = _run_ranks(programs, _models(2), x, y, torch.nn.CrossEntropyLoss())
    assert len(errors) == 2 and transport.posted == 0, [repr(e) for e in errors]
    for e in errors:
        assert "runs program" in str(e) and "give every rank the same program" in str(e)


def test_each_rank_takes_the_device_the_cluster_names(mlp_profile):
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    cluster = Cluster.model_validate(
        {"devices": [{"name": f"d{k}", "memory_bytes": "1GiB", "torch_device": dev}
                     for k, dev in enumerate(["cpu", "mps"])]}
    )  # fmt: skip
    plan = plan_pipeline(mlp_profile, cluster, 8, microbatches=2, schedule="gpipe")
    program = emit_program(plan, target="torchrun")
    assert 'DEVICES = ["cpu", "mps"]' in program
    ns: dict = {}
    exec(compile(program, "program.py", "exec"), ns)
    runtime = ns["Pipeline"]
    probe = runtime.__new__(runtime)
    for rank, want in ((0, "cpu"), (1, "mps")):
        probe.rank = rank
        assert probe._own_device() == torch.device(want)
    probe.DEVICES = ["cpu", "nonsense:7"]
    with pytest.raises(RuntimeError, match="device 'nonsense:7'"):
        probe._own_device()


def test_a_rank_refusing_its_batch_stops_every_rank(mlp_profile):
    """The first stage's rank gets too small a batch: it says so, and the others refuse the step
    with it instead of waiting for messages that never come."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(mlp_profile, Cluster.uniform(3, "1GiB"), 8, microbatches=4,
                         schedule="1f1b")  # fmt: skip
    program = emit_program(plan, target="torchrun")
    x, y = torch.randn(2, 32), torch.randint(0, 10, (8,))
    *_, errors = _run_ranks(program, _models(3), x, y, torch.nn.CrossEntropyLoss(), timeout=5)
    assert len(errors) == 3
    texts = sorted(str(e) for e in errors)
    assert texts[0] == "another rank refused this step's batch; see its message" == texts[1]
    assert "the first stage's rank needs the input batch, with at least 4 samples" in texts[2]


def test_a_loss_that_is_no_function_is_refused_by_every_rank(mlp_profile):
    """Found by the review: a distributed Pipe checked loss_fn on each rank before the step, so
    a rank given none refused alone while the others waited in the step's start. Only the last
    stage's rank uses it: it judges it there, and every rank refuses the step together."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(mlp_profile, Cluster.uniform(3, "1GiB"), 8, microbatches=4,
                         schedule="1f1b")  # fmt: skip
    program = emit_program(plan, target="torchrun")
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    *_, transport, errors = _run_ranks(program, _models(3), x, y, None, timeout=5)
    assert len(errors) == 3 and transport.posted == 0 and not transport.halted
    assert all(type(e).__name__ == "BatchRefused" for e in errors)
    texts = sorted(str(e) for e in errors)
    assert texts[:2] == ["another rank refused this step's batch; see its message"] * 2
    assert texts[2] == "loss_fn: expected a function (output, target) -> loss"


@pytest.mark.parametrize(
    "case", ["too many samples", "targets of another size", "in a tuple", "other samples"]
)
def test_a_batch_only_one_rank_can_judge_is_refused_by_every_rank(mlp_profile, case):
    """Found by the red team: a distributed Pipe checked its batch size on the first stage's
    rank alone, before the step's start, and a target of another size failed on the last
    stage's rank alone: a caller catching that error went on a step out of line with the other
    ranks (the wrong targets' gradients, then a hang). Both are now settled in the step's
    start, from what every rank agreed on, so every rank refuses the step, nothing sent."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(mlp_profile, Cluster.uniform(3, "1GiB"), 8, microbatches=4,
                         schedule="gpipe")  # fmt: skip
    program = emit_program(plan, target="torchrun") + "\nPipeline.MAX_BATCH = 8\n"
    program += "Pipeline.SAMPLE_SHAPE = [32]\n"  # (what compile_pipe sets: the plan's)
    n, targets = (9, 9) if case == "too many samples" else (8, 9)
    x, y = torch.randn(n, 32), torch.randint(0, 10, (targets,))
    if case == "in a tuple":
        y = (y,)
    if case == "other samples":  # (found by a red team: 88x the plan's memory, unrefused)
        x, y = torch.randn(8, 4, 32), torch.randint(0, 10, (8,))
    *_, transport, errors = _run_ranks(
        program, _models(3), x, y, torch.nn.CrossEntropyLoss(), timeout=5
    )
    assert len(errors) == 3 and transport.posted == 0
    assert all(type(e).__name__ == "BatchRefused" for e in errors)  # (a Pipe: InputError)
    want = (
        "the plan is for batches of 4 to 8 samples (4 micro-batches, its memory figures for 8);"
        " plan again with batch_size=9"
        if case == "too many samples"
        else "each sample has shape [4, 32], the plan is for [32]"
        if case == "other samples"
        else "the target has 9 samples but the input has 8; pass one target per sample"
    )
    assert all(want in str(e) for e in errors), errors


def _steps(program, models, world, x, y, loss_fn, steps=None, pipes=None) -> dict[int, list]:
    """Each rank of `program` in a thread on `world` (its watchdog's halt the transport's,
    quicker than in use), taking steps[r] steps (1 by default), each with what its caller
    would see: "returned" or the exception's type and text. `pipes`: a list that gets each
    rank's pipeline."""
    K = len(models)
    spaces = []
    for _ in range(K):
        ns: dict = {}
        exec(compile(program, "program.py", "exec"), ns)
        ns["dist"] = world
        ns["Pipeline"].halt = staticmethod(world.halt)
        ns["WATCH_EVERY"], ns["WATCH_GRACE"] = 0.05, 0.3  # (1 s in use: quicker here)
        spaces.append(ns)
    got: dict[int, list] = {r: [] for r in range(K)}

    def rank(r: int) -> None:
        world.local.rank = r
        pipe = spaces[r]["Pipeline"](models[r])
        if pipes is not None:
            pipes.append(pipe)
        for _ in range((steps or {}).get(r, 1)):
            try:
                pipe.train_step(x if r == 0 else None, y, loss_fn)
                got[r].append("returned")
            except BaseException as e:  # noqa: BLE001 - what each rank's caller would see
                got[r].append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(K)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    return got


def _boom(now: bool) -> None:
    if now:
        raise ValueError("boom")


@pytest.mark.parametrize("transport", [BufferedTransport, BlockingTransport])
@pytest.mark.parametrize(
    "schedule,K,where",
    [("gpipe", 2, "loss"), ("1f1b", 3, "loss"), ("1f1b", 4, "middle"), ("zb-h1", 3, "middle"),
     ("interleaved-1f1b", 2, "middle"), ("1f1b", 3, "last backward")],
)  # fmt: skip
def test_a_step_that_fails_on_one_rank_halts_every_rank_still_in_it(
    mlp_profile, transport, schedule, K, where
):
    """Found by the review: a rank whose step failed, its caller catching the error (as a
    distributed Pipe's user may), left the other ranks waiting for ever on messages that never
    came. Now every other rank's watchdog halts its process within seconds, naming the rank,
    action, stage and micro-batch that failed; no rank returns from the step; the failing
    rank's next step says the pipeline stopped. (Here a halt makes the rank's waits fail.)"""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(mlp_profile, Cluster.uniform(K, "1GiB"), 8, microbatches=4,
                         schedule=schedule, recompute="never")  # fmt: skip
    program = emit_program(plan, target="torchrun")
    models = _models(K)
    bad = {"loss": K - 1, "middle": 1, "last backward": 0}[where]
    if where == "last backward":  # the first rank's last action, after its last send: the
        # others would finish every action of theirs (the step's end must hold them)
        grads = []

        def watch(module, args, out):
            if out.requires_grad:
                out.register_hook(lambda g: grads.append(1) or _boom(len(grads) == 4))

        models[0][plan.stages[0].layers[1] - 1].register_forward_hook(watch)
    if where == "middle":  # the rank's first layer fails on its third forward (stage `bad`
        _fail_at(models[bad], plan.stages[bad].layers[0], 3)  # is on rank `bad`, interleaved too)

    def loss_fn(out, y):
        if where == "loss":
            raise ValueError("boom")
        return torch.nn.functional.cross_entropy(out, y)

    world = transport(K, timeout=20)
    world.halts = K - 1  # (a halted process waits no more; the others still wait here)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    t0 = time.perf_counter()
    got = _steps(program, models, world, x, y, loss_fn, {bad: 2})
    first, second = got[bad]
    assert first.startswith("StageError: ") and "ValueError: boom" in first, first
    assert second.startswith(f"StageError: rank {bad}: the pipeline stopped: rank {bad} failed: ")
    stage = first.removeprefix("StageError: ")
    if where == "last backward":
        assert stage == "backward of stage 0, micro-batch 3 failed: ValueError: boom", stage
    else:
        assert "forward of stage" in stage and "micro-batch" in stage
    assert set(world.halted) == set(range(K)) - {bad}, (world.halted, got)
    for r, (message, when) in world.halted.items():
        assert message == f"rank {r} stopped: rank {bad} failed: {stage}", message
        assert when - t0 < 10, (r, when - t0)  # the transport's own timeout is 20 s
        assert got[r] != ["returned"], (r, got[r])  # no rank completes the failed step


def _fail_at(model, layer: int, call: int, error: type[BaseException] = ValueError) -> None:
    """`layer` of `model` raises `error` at its `call`-th real forward (the shape pass's fake
    ones aside)."""
    calls = []

    def hook(module, args):
        if type(args[0]).__name__ != "FakeTensor":
            calls.append(1)
            if len(calls) == call:
                raise error(f"boom at layer {layer}")

    model[layer].register_forward_pre_hook(hook)


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_ranks_failing_at_once_each_report_their_own_failure(mlp_profile, error):
    """Found by the red team: when two ranks failed in their own compute at the same moment,
    the second to write said "rank 0 stopped: rank 1 failed: ..." and hid its own error. Only a
    failure in communication is named after another rank's; an interrupt says where it came.
    Nobody is halted: both ranks left the step."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(mlp_profile, Cluster.uniform(2, "1GiB"), 8, microbatches=4,
                         schedule="gpipe", recompute="never")  # fmt: skip
    models = _models(2)
    for r in range(2):  # rank 0 at its second forward, rank 1 at its first: at once
        _fail_at(models[r], plan.stages[r].layers[0], 2 - r, error)
    world = BufferedTransport(2, timeout=10)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    got = _steps(emit_program(plan, target="torchrun"), models, world, x, y,
                 torch.nn.CrossEntropyLoss())  # fmt: skip
    for r in range(2):
        a = plan.stages[r].layers[0]
        if error is ValueError:
            assert got[r] == [f"StageError: forward of stage {r}, micro-batch {1 - r} failed: "
                              f"ValueError: boom at layer {a}"], got  # fmt: skip
        else:
            assert got[r] == [f"KeyboardInterrupt: boom at layer {a}"], got
    first = world.store.get(next(k for k in world.store.keys if k.endswith("/failed")))
    if error is KeyboardInterrupt:
        assert first.decode().split(": ", 1)[1].startswith("interrupted in forward of stage ")
    assert not world.halted


def test_each_pipeline_of_a_launch_has_message_tags_of_its_own(mlp_profile):
    """Found by the red team: a GPipe step that failed on every rank left its forward receives
    posted (gloo cannot take one back), and a pipeline compiled next in the same launch used
    the same tags, so those stale receives took its messages and it waited for ever. Each
    pipeline's tags now start past the previous one's (the ranks count pipelines alike)."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(mlp_profile, Cluster.uniform(2, "1GiB"), 8, microbatches=4,
                         schedule="gpipe", recompute="never")  # fmt: skip
    program = emit_program(plan, target="torchrun")
    assert "PREPOSTED = (1,)" in program
    world = BufferedTransport(2, timeout=10)
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    pipes: list = []
    for _ in range(2):
        got = _steps(program, _models(2), world, x, y, torch.nn.CrossEntropyLoss(), pipes=pipes)
        assert got == {0: ["returned"], 1: ["returned"]}
    first, second = (
        sorted(set(world.tags[: len(world.tags) // 2])),
        sorted(set(world.tags[len(world.tags) // 2 :])),
    )
    assert first and second and max(first) < min(second), (first, second)
    span = 2 * 2 * 2 * 4  # kinds x stages x stages x micro-batches
    assert [p.tag_base for p in pipes if p.rank == 0] == [0, span]


def test_an_input_the_model_cannot_take_is_refused_in_one_line(mlp_profile):
    """Found by the red team: before its one-line refusal, every rank printed torch's own log
    of the fake operation that failed, with a traceback."""
    import logging

    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(mlp_profile, Cluster.uniform(2, "1GiB"), 8, microbatches=4,
                         schedule="1f1b")  # fmt: skip
    records: list = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("torch._subclasses.fake_tensor")
    log.addHandler(handler)
    try:
        got = _steps(emit_program(plan, target="torchrun"), _models(2), BufferedTransport(2, 10),
                     torch.randn(8, 31), torch.randint(0, 10, (8,)), torch.nn.CrossEntropyLoss())  # fmt: skip
    finally:
        log.removeHandler(handler)
    want = "BatchRefused: cannot work out the shapes the stages send each other from an input of "
    assert all(g[0].startswith(want + "shape [8, 31]: RuntimeError: ") for g in got.values()), got
    assert records == []


def test_too_few_targets_are_refused_in_words(mlp_profile):
    """Found by the red team: targets with fewer samples than micro-batches were refused on
    the last stage's rank as if there were none."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(mlp_profile, Cluster.uniform(2, "1GiB"), 8, microbatches=4,
                         schedule="1f1b")  # fmt: skip
    world = BufferedTransport(2, timeout=10)
    x, y = torch.randn(2, 32), torch.randint(0, 10, (2,))
    got = _steps(emit_program(plan, target="torchrun"), _models(2), world, x, y,
                 torch.nn.CrossEntropyLoss())  # fmt: skip
    assert got[1] == [
        "BatchRefused: the targets hold 2 samples; this plan takes at least 4 (one per micro-batch)"
    ]
    assert got[0] == [
        "BatchRefused: the first stage's rank needs the input batch, with at least 4 samples"
    ]


def _tied_models(plan) -> list:
    """Two ranks' copies of the mlp, layer 6's weight layer 0's (on different ranks), with a
    gradient of 3.0 accumulated by earlier steps. (Plan from even times: a timed profile's split
    once put layer 6 on the first rank too, found by a review.)"""
    assert plan.stages[0].layers[1] <= 6  # layers 0 and 6 on different ranks
    models = _models(2)
    for m in models:
        m[6].weight = m[0].weight  # tied across the two ranks
        m[0].weight.grad = torch.full_like(m[0].weight, 3.0)
    return models


def test_a_refused_step_leaves_the_gradients_of_shared_weights_as_they_were(mlp_profile):
    """Found by the review: the step set aside the accumulated gradient of a weight two ranks
    share before its batch was agreed, so a refused step lost it on every rank."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(even_times(mlp_profile), Cluster.uniform(2, "1GiB"), 8, microbatches=4,
                         schedule="gpipe")  # fmt: skip
    models = _tied_models(plan)
    program = emit_program(plan, target="torchrun") + "\nPipeline.MAX_BATCH = 8\n"
    x, y = torch.randn(9, 32), torch.randint(0, 10, (9,))
    *_, transport, errors = _run_ranks(program, models, x, y, torch.nn.CrossEntropyLoss(),
                                       timeout=5)  # fmt: skip
    assert len(errors) == 2 and transport.posted == 0
    for m in models:
        assert m[0].weight.grad is not None and bool((m[0].weight.grad == 3.0).all())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_step_adds_to_the_accumulated_gradient_of_a_shared_weight_once(mlp_profile, schedule):
    """A weight two ranks share, with a gradient of 3.0 accumulated on both: after a step both
    hold 3.0 plus the step's gradient of every use, as the un-pipelined model does. The step
    once set the accumulated gradient aside while a new one was made (two gradients of the
    weight held through the step, one more than the plan counts); now the group's first rank
    goes on from it and the other from zero, in place."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(even_times(mlp_profile), Cluster.uniform(2, "1GiB"), 8, microbatches=4,
                         schedule=schedule)  # fmt: skip
    models = _tied_models(plan)
    ref = copy.deepcopy(models[0])
    kept = [m[0].weight.grad for m in models]
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    loss_fn = torch.nn.CrossEntropyLoss()
    losses, _, _, errors = _run_ranks(emit_program(plan, target="torchrun"), models, x, y,
                                      loss_fn)  # fmt: skip
    assert not errors, errors
    total = sum(loss_fn(ref(a), b) * len(a) / len(x) for a, b in zip(x.tensor_split(4),
                                                                     y.tensor_split(4)))  # fmt: skip
    total.backward()
    want = ref[0].weight.grad + 3.0  # (a deep copy takes no gradient)
    for m, grad in zip(models, kept):
        assert m[0].weight.grad is grad  # in place: no second buffer
        torch.testing.assert_close(m[0].weight.grad, want, rtol=1e-5, atol=1e-6)


def test_a_weight_two_of_three_ranks_share_is_summed_among_them_alone(mlp_profile):
    """Ranks 0 and 2 share layer 0's weight (layer 6 uses it), rank 1 does not: their group's
    first rank goes on from the accumulated gradient, the other from zero, and the sum is
    taken among the two alone; rank 1's layers keep their own gradients."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(even_times(mlp_profile), Cluster.uniform(3, "1GiB"), 8, microbatches=4,
                         schedule="1f1b")  # fmt: skip
    ranks = {layer: st.rank for st in plan.stages for layer in range(*st.layers)}
    assert (ranks[0], ranks[4], ranks[6]) == (0, 1, 2)
    models = _models(3)
    for m in models:
        m[6].weight = m[0].weight
        m[0].weight.grad = torch.full_like(m[0].weight, 3.0)
        m[4].weight.grad = torch.full_like(m[4].weight, 5.0)
    ref = copy.deepcopy(models[0])
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    loss_fn = torch.nn.CrossEntropyLoss()
    losses, _, transport, errors = _run_ranks(emit_program(plan, target="torchrun"), models, x,
                                              y, loss_fn)  # fmt: skip
    assert not errors, errors
    total = sum(loss_fn(ref(a), b) * len(a) / len(x) for a, b in zip(x.tensor_split(4),
                                                                     y.tensor_split(4)))  # fmt: skip
    total.backward()
    for r in (0, 2):  # the group: both hold the accumulated gradient and every use's, once
        got = models[r][0].weight.grad
        torch.testing.assert_close(got, ref[0].weight.grad + 3.0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(models[1][4].weight.grad, ref[4].weight.grad + 5.0, rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    assert bool((models[1][0].weight.grad == 3.0).all())  # not in the group: untouched
    assert not transport.group_box  # every group all-reduce met


def test_a_shape_pass_failing_on_one_rank_is_refused_by_every_rank(mlp_profile):
    """Found by the review: each rank works out the step's shapes with its own stages on its
    own device, so the pass can fail on one rank alone; that rank refused the batch while the
    others went on into the step and waited for it for ever. Now the ranks agree: every one
    refuses, nothing is sent, no watchdog halts anyone, a weight two ranks share keeps its
    accumulated gradient, and once the cause is gone the same input's step runs everywhere
    (no rank kept shapes the others do not have)."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(even_times(mlp_profile), Cluster.uniform(2, "1GiB"), 8, microbatches=4,
                         schedule="1f1b")  # fmt: skip
    models = _tied_models(plan)

    def fake_only(module, args):
        if type(args[0]).__name__ == "FakeTensor":
            raise ValueError("no fake form on this rank")

    hook = models[1][0].register_forward_pre_hook(fake_only)  # rank 1 only
    program = emit_program(plan, target="torchrun")
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    world = BufferedTransport(2, timeout=5)
    spaces = []
    for _ in range(2):
        ns: dict = {}
        exec(compile(program, "program.py", "exec"), ns)
        ns["dist"] = world
        ns["Pipeline"].halt = staticmethod(world.halt)
        spaces.append(ns)
    got: dict[int, list[str]] = {0: [], 1: []}
    go = threading.Barrier(2, timeout=20)

    def rank(r: int) -> None:
        world.local.rank = r
        pipe = spaces[r]["Pipeline"](models[r])
        for step in range(2):
            if step == 1:
                go.wait()
                if r == 1:
                    hook.remove()
                go.wait()
            try:
                pipe.train_step(x if r == 0 else None, y, torch.nn.CrossEntropyLoss())
                got[r].append("returned")
            except Exception as e:  # noqa: BLE001 - what each rank's caller would see
                got[r].append(f"{type(e).__name__}: {e}")
            if step == 0:
                got[r].append(bool((models[r][0].weight.grad == 3.0).all()))
                got[r].append(world.posted)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank never finished"
    shape = "cannot work out the shapes the stages send each other from an input of shape [8, 32]"
    assert got[1][0] == f"BatchRefused: {shape}: ValueError: no fake form on this rank"
    assert got[0][0] == f"BatchRefused: {shape}: another rank could not; see its message"
    assert got[0][1:3] == got[1][1:3] == [True, 0]  # the gradient kept, nothing sent
    assert got[0][3] == got[1][3] == "returned" and not world.halted


def test_the_shape_pass_leaves_the_model_as_it_was(mlp_profile):
    """Worked out on fake copies of the weights, in the model's own mode: the layers' training
    flags, weights and batch-norm statistics are untouched, and train() is never called."""
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    calls = []

    class Watched(torch.nn.BatchNorm1d):
        def train(self, mode: bool = True):
            calls.append(mode)
            return super().train(mode)

    plan = plan_pipeline(mlp_profile, Cluster.uniform(2, "1GiB"), 8, microbatches=2,
                         schedule="gpipe")  # fmt: skip
    program = emit_program(plan, target="torchrun")
    model = _models(1)[0]
    model[1] = Watched(32)  # in place of a ReLU: the same shapes
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ns: dict = {}
    exec(compile(program, "program.py", "exec"), ns)
    runtime = ns["Pipeline"]
    probe = runtime.__new__(runtime)
    probe.layers, probe.routed = list(model), False
    probe.tuple_out, probe.spec_cache = [False, False], {}
    probe.device = torch.device("cpu")
    ns["dist"] = BufferedTransport(1)  # (the ranks agree on the pass's outcome: here one)
    ns["dist"].local.rank = 0
    specs = probe._shapes((8, 32), torch.float32)
    cut = plan.stages[0].layers[1]
    width = 10 if cut == len(model) else 32
    assert specs[(0, 1, 0)] == [((4, width), torch.float32)]
    assert calls == [] and model[1].training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_launch_of_the_wrong_size_is_refused_by_every_rank(mlp_profile):
    from codegen.emit import emit_program
    from planner.cluster import Cluster
    from planner.search import plan_pipeline

    plan = plan_pipeline(mlp_profile, Cluster.uniform(2, "1GiB"), 8, microbatches=2,
                         schedule="gpipe")  # fmt: skip
    program = emit_program(plan, target="torchrun")
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    *_, transport, errors = _run_ranks(program, _models(3), x, y, torch.nn.CrossEntropyLoss())
    assert len(errors) == 3 and transport.posted == 0
    for e in errors:
        assert "this program runs on 2 processes, not 3: torchrun --nproc-per-node 2" in str(e)


# Timed as the torchrun program runs: each batch held until every message in it has gone.


def test_the_rendezvous_timeline_by_hand():
    """gpipe, 2 ranks, 2 micro-batches; F 1 ms, B 2 and 3 ms, 0.5 ms on the link. Rank 0's
    SEND_F1 and RECV_B1 are one batch, so rank 0 holds it until rank 1 sends B1 (7.0, in by
    7.5); rank 1's SEND_B1 holds rank 1 for the transfer, so its B0 starts at 7.5, not 6.5."""
    from schedules import Costs, simulate

    lowered = insert_comms(build_schedule("gpipe", 2, 2))
    assert [str(a) for a in lowered.ranks[0]] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B1", "0B1", "0RECV_B0", "0B0",
    ]  # fmt: skip
    costs = Costs([1.0, 1.0], [2.0, 3.0], transfer=[0.5])
    tl = simulate(lowered, costs, memory=False, rendezvous=True)
    assert tl.starts == [
        [0.0, 1.0, 1.5, 2.5, 2.5, 7.5, 9.5, 11.0],
        [0.0, 1.5, 2.5, 3.0, 4.0, 7.0, 7.5, 10.5],
    ]
    assert tl.ends == [
        [1.0, 1.5, 2.5, 7.5, 7.5, 9.5, 11.0, 13.0],
        [1.5, 2.5, 3.0, 4.0, 7.0, 7.5, 10.5, 11.0],
    ]
    assert tl.makespan == 13.0 and tl.busy == [6.0, 8.0]
    assert sorted(tl.raw_transfers) == [
        (0, 0, 0, 1.0, 1.5), (0, 0, 1, 2.5, 3.0), (1, 0, 0, 10.5, 11.0), (1, 0, 1, 7.0, 7.5),
    ]  # fmt: skip
    # where sends never block, rank 1 starts B0 as soon as B1 is sent: 1 ms sooner
    assert simulate(lowered, costs, memory=False).makespan == 12.0
    # a compute-only schedule is lowered first
    plain = build_schedule("gpipe", 2, 2)
    assert simulate(plain, costs, memory=False, rendezvous=True).makespan == 13.0


def test_gpipes_forward_receives_posted_ahead_by_hand(monkeypatch):
    """gpipe, 2 ranks, 3 micro-batches; F 1 and 3 ms, B 2 ms, 1 ms on the link. Rank 1's
    receives all posted at 0: rank 0 sends each activation as soon as it is made (its forwards
    end at 1, 3, 5 ms) and every transfer but the first hides behind rank 1's forwards: 22 ms.
    Posted as rank 1 reaches them, rank 0's SEND_F1 waits for rank 1's F0 to end (5 ms) and
    rank 1 waits out F1's and F2's transfers: 24 ms."""
    import importlib

    from schedules import Costs, simulate

    lowered = insert_comms(build_schedule("gpipe", 2, 3))
    costs = Costs([1.0, 3.0], [2.0, 2.0], transfer=[1.0])
    assert comm.preposted(lowered, costs) == {1}
    tl = simulate(lowered, costs, memory=False, rendezvous=True)
    forwards = [k for k, a in enumerate(lowered.ranks[0]) if a.kind.name == "F"]
    assert [tl.ends[0][k] for k in forwards] == [1.0, 3.0, 5.0]
    assert tl.ends[1][:6] == [2.0, 5.0, 5.0, 8.0, 8.0, 11.0]  # RECV_F0 F0 RECV_F1 F1 ...
    assert tl.makespan == 22.0
    monkeypatch.setattr(importlib.import_module("schedules.simulate"), "preposted",
                        lambda *a: frozenset())  # fmt: skip
    late = simulate(lowered, costs, memory=False, rendezvous=True)
    assert [late.ends[0][k] for k in forwards] == [1.0, 3.0, 7.0]
    assert late.ends[1][:6] == [2.0, 5.0, 6.0, 9.0, 10.0, 13.0]
    assert late.makespan == 24.0


def test_a_late_receive_takes_the_links_late_time_by_hand():
    """1f1b, 2 ranks, 2 micro-batches; F 1 ms, B 2 ms, 0.5 ms on the link, 1.5 ms for a message
    received late. Rank 0 posts SEND_F1 with RECV_B0 at 2.5; rank 1 posts RECV_F1 with SEND_B0
    at 4.5, after its send: activation 1 takes 1.5 ms (4.5 to 6.0), gradient 0, whose receive
    was posted first, 0.5 (4.5 to 5.0). Both ranks leave the batch at 6.0, a millisecond later
    than where every message takes 0.5 ms, and the step ends at 11.5, not 10.5."""
    from schedules import Costs, simulate

    plain = Costs([1.0, 1.0], [2.0, 2.0], transfer=[0.5])
    late = Costs([1.0, 1.0], [2.0, 2.0], transfer=[0.5], late_transfer=[1.5])
    lowered = insert_comms(build_schedule("1f1b", 2, 2), plain)
    assert str(lowered) == (
        "0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1\n"
        "1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1"
    )
    tl = simulate(lowered, late, memory=False, rendezvous=True)
    assert sorted(tl.raw_transfers) == [
        (0, 0, 0, 1.0, 1.5), (0, 0, 1, 4.5, 6.0), (1, 0, 0, 4.5, 5.0), (1, 0, 1, 9.0, 9.5),
    ]  # fmt: skip
    assert tl.ends == [
        [1.0, 1.5, 2.5, 6.0, 6.0, 8.0, 9.5, 11.5],
        [1.5, 2.5, 4.5, 6.0, 6.0, 7.0, 9.0, 9.5],
    ]
    assert tl.makespan == 11.5
    assert simulate(lowered, plain, memory=False, rendezvous=True).makespan == 10.5
    # the default model (sends never wait for their receive) has no late receives
    assert (
        simulate(lowered, late, memory=False).makespan
        == simulate(lowered, plain, memory=False).makespan
    )
    # lowered knowing the late time, rank 1 posts RECV_F1 before B0: a 0.5 ms hand-off while
    # rank 0 waits anyway, B0 half a millisecond later, and no late message: 11.0
    chosen = insert_comms(build_schedule("1f1b", 2, 2), late)
    assert str(chosen).splitlines()[1] == "1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1"
    assert simulate(chosen, late, memory=False, rendezvous=True).makespan == 11.0
    # GPipe's last stage posts its receives as the step begins: none is late
    gpipe = insert_comms(build_schedule("gpipe", 2, 4), plain)
    assert (
        simulate(gpipe, late, memory=False, rendezvous=True).makespan
        == simulate(gpipe, plain, memory=False, rendezvous=True).makespan
    )


@pytest.mark.parametrize(
    "late, said",
    [([0.4], "each at least its cut's transfer time"), ([float("nan")], "not a finite time"),
     ([1.0, 1.0], "2 values for 1 cuts")],
)  # fmt: skip
def test_late_transfer_times_are_checked(late, said):
    from schedules import Costs, simulate

    costs = Costs([1.0, 1.0], [2.0, 2.0], transfer=[0.5], late_transfer=late)
    with pytest.raises(ValueError, match=said):
        simulate(build_schedule("1f1b", 2, 2), costs, memory=False, rendezvous=True)


def test_which_stages_post_their_forward_receives_ahead():
    """Only a stage alone on its rank, fed from another rank, on a rank that runs every forward
    first (GPipe), in a chain; and not one that keeps activations lighter than its input."""
    from schedules import Costs
    from schedules.memory import StageBytes

    for K in (2, 3, 4):
        assert comm.preposted(build_schedule("gpipe", K, 6)) == set(range(1, K))
        for kind in ("1f1b", "zb-h1"):
            assert comm.preposted(build_schedule(kind, K, 6)) == set()
        assert comm.preposted(build_schedule("1f1b", K, 1)) == set(range(1, K))  # F then B
        # a rank's operations in the order posted (NCCL): only the last stage sends nothing on
        ordered = Costs([1.0] * K, [1.0] * K, ordered_p2p=True)
        assert comm.preposted(build_schedule("gpipe", K, 6), ordered) == {K - 1}
    assert comm.preposted(build_schedule("interleaved-1f1b", 2, 4)) == set()  # 2 stages a rank
    routed = build_schedule("gpipe", 3, 4)
    routed.routes = [(0, 1), (0, 2), (1, 2)]
    assert comm.preposted(routed) == set()
    # by the bytes: a stage whose input outweighs its activations (never) ...
    sched = build_schedule("gpipe", 2, 4)
    big_input = StageBytes(input=10, activations=8, remat_live=1, forward_live=1)
    fine = StageBytes(input=4, activations=8, remat_live=1, forward_live=1)
    for b, mode, want in [
        (big_input, "never", set()),
        (fine, "never", {1}),
        (big_input, "always", {1}),  # every forward keeps only its input
        (big_input, "except_last", {1}),
    ]:
        costs = Costs([1.0, 1.0], [1.0, 1.0], recompute=["never", mode], memory=[fine, b])
        assert comm.preposted(sched, costs) == want, (b, mode)


def test_a_program_not_proven_to_meet_is_timed_as_gloo_runs_it():
    """CROSSED hangs where sends block; its program says RENDEZVOUS = False and runs on gloo,
    waiting for its receives only. Timed so, with free links, it is what the default model
    gives the same lowered schedule (sends never wait, each receive waits for its message)."""
    from schedules import Costs, simulate

    crossed = parse_schedule(CROSSED)
    costs = Costs([1.0, 1.5], [2.0, 3.0], input_grad=[1.0, 1.0], weight_grad=[1.0, 2.0])
    timed = simulate(crossed, costs, memory=False, rendezvous=True)
    free = simulate(crossed, costs, memory=False)
    assert timed.makespan == free.makespan
    for r, acts in crossed.ranks.items():  # every compute action at the same time
        on = [k for k, a in enumerate(acts) if a.kind.is_compute]
        assert [timed.starts[r][k] for k in on] == [free.starts[r][k] for k in on]
        assert [timed.ends[r][k] for k in on] == [free.ends[r][k] for k in on]
    # and one that cannot run even so is refused with the grid
    stuck = parse_schedule("0: 0F0 0RECV_B0 0B0 0SEND_F0\n1: 1RECV_F0 1F0 1B0 1SEND_B0")
    with pytest.raises(ScheduleError, match="rank"):
        simulate(stuck, Costs.uniform(2), rendezvous=True)


def test_skips_are_timed_as_they_run():
    """Two branches (0 -> 1 -> 3 and 0 -> 2 -> 3): stage 2 takes nothing from stage 1 and
    gives it no gradient. Each input comes from the stage that made it, each message between
    neighbours is charged its link and a skip nothing of its own (its bytes are the next
    stage's link's, as the default model charges them). So the branches run side by side,
    where the default model takes the stages in chain order."""
    import dataclasses

    from schedules import Costs, simulate

    sched = dataclasses.replace(
        build_schedule("1f1b", 4, 4), routes=[(0, 1), (0, 2), (1, 3), (2, 3)]
    )
    costs = Costs.uniform(4, transfer=[0.5, 0.5, 0.5])
    lowered = insert_comms(sched, costs)
    validate(lowered, rendezvous=True)
    timed = simulate(lowered, costs, memory=False, rendezvous=True)
    # only the messages between neighbours take a link: 0-1 and 2-3 (1-2 carries none)
    assert sorted({(d, c) for d, c, *_ in timed.raw_transfers}) == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert len(timed.raw_transfers) == 4 * 4
    # stage 2's first forward: stage 0's (1 ms), its skip free, so at 1.0, not after stage 1
    rank2 = lowered.ranks[2]
    f0 = rank2.index(next(a for a in rank2 if str(a) == "2F0"))
    assert timed.starts[2][f0] == 1.0
    assert simulate(sched, costs, memory=False).makespan == 26.0 > timed.makespan == 21.0
    # a chain is never faster timed so
    chain = build_schedule("1f1b", 4, 4)
    assert simulate(chain, costs, memory=False, rendezvous=True).makespan >= (
        simulate(chain, costs, memory=False).makespan
    )


def _drawn_schedule(data):
    """A generated schedule of each kind, on 2 to 4 ranks (an even count interleaved), M 1-8."""
    name = data.draw(st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]))
    K, M = data.draw(st.sampled_from([2, 3, 4])), data.draw(st.integers(1, 8))
    if name == "interleaved-1f1b":
        K, M = 2 * (K // 2), (M + 1) // 2 * 2 if M > 1 else M
    return build_schedule(name, K, M)


def _random_costs(data, S):
    from schedules import Costs

    t = st.floats(0.0, 5.0, allow_nan=False)
    f, i, w = (data.draw(st.lists(t, min_size=S, max_size=S)) for _ in range(3))
    link = data.draw(st.lists(st.floats(0.0, 2.0), min_size=S - 1, max_size=S - 1))
    return Costs(f, [a + b for a, b in zip(i, w)], input_grad=i, weight_grad=w, transfer=link)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_lowering_chosen_by_time_meets_and_is_the_fastest_tried(data):
    """With costs, insert_comms returns a lowering that meets where sends block, keeps each
    rank's compute in order, and is as fast as the plain one and the time steps, as simulated;
    none beats the compute-only timeline, where no send waits (a lower bound)."""
    from schedules import simulate

    sched = _drawn_schedule(data)
    costs = _random_costs(data, sched.num_stages)
    chosen = insert_comms(sched, costs)
    validate(chosen, rendezvous=True)
    for r, acts in sched.ranks.items():
        assert [a for a in chosen.ranks[r] if a.kind.is_compute] == acts
    best = simulate(chosen, costs, memory=False, rendezvous=True).makespan
    chose_by = comm.fastest_lowering(sched, costs)[1]  # the time it chose it by
    crosses = any(not a.kind.is_compute for acts in chosen.ranks.values() for a in acts)
    assert chose_by == best if crosses else chose_by is None
    floor = simulate(sched, costs, memory=False).makespan
    assert best >= floor - 1e-9
    for other in (insert_comms(sched), comm._lockstep(sched)):
        if other is not None and comm._meets(other):
            assert best <= simulate(other, costs, memory=False, rendezvous=True).makespan + 1e-9
    _vetted_alike(sched, costs)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_the_lowering_search_stops_early_and_still_keeps_the_first_of_the_fastest(data):
    """fastest_lowering stops a run once it is sure to lose, looks near the compute-only
    timeline first, and ends where a lowering matches that timeline. It keeps what running
    every lowering in full keeps (the first of the fastest, in the order tried): held here
    against that exhaustive search, on chains with links, late receives, runtime costs and
    recomputation, compute as cheap as the links or far dearer. The premise of the early end:
    on a chain, no lowering tried beats the compute-only timeline."""
    from schedules import Costs

    sched = _drawn_schedule(data)
    S = sched.num_stages
    base = _random_costs(data, S)
    late = [x + data.draw(st.floats(0.0, 2.0)) for x in base.transfer]
    small = st.floats(0.0, 0.5)
    scale = data.draw(st.sampled_from([1.0, 30.0]))  # (dear compute: a lowering often near)
    costs = Costs(
        [x * scale for x in base.forward], [x * scale for x in base.backward],
        input_grad=[x * scale for x in base.input_grad],
        weight_grad=[x * scale for x in base.weight_grad],
        transfer=base.transfer, late_transfer=data.draw(st.sampled_from([None, late])),
        recompute=data.draw(st.sampled_from([None, ["always"] * S, ["except_last"] * S])),
        action_overhead=data.draw(small), call_overhead=data.draw(small),
        step_overhead=data.draw(small),
    )  # fmt: skip
    _as_the_exhaustive_search(sched, costs)


def test_a_lowering_near_the_timeline_does_not_end_the_search():
    """Found by a cold review: ending the search at the first lowering within 1% of the
    compute-only timeline, rather than at one that matches it, kept the plain lowering (1608)
    where a later one (placed late) takes 1605; the drawn costs above seldom reach that case."""
    from schedules import Costs

    sched = build_schedule("zb-h1", 6, 6)
    costs = Costs([101.0, 41.0, 1.0, 21.0, 61.0, 1.0], [82.0, 2.0, 182.0, 62.0, 82.0, 122.0],
                  input_grad=[61.0, 1.0, 81.0, 21.0, 1.0, 21.0],
                  weight_grad=[21.0, 1.0, 101.0, 41.0, 81.0, 101.0], transfer=[0.0] * 5,
                  late_transfer=[0.0, 0.0, 3.0, 1.0, 0.0], action_overhead=1.0)  # fmt: skip
    assert _as_the_exhaustive_search(sched, costs) == 1605.0


def _as_the_exhaustive_search(sched, costs):
    """fastest_lowering's answer is the exhaustive search's (every lowering run in full, the
    first of the fastest kept), and no lowering beats the compute-only timeline; a run told to
    beat less than it takes stops, one told its own time runs through. Its makespan."""
    import math

    from schedules import simulate
    from schedules.simulate import blocking_makespan

    floor = simulate(sched, costs, memory=False).makespan
    tl = simulate(sched.compute_only(), costs, memory=False)
    tried = [comm._plain(sched), comm._lockstep(sched), *comm._timed_all(sched, tl)]
    best = None
    for lowered in tried:
        if lowered is None:
            continue
        t = blocking_makespan(lowered, costs)
        if t is not None:
            assert t >= floor - 1e-9 * max(1.0, floor)
            if best is None or t < best[0]:
                best = (t, lowered)
        if t is not None and t > 0:
            assert blocking_makespan(lowered, costs, beat=t * (1 - 1e-6) - 1e-6) == math.inf
            assert blocking_makespan(lowered, costs, beat=t) == t
    chosen, t = comm.fastest_lowering(sched, costs)
    crosses = any(not a.kind.is_compute for acts in tried[0].ranks.values() for a in acts)
    if best is None or not crosses:  # (nothing to time where nothing crosses ranks)
        assert t is None
        return None
    assert t == best[0]
    assert chosen.ranks == best[1].ranks
    return t


def test_zero_bubble_takes_each_gradient_before_its_next_forward():
    """zb-h1 on 2 ranks. Plain, rank 0 batches SEND_F(m + 1) with RECV_B(m), and rank 1 takes
    F(m + 1) after its W(m - 1): rank 0 waits in that batch through every W of rank 1. Chosen
    by time, rank 0 takes B(m) as soon as it is made, before F(m + 1), and sends F(m + 1)
    alone; 14% faster here, 15% over the compute-only timeline (a send waits for its receive)."""
    from schedules import Costs, simulate

    sched = build_schedule("zb-h1", 2, 8)
    costs = Costs([10.0, 10.0], [28.0, 29.0], input_grad=[11.0, 11.5], weight_grad=[17.0, 17.5],
                  transfer=[0.2])  # fmt: skip
    plain, chosen = insert_comms(sched), insert_comms(sched, costs)
    slow = simulate(plain, costs, memory=False, rendezvous=True).makespan
    fast = simulate(chosen, costs, memory=False, rendezvous=True).makespan
    floor = simulate(sched, costs, memory=False).makespan
    assert fast < 0.9 * slow and floor <= fast
    first = [str(a) for a in chosen.ranks[0]]
    assert (
        first.index("0RECV_B1") < first.index("0F2") < first.index("0SEND_F2") < first.index("0I1")
    )
    assert [str(a) for a in plain.ranks[0]][8:10] == ["0SEND_F2", "0RECV_B1"]


def test_the_targets_sample_count_every_rank_checks():
    from codegen._dist_runtime import _samples

    t = torch.zeros
    assert _samples(None) == 0 and _samples("labels") == 0 and _samples(()) == 0
    assert _samples(t(9)) == 9 and _samples((t(9, 2), t(9), "x")) == 9
    assert _samples(t(())) == -1  # no batch dimension
    assert _samples((t(9), t(8))) == -1  # tensors that disagree


def test_gradients_received_ahead_of_their_backward_are_counted_on_the_reader():
    """A lowering may post a gradient's receive before another compute action of the reading
    rank (to meet its sender): that rank holds it from then, which the issue-order memory
    counts on the sender until the reading B (or I) starts. Counted per route where the split
    says what each carries, at the sender's whole gradient where it does not; a receive
    posted right before its reader, none."""
    from schedules.comm import received_ahead

    routed = parse_schedule(
        """
        0: 0F0 0SEND_F0@1 0SEND_F0@2 0F1 0SEND_F1@1 0SEND_F1@2 0RECV_B1@2 0RECV_B1@1 0RECV_B0@2 0B1 0RECV_B0@1 0B0
        1: 1RECV_F0@0 1F0 1SEND_F0@2 1RECV_F1@0 1F1 1SEND_F1@2 1RECV_B1@2 1B1 1SEND_B1@0 1RECV_B0@2 1B0 1SEND_B0@0
        2: 2RECV_F0@0 2RECV_F0@1 2F0 2RECV_F1@0 2RECV_F1@1 2F1 2B1 2SEND_B1@0 2SEND_B1@1 2B0 2SEND_B0@0 2SEND_B0@1
        """
    )  # fmt: skip
    routed.routes = [[0, 1], [0, 2], [1, 2]]
    validate(routed, rendezvous=True)
    grads = [0, 100, 1000]
    held = received_ahead(routed, grads, [None, {0: 100}, {0: 300, 1: 700}])
    assert {str(a): n for a, n in held.items()} == {"0B1": 300}
    held = received_ahead(routed, grads)  # (each at its sender's whole)
    assert {str(a): n for a, n in held.items()} == {"0B1": 1000}
    # zero bubble on a chain: micro-batch 1's gradient taken before W0
    chain = parse_schedule(
        """
        0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0I0 0RECV_B1 0W0 0I1 0W1
        1: 1RECV_F0 1F0 1I0 1SEND_B0 1RECV_F1 1F1 1I1 1SEND_B1 1W0 1W1
        """
    )
    validate(chain, rendezvous=True)
    assert {str(a): n for a, n in received_ahead(chain, [0, 64]).items()} == {"0W0": 64}
    posted_late = parse_schedule(str(chain).replace("0RECV_B1 0W0 0I1", "0W0 0RECV_B1 0I1"))
    assert received_ahead(posted_late, [0, 64]) == {}
    # the device's peak takes it only where it is held: during W0 here, above what W0 holds
    from schedules.memory import StageBytes, peaks

    sizes = [StageBytes(activations=10, weight_live=5, input_live=1000), StageBytes()]
    base = peaks(chain, "never", sizes)
    assert peaks(chain, "never", sizes, received_ahead(chain, [0, 64]))[0] == base[0]
    sizes[0] = StageBytes(activations=10, weight_live=5000, input_live=1000)
    base = peaks(chain, "never", sizes)
    assert peaks(chain, "never", sizes, received_ahead(chain, [0, 64]))[0] == base[0] + 64


def test_a_chains_messages_are_counted_where_its_torchrun_program_holds_them():
    """1F1B on 2 ranks, 3 micro-batches, written out: the issue order has F0 of stage 0 hand
    micro-batch 1's activations (10 bytes) to rank 1 before 1F0, but rank 1 posts that receive
    only after B0 (plain lowering): 10 bytes fewer during 1F0 and 1B0. Posted with B0's
    batch (the time steps), fewer only during 1F0. In the batch after 0F1, rank 0 holds F1's
    output while it goes and the buffer B0's gradient (100 bytes) is received into: 110 the
    issue order has nowhere. A program that does not meet holds every send to the step's end:
    rank 0 its activations, rank 1 its gradients."""
    from schedules.comm import receive_offsets

    sched = build_schedule("1f1b", 2, 3)
    plain, stepped = comm._plain(sched), comm._lockstep(sched)
    assert "0F1 0SEND_F1 0RECV_B0 0B0" in str(plain)
    assert "1B0 1SEND_B0 1RECV_F1 1F1" in str(plain) and "1RECV_F1 1B0" in str(stepped)

    def offsets(lowered, **kw):
        during, after = receive_offsets(lowered, [0, 10], [0, 100], **kw)
        return {str(a): n for a, n in during.items()}, {str(a): n for a, n in after.items()}

    assert offsets(plain) == (
        {"1F0": -10, "1B0": -10},
        {"0F0": 10, "0F1": 110, "0F2": 110, "0B1": 100, "1F0": -10, "1B1": 10},
    )
    assert offsets(stepped)[0] == {"1F0": -10}
    assert offsets(plain, sends_held=True)[0] == {
        "0F1": 10, "0B0": 20, "0F2": 20, "0B1": 30, "0B2": 30,
        "1F0": -10, "1B0": -10, "1F1": 100, "1B1": 100, "1F2": 200, "1B2": 200,
    }  # fmt: skip
    # posted as the step begins: micro-batch 2's held from the start too, until 1F2
    assert offsets(plain, preposted=frozenset({1}))[0] == {
        "1F0": 10,
        "1B0": 10,
        "1F1": 10,
        "1B1": 10,
    }


def test_a_stage_taking_a_skip_has_its_messages_counted_where_its_program_holds_them():
    """1F1B on 3 ranks, 2 micro-batches, stage 2 taking 200 bytes from stage 1 and 100 from
    stage 0 (a skip), and sending back 260 and 40 of their gradients; written out. Issue
    order: 0F0 0F1 1F0 1F1 2F0 2B0 1B0 2F1 2B1 0B0 1B1 0B1. It counts micro-batch 1's 300
    bytes on rank 2 from 1F1 on, and the 40 of micro-batch 0's gradient for stage 0 until
    0B0; rank 2 posts that receive only after 2B0, and the gradients go in the batch after
    2B0: 300 fewer during 2F0 and 2B0 (and after 2F0), 40 fewer during 2F1 and 2B1 (and
    after them). Rank 1 holds its 200 bytes while its send goes (after 1F0, 1F1). Without
    the far senders' bytes the stage is counted as the issue order has it."""
    from schedules.comm import receive_offsets
    from schedules.ir import Schedule

    s = build_schedule("1f1b", 3, 2)
    plain = comm._plain(Schedule(s.name, 3, 2, s.ranks, s.placement, [(0, 1), (0, 2), (1, 2)]))
    assert "2F0 2B0 2SEND_B0 2RECV_F1 2F1" in str(plain)

    def offsets(**kw):
        during, after = receive_offsets(plain, [0, 10, 300], [0, 10, 300], **kw)
        return {str(a): n for a, n in during.items()}, {str(a): n for a, n in after.items()}

    back = {"0F0": 10, "0F1": 320, "0B0": 310, "1F1": 300, "1B0": 300}  # (received ahead)
    assert offsets() == ({"1F0": -10}, back)
    assert offsets(far_bytes=[(0, 0), (0, 0), (100, 40)]) == (
        {"1F0": -10, "2F0": -300, "2B0": -300, "2F1": -40, "2B1": -40},
        {**back, "1F0": 200, "1F1": 500, "2F0": -300, "2F1": -40, "2B1": -40},
    )
    # (a plan whose far part says more than the whole, edited by hand: taken as the whole)
    whole = offsets(far_bytes=[(0, 0), (0, 0), (300, 300)])
    assert offsets(far_bytes=[(0, 0), (0, 0), (900, 900)]) == whole
    assert "1F0" not in whole[1]  # (all of it from stage 0: rank 1 sends stage 2 nothing)


def _held_by_program(lowered, inputs, grads, preposted, sends_held):
    """Per compute action: the bytes of a chain's messages its rank holds then, and while the
    batch of sends and receives after it goes, walking each rank's program alone. A sender
    holds what it made until the batch that posts its send has gone (to the step's end where
    sends are held); a receiver holds what it receives from the batch that posts the receive
    (a preposted stage: from the start) until the action reading it."""
    place, S = lowered.placement, lowered.num_stages
    during, after = {}, {}
    for r, acts in lowered.ranks.items():
        held = {}  # (direction, stage that reads it, micro-batch) -> bytes
        going = []  # sent in the batch now posted: let go once it has gone
        for t in preposted:
            if place[t] == r:
                held.update({("F", t, m): inputs[t] for m in range(lowered.num_microbatches)})
        last = None
        for a in acts:
            s, m = a.stage, a.microbatch
            if a.kind == Kind.RECV_F:
                held[("F", s, m)] = inputs[s]
            elif a.kind == Kind.RECV_B:
                held[("B", s, m)] = grads[s + 1]
            elif a.kind == Kind.SEND_F and not sends_held:
                going.append(("F", s + 1, m))
            elif a.kind == Kind.SEND_B and not sends_held:
                going.append(("B", s - 1, m))
            elif a.kind.is_compute:
                if last is not None:
                    after[last] = sum(held.values())
                for key in going:
                    held.pop(key, None)
                going = []
                reads = ("F", s, m) if a.kind == Kind.F else ("B", s, m)
                if a.kind != Kind.W:
                    held.pop(reads, None)  # it reads it: counted in its states from here
                during[a] = sum(held.values())
                if a.kind == Kind.F and s < S - 1 and place[s + 1] != r:
                    held[("F", s + 1, m)] = inputs[s + 1]
                if a.kind in (Kind.B, Kind.I) and s > 0 and place[s - 1] != r:
                    held[("B", s - 1, m)] = grads[s]
                last = a
        after[last] = sum(held.values())
    return during, after


def _held_by_issue_order(lowered, inputs, grads):
    """Per compute action: the bytes of a chain's messages the issue-order memory counts on its
    rank while it runs, and once it has ended: an activation on its receiver from the forward
    that made it to the one reading it, a gradient on its sender from the backward that made
    it to the one reading it."""
    from schedules.order import canonical_order

    order = [a for a in canonical_order(lowered.compute_only(), ["never"] * lowered.num_stages)]
    at = {(a.kind, a.stage, a.microbatch): k for k, a in enumerate(order)}
    place = lowered.placement

    def bwd(s, m):
        return at.get((Kind.B, s, m), at.get((Kind.I, s, m)))

    during, after = {}, {}
    for k, x in enumerate(order):
        n = ended = 0
        for t in range(1, lowered.num_stages):
            if place[t - 1] == place[t] or place[t] != place[x.stage]:
                continue
            for m in range(lowered.num_microbatches):
                made, read = at[(Kind.F, t - 1, m)], at[(Kind.F, t, m)]
                n += inputs[t] * (made < k < read)
                ended += inputs[t] * (made <= k < read)
                made, read = bwd(t, m), bwd(t - 1, m)
                n += grads[t] * (made < k < read)
                ended += grads[t] * (made <= k < read)
        during[x], after[x] = n, ended
    return during, after


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_receive_offsets_make_the_issue_order_what_each_program_holds(data):
    """For every lowering of a chain (plain, time steps, placed by a timeline), every schedule,
    posted ahead or not, sends held or not: the issue order's count of the chain's messages at
    each compute action, and once it has ended, plus receive_offsets' figures there, is what
    the rank's program holds while the action runs, and while the batch after it goes, found
    by walking the program alone."""
    from schedules import simulate
    from schedules.comm import receive_offsets

    sched = _drawn_schedule(data)
    S = sched.num_stages
    tl = simulate(sched, _random_costs(data, S), memory=False)
    lowered = data.draw(st.sampled_from(
        [x for x in [comm._plain(sched), comm._lockstep(sched),
                     *[comm._timed(sched, tl, how) for how in comm._HOW]] if x is not None]
    ))  # fmt: skip
    inputs = [0] + data.draw(st.lists(st.integers(1, 1000), min_size=S - 1, max_size=S - 1))
    grads = [0] + data.draw(st.lists(st.integers(1, 1000), min_size=S - 1, max_size=S - 1))
    pre = data.draw(st.sampled_from([frozenset(), comm.preposted(lowered)]))
    held = data.draw(st.booleans())
    offsets = receive_offsets(lowered, inputs, grads, preposted=pre, sends_held=held)
    counted = _held_by_issue_order(lowered, inputs, grads)
    program = _held_by_program(lowered, inputs, grads, pre, held)
    for when in (0, 1):  # while each action runs, and in the batch after it
        assert set(program[when]) == set(counted[when])
        for a, n in program[when].items():
            assert counted[when][a] + offsets[when].get(a, 0) == n, (when, str(a), str(lowered))
