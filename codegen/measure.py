"""measure: run a compiled plan and hold its predictions to what the run really does.

Memory is read off the allocator (profiler/memtrack.py): every allocation the step makes is
charged to the stage whose action made it, and a device's level is its stages' sum. On top of
that a device holds what existed before the step: weights, gradients and optimizer state (one
warm-up step with the plan's optimizer creates them, as training would). Time is each action's
duration and the step's wall time: in one process on CPU the stages run one after another, so
there only per-action times compare with the plan; the step time compares under torchrun (one
process per device) or on CUDA streams.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from planner.plan import Plan
from planner.search import simulate_plan
from profiler.artifact import InputError
from profiler.limits import MIN_MS
from profiler.memtrack import AllocationTrace, owned_by, trace_allocations
from profiler.models import check_allocation
from schedules import Timeline

__all__ = [
    "MeasureReport",
    "build_report",
    "make_data",
    "measure_in_process",
    "measure_torchrun",
]

KINDS = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W",
         "send_forward": "SEND_F", "recv_forward": "RECV_F", "send_backward": "SEND_B",
         "recv_backward": "RECV_B"}  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeviceMeasure(_Strict):
    name: str
    predicted_peak_bytes: int
    measured_peak_bytes: int
    memory_error: float = Field(description="(measured - predicted) / predicted")
    static_bytes: int = Field(description="measured: weights, gradients, optimizer state")
    predicted_ms: float = Field(description="the device's busy time in one step, simulated")
    measured_ms: float = Field(description="the sum of its compute actions' times in one step")
    time_error: float


class ActionMeasure(_Strict):
    stage: int
    kind: str = Field(description="F, B, I, W (and SEND/RECV under torchrun, not predicted)")
    count: int = Field(description="actions measured (micro-batches x steps)")
    predicted_ms: float = Field(description="mean simulated duration; 0 where not modelled")
    measured_ms: float = Field(description="median measured duration")
    time_error: float


class MeasureReport(_Strict):
    kind: str = "measure"
    plan_digest: str
    target: str
    steps: int
    tolerance: float
    concurrent: bool = Field(description="whether the devices ran at the same time")
    predicted_step_ms: float
    measured_step_ms: float = Field(description="median wall time of one step")
    step_range_ms: tuple[float, float] = Field(
        description="the fastest and the slowest step measured (how noisy the machine was)"
    )
    step_error: float
    devices: list[DeviceMeasure]
    actions: list[ActionMeasure]
    unattributed_bytes: int = Field(description="peak of allocations made outside any stage")
    ok: bool = Field(description="no device's measured peak exceeds its prediction + tolerance")


def _error(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted if predicted else 0.0


def predicted_actions(tl: Timeline, overhead: float = 0.0) -> dict[tuple[int, str], float]:
    """Mean simulated duration per (stage, kind) of the plan's timeline, less the runtime's
    `overhead` per compute action: the log times what happens inside an action, and the
    runtime's own work only in part (the step's time has all of it)."""
    spans: dict[tuple[int, str], list[float]] = {}
    for sp in tl.spans:
        kind = sp.action.kind.value
        cut = overhead if kind in ("F", "B", "I", "W") else 0.0
        spans.setdefault((sp.action.stage, kind), []).append(sp.end - sp.start - cut)
    # (an action the profile timed at 0 ms: what is left of its span less the overhead is
    # rounding, 1e-17 ms, against which any run read +1e16%; found by a review)
    means = {k: statistics.fmean(v) for k, v in spans.items()}
    return {k: (ms if ms >= MIN_MS else 0.0) for k, ms in means.items()}


def static_bytes(modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the storages behind the modules' weights, buffers and gradients and the
    optimizer's state for them, each storage once."""
    seen: dict[tuple[str, int], int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[(str(t.device), st.data_ptr())] = st.nbytes()

    params = []
    for mod in modules:
        for p in mod.parameters():
            params.append(p)
            add(p)
            add(p.grad)
        for b in mod.buffers():
            add(b)
    if optimizer is not None:
        for p in params:
            for v in optimizer.state.get(p, {}).values():
                add(v)
    return sum(seen.values())


def make_optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer | None:
    """The plan's optimizer, with a learning rate too small to matter: it is here for its state."""
    if not params:
        return None
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-12)
    return torch.optim.SGD(params, lr=1e-12, momentum=0.9 if name == "momentum" else 0.0)


