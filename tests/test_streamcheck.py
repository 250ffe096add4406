"""The stream checker (codegen/_streamcheck.py): its happens-before rules on hand-written stream
code, a clean verdict on every program we generate, and a report for each ordering an emitted
program loses when one of its waits, events or record_streams is taken out."""

from __future__ import annotations

import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from codegen import check_streams, emit_program
from codegen._streamcheck import StreamCheck, check_pipeline
from planner import Cluster, plan_pipeline
from profiler.examples import gpt, mlp, resnet, transformer, unet
from profiler.graph import capture
from tests.conftest import even_times, mixed_plan, quick_profile

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
MODES = ["never", "except_last", "always"]
N = 8


# -- the rules, on hand-written stream code ------------------------------------------------------


def test_a_read_on_another_stream_needs_an_event_or_a_stream_wait():
    for join in ("none", "event", "stream"):
        with StreamCheck() as check:
            a, b = torch.cuda.Stream("cuda:0"), torch.cuda.Stream("cuda:0")
            with torch.cuda.stream(a):
                t = torch.ones(4, device="cuda:0")
                done = torch.cuda.Event()
                done.record(a)
            if join == "event":
                b.wait_event(done)
            elif join == "stream":
                b.wait_stream(a)
            with torch.cuda.stream(b):
                (t * 2).sum()
                t.record_stream(b)
            del t
        if join == "none":
            assert len(check.problems) == 1, check.problems
            assert "reads float32[4] made by aten.ones.default" in check.problems[0]
            assert "on stream 1 of cuda:0, but its write on stream 0 of cuda:0" in check.problems[0]
        else:
            assert check.problems == [], join


def test_an_event_recorded_before_the_write_does_not_order_it():
    with StreamCheck() as check:
        a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
        early = torch.cuda.Event()
        early.record(a)  # before the write: waiting on it orders nothing of the write
        with torch.cuda.stream(a):
            t = torch.zeros(3, device="cuda:0")
        b.wait_event(early)
        with torch.cuda.stream(b):
            t.add_(1)
        t.record_stream(b)
    assert len(check.problems) == 1 and "writes float32[3]" in check.problems[0]


def test_a_write_racing_a_pending_read_is_reported():
    with StreamCheck() as check:
        a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
        with torch.cuda.stream(a):
            t = torch.zeros(3, device="cuda:0")
        b.wait_stream(a)
        with torch.cuda.stream(b):
            u = t + 1  # b reads t
        with torch.cuda.stream(a):
            t.mul_(2)  # a writes t while b's read may be pending
        t.record_stream(b)
        del u
    assert len(check.problems) == 1
    assert "writes float32[3]" in check.problems[0] and "may still be pending" in check.problems[0]


def test_a_free_into_the_default_pool_is_safe_after_it_waits_and_reported_when_moved_before():
    """Code outside the pipeline allocates from the default stream's pool at any time: memory
    freed into it must be done with everywhere by then."""
    for free_early in (False, True):
        with StreamCheck() as check:
            b = torch.cuda.Stream(0)
            t = torch.zeros(5, device="cuda:0")  # from the default stream's pool
            b.wait_stream(torch.cuda.current_stream(0))
            with torch.cuda.stream(b):
                t.sum()
            if free_early:
                del t  # back to the default pool while b's read may be running
                torch.cuda.current_stream(0).wait_stream(b)
            else:
                torch.cuda.current_stream(0).wait_stream(b)
                del t
        if free_early:
            assert len(check.problems) == 1, check.problems
            assert "float32[5] made by aten.zeros.default" in check.problems[0]
            assert (
                "goes back to the memory pool of the default stream of cuda:0"
                in (check.problems[0])
            )
            assert "no record_stream names stream 0 of cuda:0" in check.problems[0]
        else:
            assert check.problems == []