def optimizer_steps(
    optimizers: list[torch.optim.Optimizer | None],
    owners: list[int],
    params: list[list[nn.Parameter]],
) -> None:
    """One optimizer step per device, its temporaries charged to the device (through one of its
    stages); the gradients then stay allocated, zeroed, as the plan counts them."""
    for opt, stage, ps in zip(optimizers, owners, params):
        if opt is not None:
            with owned_by(str(stage)):
                opt.step()
        for p in ps:
            if p.grad is not None:
                p.grad.zero_()


@contextmanager
def left_as_it_was(modules: Iterable[nn.Module]) -> Iterator[None]:
    """The modules' parameters, their gradients and buffers, and torch's random state, put back
    as they were when the block ends, however it ends: measuring a model must not change it.
    Its steps do: a learning rate too small to matter still makes every weight NaN where the
    loss is NaN, batch norm's running statistics move, and gradients appear where there were
    none (found by a red team: `Pipe.measure` with a NaN loss left the caller's model NaN).
    The copies are kept on the CPU, outside what is measured."""
    tensors: dict[int, torch.Tensor] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            tensors.setdefault(id(t), t)
    kept = [
        (
            t,
            t.detach().to("cpu", copy=True),
            t.grad,  # (the caller's own tensor, given back with its value)
            None if t.grad is None else t.grad.detach().to("cpu", copy=True),
        )
        for t in tensors.values()
    ]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value, grad, grad_value in kept:
                t.copy_(value)
                if grad is not None:
                    grad.copy_(grad_value)
                if isinstance(t, nn.Parameter) or t.grad is not None or grad is not None:
                    t.grad = grad
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def device_name(dev: torch.device) -> str:
    """How the allocator names a device: cuda with its index."""
    if dev.type == "cuda" and dev.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(dev)


def device_levels(
    trace: AllocationTrace, rank_of_stage: list[int], device_of_stage: list[str]
) -> tuple[dict[int, int], int]:
    """Peak bytes each device's stages allocated on it during the trace (what a stage's
    actions allocate elsewhere, say host memory beside a GPU, is not that device's), and the
    peak of what no stage owns."""

    def group(owner: str | None, device: str) -> Any:
        if owner is None or not owner.isdigit():
            return "other"
        s = int(owner)
        return rank_of_stage[s] if device == device_of_stage[s] else None

    peaks = trace.peaks(group)
    other = peaks.pop("other", 0)
    return {int(k): v for k, v in peaks.items()}, other


def measure_in_process(
    plan: Plan,
    program: Any,
    x: torch.Tensor,
    y: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    steps: int = 3,
    tolerance: float = 0.05,
) -> MeasureReport:
    """Run `program` (a compiled streams Pipeline) and compare with `plan`."""
    K = len(plan.devices)
    ranks = [st.rank for st in plan.stages]
    on = [[s for s in range(len(ranks)) if ranks[s] == k] for k in range(K)]
    params = [  # (each once: a device's stages may share one, a tied weight)
        list({id(p): p for s in on[k] for p in program.stages[s].parameters()}.values())
        for k in range(K)
    ]
    optimizers = [make_optimizer(plan.optimizer, params[k]) for k in range(K)]

    def step() -> float:
        """One training step; returns the pipeline's part of it in ms (no optimizer)."""
        sync()
        t0 = time.perf_counter()
        program.train_step(x, y, loss_fn)
        sync()
        ms = (time.perf_counter() - t0) * 1e3
        optimizer_steps(optimizers, [stages[0] for stages in on], params)
        return ms

    def sync() -> None:  # every GPU of the pipe: synchronize() waits for the current one only
        for d in {d for d in program.devices if d.type == "cuda"}:
            torch.cuda.synchronize(d)

    # as many intra-op threads as the profile measured with, on the CPU: some kernels' memory
    # grows with them (found by a review: a bfloat16 matmul's workspace doubled from 1 thread,
    # as profiled, to 2, this process's, and the run read 5% over its plan)
    threads = plan.threads if plan.threads and not program.cuda else None
    kept = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        step()  # warm-up: creates gradients and optimizer state
        with trace_allocations() as trace:
            step()
            sync()
        dynamic, other = device_levels(trace, ranks, [device_name(d) for d in program.devices])
        static = [static_bytes([program.stages[s] for s in on[k]], optimizers[k]) for k in range(K)]
        walls, log = [], []
        program.action_log = []
        try:
            for _ in range(steps):
                walls.append(step())
                log += program.action_times()
                program.action_log = []
        finally:
            program.action_log = None
    finally:
        torch.set_num_threads(kept)
    concurrent = program.cuda and len(set(map(str, program.devices))) > 1
    return build_report(
        plan, "streams", steps, tolerance, concurrent, walls,
        [static[k] + dynamic.get(k, 0) for k in range(K)], static, other, log,
    )  # fmt: skip


def build_report(
    plan: Plan,
    target: str,
    steps: int,
    tolerance: float,
    concurrent: bool,
    walls: list[float],
    peaks: list[int],
    static: list[int],
    other: int,
    log: list[tuple[str, int, int, float, float]],
) -> MeasureReport:
    """Put measured peaks, step times (`walls`, ms) and the action log (what, stage,
    micro-batch, start, end in ms, over `steps` steps) next to the plan's predictions."""
    step_ms = statistics.median(walls)
    ranks = [st.rank for st in plan.stages]
    # torchrun's ranks wait in their batches of communication for each other (simulate_plan)
    tl = simulate_plan(plan, levels=False, rendezvous=target == "torchrun")
    overhead = plan.runtime.action_ms if plan.runtime is not None else 0.0
    predicted = predicted_actions(tl, overhead)
    # each device's compute as profiled (the runtime's own work is in the step's time)
    computed = [0.0] * len(plan.devices)
    for sp in tl.spans:
        if sp.action.kind.value in ("F", "B", "I", "W"):
            computed[ranks[sp.action.stage]] += sp.end - sp.start - overhead
    durations: dict[tuple[int, str], list[float]] = {}
    busy = [0.0] * len(plan.devices)
    for what, s, _m, start, end in log:
        kind = KINDS[what]
        durations.setdefault((s, kind), []).append(end - start)
        if kind in ("F", "B", "I", "W"):
            busy[ranks[s]] += (end - start) / steps
    actions = []
    for (s, kind), ds in sorted(durations.items()):
        p = predicted.get((s, kind), 0.0)
        m = statistics.median(ds)
        actions.append(
            ActionMeasure(
                stage=s,
                kind=kind,
                count=len(ds),
                predicted_ms=p,
                measured_ms=m,
                time_error=_error(m, p),
            )  # fmt: skip
        )
    devices = []
    for k, d in enumerate(plan.devices):
        devices.append(
            DeviceMeasure(
                name=d.name,
                predicted_peak_bytes=d.total,
                measured_peak_bytes=peaks[k],
                memory_error=_error(peaks[k], d.total),
                static_bytes=static[k],
                predicted_ms=computed[k],
                measured_ms=busy[k],
                time_error=_error(busy[k], computed[k]),
            )
        )
    ok = all(d.measured_peak_bytes <= d.predicted_peak_bytes * (1 + tolerance) for d in devices)
    return MeasureReport(
        plan_digest=plan.digest(),
        target=target,
        steps=steps,
        tolerance=tolerance,
        concurrent=concurrent,
        predicted_step_ms=tl.makespan,
        measured_step_ms=step_ms,
        step_range_ms=(min(walls), max(walls)),
        step_error=_error(step_ms, tl.makespan),
        devices=devices,
        actions=actions,
        unattributed_bytes=other,
        ok=ok,
    )


def make_data(model: nn.Module, plan: Plan, seed: int = 0) -> tuple[torch.Tensor, Any, Any]:
    """A mini-batch of the plan's shapes from a fixed seed, targets for the plan's loss, and the
    loss: what `measure` runs (the same on every rank and for every target)."""
    from profiler.losses import BUILT_IN, read_out, resolve_loss

    g = torch.Generator().manual_seed(seed)
    shape = (plan.batch_size, *plan.input_shape)
    dtype = getattr(torch, plan.input_dtype)
    size = torch.empty((), dtype=dtype).element_size() * math.prod(shape)
    check_allocation(size, torch.device("cpu"), f"the plan's mini-batch {list(shape)}")
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype)
    else:
        example = getattr(model, "example_input", None)
        high = int(example.max()) + 1 if isinstance(example, torch.Tensor) else 2
        x = torch.randint(0, high, shape, generator=g, dtype=dtype)
    if not plan.loss:
        return x, None, _stand_in_loss
    try:
        loss = resolve_loss(plan.loss)
    except InputError as e:
        where, sep, _ = plan.loss.rpartition(":")
        if sep and where:  # named as package.module:fn or file.py:fn, and not found from here
            raise InputError(
                f"the plan's loss {plan.loss!r} cannot be loaded from here ({e}); run measure "
                "where it was profiled, or measure from Python: pipe.measure(x, y, loss_fn)"
            ) from None
        raise InputError(
            f"the plan's loss {plan.loss!r} was a Python function, which measure cannot name; "
            "measure from Python instead: pipe.measure(x, y, loss_fn)"
        ) from None
    assert loss is not None
    was_training = model.training
    model.eval()  # only the output's shape is wanted: leave batch-norm statistics alone
    try:
        with torch.no_grad():
            out = model(x[:1])
    finally:
        model.train(was_training)
    if plan.loss in BUILT_IN:  # (a library model's named outputs: the tensor it reads)
        out = read_out(out)
    like = torch.empty((plan.batch_size, *out.shape[1:]), dtype=out.dtype)
    torch.manual_seed(seed)
    return x, loss.make_target(like), loss.fn