def test_memory_freed_into_a_streams_own_pool_must_be_done_with_by_its_next_allocation():
    """The caching allocator hands freed memory to the next allocation on the same stream:
    a wait before that allocation is in time, an allocation before the wait is not."""
    for allocate_first in (False, True):
        with StreamCheck() as check:
            a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
            with torch.cuda.stream(a):
                t = torch.zeros(5, device="cuda:0")  # from a's pool
            b.wait_stream(a)
            with torch.cuda.stream(b):
                t.sum()
            del t  # back to a's pool while b's read may be running
            if allocate_first:
                with torch.cuda.stream(a):
                    torch.ones(5, device="cuda:0")
            a.wait_stream(b)
            with torch.cuda.stream(a):
                torch.ones(5, device="cuda:0")
        if allocate_first:
            assert len(check.problems) == 1, check.problems
            assert (
                "stream 0 of cuda:0 allocates while memory it freed (float32[5] made by "
                in (check.problems[0])
            )
        else:
            assert check.problems == []


def test_record_stream_makes_an_unordered_free_safe():
    for record in (False, True):
        with StreamCheck() as check:
            b = torch.cuda.Stream(0)
            t = torch.zeros(2, device="cuda:0")
            b.wait_stream(torch.cuda.current_stream(0))
            with torch.cuda.stream(b):
                t.sum()
            if record:
                t.record_stream(b)
            del t
        assert len(check.problems) == (0 if record else 1)


def test_to_copies_where_cuda_copies_and_returns_the_tensor_itself_where_it_does_not():
    with StreamCheck() as check:
        t = torch.ones(4, device="cuda:0")
        assert t.to("cuda:0") is t and t.to(t) is t and t.cuda(0) is t
        assert t.to("cuda:1") is not t and t.to("cuda:1").device == torch.device("cuda:1")
        assert t.to(torch.float64) is not t and t.to(torch.float64).device.index == 0
        assert t.to("cuda:0", copy=True) is not t
        h = t.cpu()
        assert h is not t and h.device.type == "cpu"
        h.add_(1)
        assert float(t.sum()) == 4.0  # a copy: t unchanged
        # a blocking copy to the host waits for the stream that wrote t; later work follows
        b = torch.cuda.Stream(0)
        with torch.cuda.stream(b):
            t.sum()
        t.record_stream(b)
    assert check.problems == []


def test_a_same_device_to_is_no_copy_so_its_race_is_seen():
    """`.to()` onto the device a tensor is on returns the tensor: writing the result writes it."""
    with StreamCheck() as check:
        a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
        t = torch.ones(3, device="cuda:0")
        a.wait_stream(torch.cuda.current_stream(0))
        b.wait_stream(torch.cuda.current_stream(0))
        with torch.cuda.stream(b):
            t.sum()
        with torch.cuda.stream(a):
            t.to("cuda:0").mul_(3)
        t.record_stream(a)
        t.record_stream(b)
    assert len(check.problems) == 1 and "may still be pending" in check.problems[0]


def test_synchronize_waits_for_one_device_only():
    for device in (0, 1):
        with StreamCheck() as check:
            a, b = torch.cuda.Stream(1), torch.cuda.Stream(1)
            with torch.cuda.stream(a):
                t = torch.ones(4, device="cuda:1")
            torch.cuda.synchronize(device)
            with torch.cuda.stream(b):
                t.sum()
            t.record_stream(b)
        assert len(check.problems) == (1 if device == 0 else 0), device


def test_a_stream_made_after_the_host_waited_comes_after_what_it_waited_for():
    with StreamCheck() as check:
        a = torch.cuda.Stream(0)
        with torch.cuda.stream(a):
            t = torch.ones(4, device="cuda:0")
        torch.cuda.synchronize(0)
        later = torch.cuda.Stream(0)
        with torch.cuda.stream(later):
            t.sum()
        t.record_stream(later)
    assert check.problems == []


def test_views_and_in_place_views_touch_no_memory():
    with StreamCheck() as check:
        a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
        with torch.cuda.stream(a):
            t = torch.ones(4, device="cuda:0")
        with torch.cuda.stream(b):
            t.unsqueeze_(0)
            t.view(2, 2).t()
            t.detach_()
    assert check.problems == []


def test_an_operation_on_two_devices_is_reported():
    with StreamCheck() as check:
        (torch.ones(2, device="cuda:0") + torch.ones(2, device="cuda:1")).sum()
    assert check.problems  # (then, as the checker charges it to cuda:0, its streams' too)
    assert (
        "aten.add.Tensor takes tensors of cuda:0 and cuda:1, which a GPU refuses"
        in (check.problems[0])
    )