class _StandIn(torch.autograd.Function):
    """0, keeping nothing; its gradient is zeros as large as the output, as a real loss's is
    (the plan counts that gradient: B's transient, zero bubble's from I to W)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.like = (t.shape, t.dtype, t.device)
        return t.new_zeros(())

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        shape, dtype, device = ctx.like
        return torch.zeros(shape, dtype=dtype, device=device)


def _stand_in_loss(out: Any, y: Any) -> torch.Tensor:
    """A loss that needs no targets and keeps nothing for backward, for plans profiled without
    one (whose memory counts no loss)."""
    outs = out if isinstance(out, tuple) else (out,)
    return sum(_StandIn.apply(t) for t in outs if t.is_floating_point())  # type: ignore[return-value]


def measure_torchrun(
    plan: Plan,
    model_spec: str,
    *,
    steps: int = 3,
    tolerance: float = 0.05,
    threads: int = 1,
    timeout_s: float = 600.0,
) -> MeasureReport:
    """Emit the plan's torchrun program, run it on one process per device of this host
    (`threads` intra-op threads each) and compare with the plan."""
    import json
    import os
    import sys
    import tempfile
    from pathlib import Path

    from .emit import emit_program

    K = len(plan.devices)
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="gpipe-measure-") as tmp:
        program, plan_path = Path(tmp) / "program.py", Path(tmp) / "plan.json"
        program.write_text(emit_program(plan, target="torchrun", model=model_spec))
        plan.save(plan_path)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={K}", "-m", "codegen.measure_rank",
               str(program), str(plan_path), model_spec, tmp, str(steps)]  # fmt: skip
        for _ in range(2):
            run = _run(cmd, env, timeout_s)
            # NOTE: now and then gloo aborts a worker in C++ at teardown ("terminate called
            # without an active exception", no Python error): launch once more then.
            if run.returncode == 0 or "terminate called without" not in run.stderr:
                break
        ranks = [Path(tmp) / f"rank{r}.json" for r in range(K)]
        if run.returncode != 0 or not all(p.exists() for p in ranks):
            why = rank_error(run.stderr) or " | ".join(run.stderr.strip().splitlines()[-3:])
            if not why:  # (a rank that called sys.exit(0) says nothing, and leaves no result)
                why = "a rank ended before its result, saying nothing (did the model exit?)"
            raise InputError(f"the torchrun program failed (exit {run.returncode}): {why}")
        results = [json.loads(p.read_text()) for p in ranks]
    by_rank = {res["rank"]: res for res in results}
    walls = [max(by_rank[r]["walls"][k] for r in range(K)) for k in range(steps)]
    log = [tuple(entry) for r in range(K) for entry in by_rank[r]["log"]]
    return build_report(
        plan, "torchrun", steps, tolerance, True, walls,
        [by_rank[r]["static"] + by_rank[r]["dynamic_peak"] for r in range(K)],
        [by_rank[r]["static"] for r in range(K)],
        max(by_rank[r]["other_peak"] for r in range(K)), log,  # type: ignore[arg-type]
    )  # fmt: skip


# Runs the launch in its place (exec), told SIGTERM when the process that started it dies,
# however it dies (Linux: PR_SET_PDEATHSIG, 1), and not started at all if that already
# happened; torchrun stops its ranks on SIGTERM.
_ORPHAN_GUARD = """\
import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit(128 + signal.SIGTERM)
os.execvp(sys.argv[2], sys.argv[2:])
"""


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP while a launch runs: stops the command as Ctrl-C does (the launch
    killed, its temporary files removed), with the exit status of that signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.exit_code = 128 + signum


def _run(cmd: list[str], env: dict[str, str], timeout_s: float) -> Any:
    """Run torchrun in its own session; past `timeout_s`, on Ctrl-C, SIGTERM or SIGHUP,
    torchrun and every rank it started (each in a session of its own) are killed before this
    returns."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import uuid

    def stop(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    signals = (signal.SIGTERM, signal.SIGHUP)
    kept = {}
    if threading.current_thread() is threading.main_thread():  # (only it may set handlers)
        kept = {sig: signal.signal(sig, stop) for sig in signals}

    def quiet() -> None:  # a second signal must not stop the killing halfway
        for sig in kept:
            signal.signal(sig, signal.SIG_IGN)

    token = uuid.uuid4().hex  # every process of this launch inherits it: how they are found
    if sys.platform.startswith("linux"):  # killed past any handler (SIGKILL): torchrun stops too
        cmd = [sys.executable, "-I", "-c", _ORPHAN_GUARD, str(os.getpid()), *cmd]  # (-I: no
        # module of the working directory in its place)
    proc = None
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**env, _RUN_TOKEN: token}, start_new_session=True,
        )  # fmt: skip
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        quiet()
        _kill_all(proc, token)
        raise InputError(f"the torchrun launch ran past {timeout_s:g} s and was stopped") from None
    except BaseException:
        quiet()
        if proc is not None:
            _kill_all(proc, token)
        raise
    finally:
        for sig, handler in kept.items():  # (None: set from C; the default then)
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