def test_a_host_tensor_in_a_gpu_operation_is_reported_but_a_host_scalar_is_not():
    with StreamCheck() as check:
        t = torch.ones(3, device="cuda:0")
        (t * torch.tensor(2.0)).sum()  # a 0-d host tensor: CUDA takes it as a scalar
    assert check.problems == []
    with StreamCheck() as check:
        (torch.ones(3, device="cuda:0") * torch.ones(3)).sum()
    assert check.problems == [
        "outside the step: aten.mul.Tensor takes a host tensor (float32[3]) with tensors of "
        "cuda:0, which a GPU refuses"
    ]


def test_the_stand_in_takes_what_models_commonly_do_on_a_gpu():
    with StreamCheck() as check:
        x = torch.ones(2, device="cuda:1")
        made = [
            torch.tensor([1.0, 2.0], device=x.device),
            torch.as_tensor([3.0, 4.0], device="cuda:1"),
            x.new_tensor([5.0, 6.0]),
            torch.arange(2, device=x.device).float(),
        ]
        assert all(t.device == torch.device("cuda:1") for t in made) and x.get_device() == 1
        side = torch.cuda.Stream(1)
        side.wait_stream(torch.cuda.current_stream(1))
        with side:
            assert torch.cuda.current_stream(1) is side
            total = sum(made) + x
        torch.cuda.current_stream(1).wait_stream(side)
        for t in [*made, x]:
            t.record_stream(side)
        assert total.tolist() == [10.0, 14.0]  # [1+3+5+0+1, 2+4+6+1+1]
        with torch.cuda.device(0):
            assert torch.cuda.current_device() == 0
        with pytest.raises(TypeError, match="copy it to the host first"):
            x.numpy()
        assert x.cpu().numpy().tolist() == [1.0, 1.0]
    assert check.problems == []


def test_torch_is_restored_when_the_checked_code_raises():
    stream, to = torch.cuda.Stream, torch.Tensor.to
    with pytest.raises(ZeroDivisionError), StreamCheck():
        torch.ones(2, device="cuda:0")
        raise ZeroDivisionError
    assert torch.cuda.Stream is stream and torch.Tensor.to is to
    assert "device" not in torch.Tensor.__dict__ and torch.ones(1).device.type == "cpu"
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


def test_a_copy_between_devices_runs_on_the_source_stream_and_orders_the_destinations():
    """As CUDA does it: after the destination's current stream, on the source's current
    stream, into the destination's memory, and before the destination's later work."""
    with StreamCheck() as check:
        dest, other = torch.cuda.Stream(1), torch.cuda.Stream(1)
        t = torch.ones(4, device="cuda:0")
        with torch.cuda.stream(dest):
            moved = t.to("cuda:1", non_blocking=True)
            assert moved.device == torch.device("cuda:1") and moved.is_cuda
            (moved * 2).sum()  # the destination's current stream: ordered after the copy
        with torch.cuda.stream(other):
            (moved * 3).sum()  # another stream of the destination: not ordered
        moved.record_stream(other)
    assert len(check.problems) == 1
    assert (
        "on stream 1 of cuda:1, but its write on the default stream of cuda:0"
        in (check.problems[0])
    )


def test_synchronize_orders_everything_before_it():
    with StreamCheck() as check:
        a, b = torch.cuda.Stream(0), torch.cuda.Stream(0)
        with torch.cuda.stream(a):
            t = torch.ones(4, device="cuda:0")
        torch.cuda.synchronize()
        with torch.cuda.stream(b):
            t.sum()
        t.record_stream(b)
    assert check.problems == []


def test_the_stand_in_leaves_torch_as_it_found_it():
    stream, device, record = torch.cuda.Stream, torch.Tensor.device, torch.Tensor.record_stream
    with StreamCheck():
        assert torch.cuda.Stream is not stream
        t = torch.empty(3, device="cuda:2")
        assert t.device == torch.device("cuda:2") and torch.ones(1).device.type == "cpu"
    assert torch.cuda.Stream is stream and torch.Tensor.record_stream is record
    assert torch.Tensor.device is device and t.device.type == "cpu"
    assert "device" not in torch.Tensor.__dict__


# -- clean on what we generate -------------------------------------------------------------------


def small_mlp() -> nn.Sequential:
    return mlp(width=32, depth=4, batch=N)