_RUN_TOKEN = "GPIPE_PLAN_RUN"


def _kill_all(proc: Any, token: str) -> None:
    """SIGKILL every process of the launch (torchrun, and its ranks, each in a session of its
    own), again until none is left (torchrun may be starting one as this runs), then reap."""
    import contextlib
    import os
    import signal
    import time

    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    for _ in range(100):
        left = _holding(token)
        if not left:
            break
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    for pipe in (proc.stdout, proc.stderr):  # a survivor may still hold the other end
        with contextlib.suppress(OSError):
            pipe.close()
    with contextlib.suppress(Exception):  # SIGKILLed: reaped at once, unless the kernel holds it
        proc.wait(timeout=10)


def _holding(token: str) -> list[int]:
    """The live processes whose environment carries this launch's token (/proc; none where
    there is no /proc)."""
    import os

    mark = f"{_RUN_TOKEN}={token}".encode()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    with open(f"/proc/{name}/stat", "rb") as g:
                        if g.read().rsplit(b")", 1)[1].split()[0] != b"Z":  # not a zombie
                            found.append(int(name))
        except (OSError, IndexError):
            continue
    return found


def rank_error(stderr: str) -> str:
    """The failing rank's own last error line in torchrun's output (its traceback's last line,
    which torch prefixes with `[rankN]:`), not the knock-on errors of the others nor torchrun's
    summary: the rank torchrun names as the root cause (where that is a rank its watchdog
    ended, the rank it names), else the first to report an error; "" if none did."""
    import re

    by_rank: dict[str, str] = {}
    halted: dict[str, tuple[str, str]] = {}  # rank its watchdog ended: (failing rank, why)
    for line in stderr.splitlines():
        m = re.match(r"^\[(?:rank|default)?(\d+)\]:\s?(.*)$", line)
        who, text = (m.group(1), m.group(2).strip()) if m else ("", line.strip())
        stop = re.match(r"^gpipe-plan: rank (\d+) stopped: (rank (\d+) failed: .*)$", text)
        if stop:
            halted.setdefault(stop.group(1), (stop.group(3), stop.group(2)))
        elif (
            re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", text)
            and not text.startswith("Exception ignored")
            and not re.search(r"ChildFailedError|torch\.distributed\.elastic", text)
        ):
            by_rank[who] = text  # its last one (a dict keeps the ranks in first-seen order)
    cause = re.search(r"Root Cause.*?\brank\s*:\s*(\d+).*?\bexitcode\s*:\s*(-?\d+)", stderr, re.S)
    if cause:  # a rank killed by a signal leaves no line of its own: say how it ended
        rank, code = cause.groups()
        if rank not in by_rank and rank in halted:  # ended by its watchdog: the failing one's
            failing, why = halted[rank]
            return by_rank.get(failing, why)
        return by_rank.get(rank, f"rank {rank} ended with exit code {code}")
    return next(iter(by_rank.values()), next((why for _, why in halted.values()), ""))