def small_transformer() -> nn.Sequential:
    return transformer(vocab=64, d_model=32, heads=2, depth=6, seq_len=8, batch=N)


def _lm_loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, 64), t.reshape(-1))


@pytest.fixture(scope="module")
def profiles():
    out = {}
    for kind, build in (("mlp", small_mlp), ("transformer", small_transformer)):
        m = build()
        out[kind] = quick_profile(m, m.example_input, batch_sizes=[1, 2, 4])
    return out


def _data(kind: str):
    g = torch.Generator().manual_seed(0)
    if kind == "mlp":
        return (
            torch.randn(N, 32, generator=g),
            torch.randint(0, 10, (N,), generator=g),
            (nn.functional.cross_entropy),
        )
    return torch.randint(0, 64, (N, 8), generator=g), torch.randint(0, 64, (N, 8)), _lm_loss


def _check(kind: str, plan, devices=None, **kw) -> list[str]:
    build = small_mlp if kind == "mlp" else small_transformer
    x, y, loss_fn = _data(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_streams(build(), plan, x, y, loss_fn, devices, **kw)


@pytest.mark.parametrize("K", [2, 3, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode", MODES)
def test_every_schedule_and_mode_is_clean_on_gpus_of_its_own_and_on_one(
    profiles, K, schedule, mode
):
    M = 3 if (schedule == "interleaved-1f1b" and K == 3) else 4
    kind = "transformer" if K == 4 else "mlp"
    plan = plan_pipeline(
        profiles[kind], Cluster.uniform(K, "1GiB"), N, microbatches=M, schedule=schedule,
        recompute=mode,
    )  # fmt: skip
    assert (plan.schedule, plan.recompute, len(plan.devices)) == (schedule, mode, K)
    # one GPU per device, or all stages on streams of one GPU (gpu_check.py's layout)
    devices = [f"cuda:{k}" for k in range(K)] if (K + len(mode)) % 2 else ["cuda:0"] * K
    assert _check(kind, plan, devices) == []


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_per_stage_recomputation_is_clean(profiles, schedule):
    plan = mixed_plan(profiles["mlp"], Cluster.uniform(3, "1GiB"), N, 3, schedule)
    assert plan.recompute == "per_stage"
    assert _check("mlp", plan) == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_frozen_prefix_is_clean_without_waiting_for_gradients(schedule):
    """A frozen first stage gets no gradient back: its B moves nothing, and no longer makes
    its stream wait for the next stage's event (the plan times it so). Nothing it does races
    then (that it does not wait is not seen here: an extra wait is no race; the wait's cost
    shows on a GPU only, and none has run it)."""

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.ReLU())])
        model[:6].requires_grad_(False)
        return model

    x, y = torch.randn(N, 16), torch.randn(N, 16)
    prof = even_times(quick_profile(build(), x, batch_sizes=[2], loss_fn="mse"))
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), N, microbatches=4, schedule=schedule)
    assert plan.stages[1].layers[0] <= 6 and plan.stages[1].state_bytes.grad == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        problems = check_streams(build(), plan, x, y, nn.functional.mse_loss)
    assert problems == []


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_deferred_batch_norm_is_clean(schedule):
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32),
            nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4),
        )  # fmt: skip

    x = torch.randn(N, 16)
    prof = quick_profile(build(), x, batch_sizes=[2])
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), N, microbatches=4, schedule=schedule)
    y = torch.randint(0, 4, (N,))
    problems = check_streams(
        build(), plan, x, y, nn.functional.cross_entropy, deferred_batch_norm=True
    )
    assert problems == []


GRAPHS = {
    "unet": (lambda: unet(size=8), lambda x: torch.randn_like(x), nn.functional.mse_loss),
    "resnet": (
        lambda: resnet(widths=(4, 8), blocks=1, size=8),
        lambda x: torch.randint(0, 10, (x.shape[0],)),
        nn.functional.cross_entropy,
    ),
    "gpt (tied weights)": (
        lambda: gpt(vocab=64, d_model=32, heads=2, depth=2, seq_len=8),
        lambda x: torch.randint(0, 64, x.shape),
        _lm_loss,
    ),
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("schedule, recompute", [("1f1b", "never"), ("zb-h1", "always")])
def test_captured_graph_models_are_clean(name, schedule, recompute):
    make, target, loss_fn = GRAPHS[name]
    model = make()
    x = model.example_input
    layers = capture(model, x)
    prof = quick_profile(layers, x, batch_sizes=[2, 4])
    plan = plan_pipeline(
        prof, Cluster.uniform(2, "1GiB"), x.shape[0], microbatches=2, schedule=schedule,
        recompute=recompute,
    )  # fmt: skip
    assert check_streams(make(), plan, x, target(x), loss_fn) == []


# -- a checker that can fail: an emitted program with one ordering taken out --------------------

# (what is taken out, the line, what the first problem says)
MUTATIONS = {
    "the consumer's wait for a copy": (
        "        self.compute[dst].wait_event(copied)\n",
        "on stage 1's compute stream, but its write on",
    ),
    "the event on a left gradient": (
        "            made.record(self.compute[s])\n",
        "but its write on stage 1's compute stream (backward of stage 1, micro-batch 0)",
    ),
    "the compute streams' wait for the caller": (
        "                st.wait_stream(torch.cuda.current_stream(d))\n",
        "made by aten._to_copy.default (the caller, before step 0) on stage 0's compute stream",
    ),
    "the caller's wait for the pipeline": (
        "                    torch.cuda.current_stream(d).wait_stream(st)\n",
        "the caller, after step 0: reads",
    ),
    "record_stream on a received tensor": (
        "            t.record_stream(self.compute[dst])\n",
        "stage 1's receive stream allocates while memory it freed",
    ),
    "record_stream on a sent tensor": (
        "            t.record_stream(copier)\n",
        "'s compute stream allocates while memory it freed",
    ),
}


@pytest.fixture(scope="module")
def program(profiles):
    plan = plan_pipeline(
        profiles["mlp"], Cluster.uniform(2, "1GiB"), N, microbatches=4, schedule="1f1b"
    )
    return emit_program(plan)


@pytest.mark.parametrize("what", sorted(MUTATIONS))
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:1"], ["cuda:0", "cuda:0"]])
def test_taking_one_ordering_out_of_the_program_is_reported(program, what, devices):
    line, says = MUTATIONS[what]
    assert program.count(line) == 1, what
    indent = line[: len(line) - len(line.lstrip())]
    for source, broken in ((program, False), (program.replace(line, f"{indent}pass\n"), True)):
        module = types.ModuleType("program")
        exec(compile(source, "program.py", "exec"), module.__dict__)
        x, y, loss_fn = _data("mlp")
        problems = check_pipeline(
            lambda module=module: module.Pipeline(small_mlp(), devices), x, y, loss_fn
        )
        if not broken:
            assert problems == []
        else:
            assert problems, what
            assert any(says in p for p in problems), problems


def test_action_times_on_several_gpus_time_each_action_on_its_own_gpu(program):
    """CUDA times two events only on one device (the stand-in refuses as CUDA does): measure's
    action log on a pipe over two GPUs must not time one GPU's actions from another's event."""
    module = types.ModuleType("program")
    exec(compile(program, "program.py", "exec"), module.__dict__)
    x, y, loss_fn = _data("mlp")
    with StreamCheck():
        pipe = module.Pipeline(small_mlp(), ["cuda:0", "cuda:1"])
        pipe.action_log = []
        pipe.train_step(x.to("cuda:0"), y.to("cuda:0"), loss_fn)
        times = pipe.action_times()
        early, late = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        early.record(pipe.compute[0])
        late.record(pipe.compute[1])
        with pytest.raises(RuntimeError, match="two devices"):
            early.elapsed_time(late)
    assert len(times) == 2 * 2 * 4  # F and B of two stages, four micro-batches
    assert {s for _, s, _, _, _ in times} == {0, 1}
    assert all(0 <= start <= end for _, _, _, start, end in times)


def test_a_one_gpu_copy_must_be_recorded_on_the_stream_that_runs_it(program):
    """What the checker found in the runtime: on one GPU a copy between stages runs on the
    receiver's stream, so recording only the sender's send stream (as the runtime did) lets
    the sent tensor's memory be reused under the copy. Right on two GPUs, wrong on one."""
    line = "        copier = send if self.devices[src] != b else recv\n"
    assert program.count(line) == 1
    module = types.ModuleType("program")
    exec(compile(program.replace(line, "        copier = send\n"), "program.py", "exec"),
         module.__dict__)  # fmt: skip
    x, y, loss_fn = _data("mlp")
    for devices, wrong in ((["cuda:0", "cuda:1"], False), (["cuda:0", "cuda:0"], True)):
        problems = check_pipeline(
            lambda devices=devices: module.Pipeline(small_mlp(), devices), x, y, loss_fn
        )
        assert bool(problems) == wrong, problems
    assert any("may still be in use on stage 1's receive stream" in p for p in problems), problems


def test_the_program_checks_itself_and_fails_when_broken(tmp_path):
    """`gpipe-plan codegen --check-streams` exits 0 with a one-line verdict when clean; `python
    program.py --check-streams` on a program with a wait taken out exits 1, listing it (a clean
    program's own check exits 0: test_graph's emitted U-Net)."""
    model = mlp()  # example:mlp as the program builds it
    prof = quick_profile(model, model.example_input[:2])
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), N, microbatches=4, schedule="zb-h1")
    plan.model_copy(update={"model": "example:mlp"}).save(tmp_path / "plan.json")
    gpipe_plan = str(Path(sys.executable).parent / "gpipe-plan")
    run = subprocess.run(
        [gpipe_plan, "codegen", "plan.json", "--model", "example:mlp", "-o", "program.py",
         "--check-streams"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "the streams order every use of memory, on ['cuda:0', 'cuda:1'] and" in run.stdout
    source = (tmp_path / "program.py").read_text()
    line = "        self.compute[dst].wait_event(copied)\n"
    (tmp_path / "broken.py").write_text(source.replace(line, "        pass\n"))
    run = subprocess.run(
        [sys.executable, "broken.py", "--check-streams"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stderr == ""
    listed = run.stdout.splitlines()
    assert listed and all(p.startswith("stream check on ['cuda:0', 'cuda:") for p in listed)
    assert any("is not ordered before it" in p for p in listed)


def test_a_model_the_check_cannot_run_gets_one_line_and_exit_2(program, tmp_path):
    path = tmp_path / "program.py"
    path.write_text(program)  # profiled from a model object: the program cannot build it
    run = subprocess.run(
        [sys.executable, str(path), "--check-streams"], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "the stream check could not run" in run.stderr


def test_codegen_writes_nothing_where_the_stream_check_cannot_run(tmp_path, run_cli):
    """Found by a red team: `codegen --check-streams` replaced the program file first, then said
    the check could not run (exit 2). The check now runs the program before it is written."""
    (tmp_path / "once.py").write_text(
        "from pathlib import Path\n"
        "import torch.nn as nn\n"
        "def make():\n"
        "    mark = Path(__file__).with_suffix('.built')\n"
        "    if mark.exists():\n"
        "        raise RuntimeError('built once only')\n"
        "    mark.touch()\n"
        "    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))\n"
    )
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    prof = quick_profile(model, torch.randn(2, 4))
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), N, microbatches=2)
    from profiler.models import model_digest

    update = {"model": "once.py:make", "model_digest": model_digest(model)}
    plan.model_copy(update=update).save(tmp_path / "plan.json")
    out = tmp_path / "program.py"
    out.write_text("# an earlier program\n")
    r = run_cli("codegen", str(tmp_path / "plan.json"), "--model", str(tmp_path / "once.py:make"),
                "-o", str(out), "--check-streams")  # fmt: skip
    assert r.code == 2, r
    assert "the stream check could not run: RuntimeError: built once only" in r.err
    assert out.read_text() == "# an earlier program\n"


def test_check_streams_is_refused_for_targets_without_streams(tmp_path, run_cli):
    model = mlp()
    prof = quick_profile(model, model.example_input[:2])
    plan = plan_pipeline(prof, Cluster.uniform(2, "1GiB"), N, microbatches=2)
    plan.model_copy(update={"model": "example:mlp"}).save(tmp_path / "plan.json")
    out = tmp_path / "program.py"
    r = run_cli(
        "codegen", str(tmp_path / "plan.json"), "--model", "example:mlp", "--target",
        "torchrun", "-o", str(out), "--check-streams",
    )  # fmt: skip
    assert r.code == 2 and "--check-streams" in r.err and not out.exists()
    assert len(r.err.strip().splitlines()) == 1
