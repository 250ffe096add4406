"""emit_program: a Plan and its Schedule -> the source of a pipeline program that imports only
torch (and, in its `load_model`, the model's own module), so it runs from any directory.

The program embeds the runtime helpers (codegen/_runtime.py, _numerics.py) and adds a `Pipeline`
class whose `train_step` is straight-line: one call per action, in the schedule's issue order
(schedules/order.py): every dependency first, and memory allocated in exactly the order the
planner counted it. Same plan, same text: nothing in it depends on the clock or the machine.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from planner.plan import Plan
from planner.search import schedule_of, stage_costs, torchrun_schedule
from schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    canonical_order,
    validate,
)
from schedules.comm import batches, preposted

RUNTIME = [Path(__file__).with_name(n) for n in ("_runtime.py", "_numerics.py")]
STREAM_CHECK = [Path(__file__).with_name(n) for n in ("_fakecuda.py", "_streamcheck.py")]
DIST_RUNTIME = Path(__file__).with_name("_dist_runtime.py")
PIPELINING = Path(__file__).with_name("_pipelining.py")
GRAPH = Path(__file__).parents[1] / "profiler" / "graph.py"
_CALL = {
    Kind.F: "forward",
    Kind.B: "backward",
    Kind.I: "backward_input",
    Kind.W: "backward_weight",
    Kind.SEND_F: "send_forward",
    Kind.RECV_F: "recv_forward",
    Kind.SEND_B: "send_backward",
    Kind.RECV_B: "recv_backward",
}


def issue_order(plan: Plan, schedule: Schedule | None = None) -> list[Action]:
    """Every compute action once, in the order the host issues them: the schedule's issue order
    (schedules/order.py), which is also the order the planner counted memory in."""
    sched = (schedule or schedule_of(plan)).compute_only()
    validate(sched)
    return canonical_order(sched, [st.recompute for st in plan.stages])


TARGETS = ("streams", "torchrun", "torch-pipelining")


def emit_program(
    plan: Plan, schedule: Schedule | None = None, target: str = "streams", model: str | None = None
) -> str:
    """The program's source text for `plan` (and `schedule`, by default the plan's own).
    `model` names the model as it is found from here (default: as the plan names it, which a
    relative file path does only from the directory the profile was made in).

    streams: one process drives every device, a CUDA stream per stage (CPU without CUDA).
    torchrun: one process per device, point-to-point sends between them (gloo or NCCL).
    torch-pipelining: one process per device, on torch.distributed.pipelining's runtime."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    sched = schedule or schedule_of(plan)
    if target == "torch-pipelining":
        return _pipelining_program(plan, sched, model)
    runtime = "\n\n".join(_without_dropped_lines(p.read_text()) for p in RUNTIME)
    if target == "streams":
        runtime += "".join("\n\n" + _without_dropped_lines(p.read_text()) for p in STREAM_CHECK)
        body = _streams_class(plan, issue_order(plan, sched))
        main = _STREAMS_MAIN
    else:
        validate(sched)
        runtime += "\n\n" + _without_dropped_lines(DIST_RUNTIME.read_text())
        body = _torchrun_class(plan, torchrun_schedule(plan, sched))
        main = _TORCHRUN_MAIN
    constants = _program_constants(plan)
    loader = _planned_loader(plan, model)
    if plan.captured:
        runtime += "\n\n" + _without_dropped_lines(GRAPH.read_text())
        loader += _CAPTURED_LOADER
    return _header(plan, target) + runtime + body + constants + loader + _COMMON_MAIN + main


def _program_constants(plan: Plan) -> str:
    """The module-level constants every program's main and loader read."""
    return f"""

MODEL = {json.dumps(plan.model)}
NUM_DEVICES = {len(plan.devices)}
BATCH_SIZE = {plan.batch_size}
INPUT_SHAPE = {list(plan.input_shape)}
INPUT_DTYPE = {json.dumps(plan.input_dtype)}
"""


def pipelining_refusal(plan: Plan) -> str | None:
    """Why torch.distributed.pipelining's runtime cannot run this plan as planned, or None."""
    if plan.captured:
        return (
            "torch.distributed.pipelining's stages hand each other positional tensors, and "
            "this plan's captured graph sends named values past stages: use --target torchrun"
        )
    if plan.batch_size % plan.microbatches:
        return (
            f"torch.distributed.pipelining's stages take micro-batches of one size, and this "
            f"plan splits {plan.batch_size} samples into {plan.microbatches} uneven ones: plan "
            "with --microbatches dividing the batch, or use --target torchrun"
        )
    if plan.checkpointed:
        return (
            "torch.distributed.pipelining's runtime cannot run a layer under a checkpoint of "
            "its own: plan with --checkpoint-layers none, or use --target torchrun"
        )
    modes = {st.recompute for st in plan.stages} - {"never", "always"}
    if modes:
        return (
            f"torch.distributed.pipelining's runtime cannot recompute {sorted(modes)[0]} (only "
            "a whole stage, always): plan with --recompute never or always, or use --target "
            "torchrun"
        )
    return None


def _pipelining_program(plan: Plan, sched: Schedule, model: str | None) -> str:
    refusal = pipelining_refusal(plan)
    if refusal is not None:
        raise ValueError(refusal)
    validate(sched)
    from schedules import to_csv

    runtime = _without_dropped_lines(PIPELINING.read_text())
    rows = "\n".join(f"    {json.dumps(row + chr(10))}" for row in to_csv(sched).splitlines())
    constants = (
        _program_constants(plan)
        + f"""MICROBATCHES = {plan.microbatches}
{_py_list("STAGES", [f"({a}, {b})" for a, b in (st.layers for st in plan.stages)], 0)}
{_py_list("RANKS", [str(st.rank) for st in plan.stages], 0)}
{_py_list("RECOMPUTE", [json.dumps(st.recompute) for st in plan.stages], 0)}
SCHEDULE_CSV = (
{rows}
)
"""
    )
    loader = _planned_loader(plan, model)
    return (
        _header(plan, "torch-pipelining") + runtime + constants + loader + _COMMON_MAIN
        + _PIPELINING_MAIN
    )  # fmt: skip


def _header(plan: Plan, target: str) -> str:
    rows = "\n".join(
        f"#   {st.index:<6} {st.rank:<7} {st.device:<12} {st.layers[0]}-{st.layers[1] - 1}"
        for st in plan.stages
    )
    run = (
        "python this_file.py [--device cuda|cpu]"
        if target == "streams"
        else f"torchrun --nproc-per-node {len(plan.devices)} this_file.py   (or --nnodes N ...)"
    )
    return f'''# Generated by gpipe-plan from plan {plan.digest()[:16]} ({plan.model}), target {target}.
# Do not edit: re-run `gpipe-plan codegen` instead. Run it for one timed step on random data:
#     {run}
#
# {len(plan.devices)} device(s), schedule {plan.schedule}, batch {plan.batch_size} as {plan.microbatches} micro-batch(es)
# of <= {plan.microbatch_size}, recompute {plan.recompute}; predicted {plan.predicted.iteration_ms:.2f} ms per step
# ({"this program" if plan.target == target else f"the plan's {plan.target} program"}).
#
#   stage  device  name         layers
{rows}
"""A compiled GPipe pipeline program (see the header above)."""

'''


def _constants(plan: Plan) -> str:
    stages = _py_list("STAGES", [f"({a}, {b})" for a, b in (st.layers for st in plan.stages)])
    ranks = _py_list("RANKS", [str(st.rank) for st in plan.stages])
    recompute = _py_list("RECOMPUTE", [json.dumps(st.recompute) for st in plan.stages])
    if plan.checkpointed:  # layers under a checkpoint of their own
        recompute += "\n    " + _py_list("CHECKPOINTED", [str(k) for k in plan.checkpointed])
    routes = ""
    if plan.routes:  # a captured graph: each value straight to the stages that read it
        routes = "\n    " + _py_list("ROUTES", [f"({a}, {b})" for a, b in plan.routes])
    if any(st.memory.grads < st.memory.params for st in plan.stages):
        # some weights counted frozen: the runtime warns where a stage trains more than this
        routes += "\n    " + _py_list("GRADS", [str(st.memory.grads) for st in plan.stages])
    return f"""    SCHEDULE = "{plan.schedule}"
    MICROBATCHES = {plan.microbatches}
    {stages}
    {ranks}
    {recompute}{routes}
"""


def _streams_class(plan: Plan, order: list[Action]) -> str:
    M, S = plan.microbatches, len(plan.stages)
    train = "\n".join(f"        self.{_CALL[a.kind]}({a.stage}, {a.microbatch})" for a in order)
    # Inference: fill-drain forwards only, stage by stage as in GPipe's clock cycles.
    infer = "\n".join(
        f"        self.infer_forward({s}, {m})"
        for k in range(M + S - 1)
        for s in range(S)
        for m in [k - s]
        if 0 <= m < M
    )
    return f'''

class Pipeline(PipelineRuntime):
    """{plan.schedule} over {len(plan.devices)} device(s): train_step issues every action of the
    schedule, in dependency order; infer runs the forwards only."""

{_constants(plan)}
    def train_step(
        self, x: torch.Tensor, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> torch.Tensor:
        """One training step; afterwards every parameter's .grad holds the mini-batch gradient."""
        self.begin(x, y, loss_fn)
{train}
        return self.finish()

    @torch.no_grad()
    def infer(self, x: torch.Tensor) -> Value:
        """Pipelined inference: the model's output for x, keeping no graph."""
        self.infer_begin(x)
{infer}
        return self.infer_finish()
'''


def _torchrun_class(plan: Plan, lowered: Schedule) -> str:
    try:
        validate(lowered, rendezvous=True)
        rendezvous = ""
    except ScheduleError:  # a captured graph's skips, at times: gloo only
        rendezvous = "\n    RENDEZVOUS = False  # may hang where sends block (NCCL): gloo only\n"
    devices = _py_list("DEVICES", [json.dumps(d.torch_device or "") for d in plan.cluster.devices])
    costs = stage_costs(plan.stages, plan.runtime, plan.device_type)
    ahead = [] if plan.captured else sorted(preposted(lowered, costs))
    if ahead:  # the stages whose forward receives are all posted as the step begins
        devices += f"\n    PREPOSTED = {tuple(ahead)}  # every forward receive posted at begin"
    methods = []
    for r in sorted(lowered.ranks):
        lines = []
        for batch in batches(lowered.ranks[r]):
            if batch[0].kind.is_compute:
                a = batch[0]
                lines.append(f"        self.{_CALL[a.kind]}({a.stage}, {a.microbatch})")
                continue
            ops = [
                f'("{_CALL[a.kind]}", {a.stage}, {a.microbatch}'
                + (f", {a.peer})" if a.peer >= 0 else ")")
                for a in batch
            ]
            flat = f"        self.exchange({', '.join(ops)})"
            # (as a formatter writes one past 100 columns: one operation a line; found on a
            # machine whose timings grouped four in one batch, 120 columns)
            each = "".join(f"            {op},\n" for op in ops)
            lines.append(flat if len(flat) <= 100 else f"        self.exchange(\n{each}        )")
        calls = "\n".join(lines)
        methods.append(f"""
    def _rank{r}(self) -> None:
        \"\"\"Rank {r}: stages {lowered.stages_of(r)}.\"\"\"
{calls}
""")
    return f'''

class Pipeline(DistPipelineRuntime):
    """{plan.schedule} over {len(plan.devices)} processes: each rank runs its own straight-line
    list of actions; torch.distributed carries what crosses ranks."""

{_constants(plan)}{rendezvous}
    {devices}
    PROFILED_ON = {json.dumps(plan.device_type.split(":")[0])}  # the plan's times and bytes are this device's
    PLAN = "{_program_id(plan, lowered)}"

    def train_step(
        self, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor]
    ) -> torch.Tensor:
        """One training step on every rank (same mini-batch everywhere; x matters on the first
        stage's rank, y on the last's). Afterwards this rank's parameters hold their gradients;
        every rank returns the mini-batch loss."""
        with self.stepping():  # a failure here halts every other rank still in the step
            self.begin(x, y, loss_fn)
            getattr(self, f"_rank{{self.rank}}")()
            return self.finish()
{"".join(methods)}'''


def _program_id(plan: Plan, lowered: Schedule) -> str:
    """What every rank of a launch must agree on: the plan and each rank's list of actions."""
    import hashlib

    return hashlib.sha256(f"{plan.digest()}\n{lowered}".encode()).hexdigest()[:16]


def _without_dropped_lines(text: str) -> str:
    """The distributed runtime imports the base runtime for linting; the program inlines both."""
    kept = [line for line in text.splitlines() if not line.rstrip().endswith("# emit: drop")]
    out: list[str] = []
    for line in kept:  # at most two blank lines in a row, as a formatter would leave them
        if line.strip() or len(out) < 2 or out[-1].strip() or out[-2].strip():
            out.append(line)
    return "\n".join(out).strip("\n") + "\n"


_COMMON_MAIN = '''

def random_batch(model: nn.Module) -> torch.Tensor:
    """Random input of the planned shape and dtype."""
    example = getattr(model, "example_input", None)
    if INPUT_DTYPE.startswith(("float", "bfloat")):
        return torch.randn(BATCH_SIZE, *INPUT_SHAPE, dtype=getattr(torch, INPUT_DTYPE))
    high = int(example.max()) + 1 if isinstance(example, torch.Tensor) else 2
    return torch.randint(0, high, (BATCH_SIZE, *INPUT_SHAPE), dtype=getattr(torch, INPUT_DTYPE))


def stand_in_loss(out: Any, y: Any) -> torch.Tensor:
    """A loss that needs no targets, for timing (over every float tensor the model returns)."""
    if isinstance(out, torch.Tensor):
        return out.float().square().mean()
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if torch.is_tensor(t)]
    return sum(t.float().square().mean() for t in leaves if t.is_floating_point())
'''


_STREAMS_MAIN = """

def check_streams() -> int:
    \"\"\"Two steps and an inference under the stream checker, on the CPU: stages on a GPU
    each, then all on one GPU. Prints what the streams leave unordered and returns 1 if
    anything; 2, with one line, if the check cannot run the model.\"\"\"
    import sys
    import warnings

    layouts = [[f"cuda:{k}" for k in range(NUM_DEVICES)]]
    if NUM_DEVICES > 1:
        layouts.append(["cuda:0"] * NUM_DEVICES)
    found = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the model's own, and torch's about the CPU
            model = load_model()
            x = random_batch(model)
            for devices in layouts:
                problems = check_pipeline(
                    lambda: Pipeline(copy.deepcopy(model), devices), x, None, stand_in_loss
                )
                for problem in problems:
                    print(f"stream check on {devices}: {problem}")
                found += len(problems)
    except (BrokenPipeError, KeyboardInterrupt):
        raise
    except (Exception, SystemExit) as e:  # the model, or what the stand-in has no CPU form of
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"{MODEL}: the stream check could not run: {type(e).__name__}: {first}",
              file=sys.stderr)  # fmt: skip
        return 2
    if not found:
        on = " and ".join(map(str, layouts))
        print(f"{MODEL}: the streams order every use of memory, on {on}")
    return 1 if found else 0


def main(argv: list[str] | None = None) -> None:
    \"\"\"One timed training step on random data of the planned shapes.\"\"\"
    import argparse
    import sys
    import time

    ap = argparse.ArgumentParser(description=__doc__)
    default = "cuda" if torch.cuda.is_available() else "cpu"
    ap.add_argument("--device", choices=["cuda", "cpu"], default=default)
    ap.add_argument(
        "--check-streams",
        action="store_true",
        help="run the CUDA stream code on the CPU under a happens-before checker (no GPU needed)",
    )
    args = ap.parse_args(argv)
    if args.check_streams:
        sys.exit(check_streams())
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{MODEL}: --device cuda, but this host has no CUDA device", file=sys.stderr)
        sys.exit(2)
    n_gpu = torch.cuda.device_count() if args.device == "cuda" else 0
    devices = [f"cuda:{k % n_gpu}" if n_gpu else "cpu" for k in range(NUM_DEVICES)]
    model = load_model()
    x = random_batch(model)
    try:
        pipe = Pipeline(model, devices)
    except ModelMismatch as e:  # not the model planned (its layers, its routes): one line
        print(f"{MODEL}: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        pipe.train_step(x, None, stand_in_loss)  # warm-up
        if n_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = pipe.train_step(x, None, stand_in_loss)
        if n_gpu:
            torch.cuda.synchronize()
    except StageError as e:  # a stage raised: which, where, and why, in one line
        print(f"{MODEL}: {e}", file=sys.stderr)
        sys.exit(1)
    ms = (time.perf_counter() - t0) * 1e3
    print(f"{MODEL}: one {pipe.SCHEDULE} step on {devices}: {ms:.1f} ms, loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
"""

_UNDER_TORCHRUN = """

def under_torchrun(argv: list[str] | None) -> None:
    \"\"\"The program's options (none but --help), and a one-line refusal where it was started
    without torchrun (which gives each process its rank and the launch's rendezvous).\"\"\"
    import argparse
    import os
    import sys

    name = os.path.basename(sys.argv[0] or "program.py")
    launch = f"torchrun --nproc-per-node {NUM_DEVICES} {name}"
    argparse.ArgumentParser(
        description=f"{__doc__} Run it as: {launch} (on several hosts: --nnodes, --rdzv-endpoint)"
    ).parse_args(argv)
    needs = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what env:// reads
    missing = [v for v in needs if v not in os.environ]
    if missing:
        print(
            f"{MODEL}: this program runs one process per device under torchrun ({missing[0]} is "
            f"not set): {launch}",
            file=sys.stderr,
        )
        raise SystemExit(2)
"""

_TORCHRUN_MAIN = (
    _UNDER_TORCHRUN
    + """

def main(argv: list[str] | None = None) -> None:
    \"\"\"One timed training step on random data of the planned shapes, on every rank.\"\"\"
    import sys
    import time

    under_torchrun(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        torch.manual_seed(0)  # the same model and batch on every rank
        model = load_model()
        x = random_batch(model)
        try:
            pipe = Pipeline(model)
        except ProgramRefused as e:  # every rank says why in one line, and stops
            print(f"{MODEL}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        try:
            pipe.train_step(x, None, stand_in_loss)  # warm-up
            dist.barrier()
            t0 = time.perf_counter()
            loss = pipe.train_step(x, None, stand_in_loss)
        except BatchRefused as e:  # every rank refuses the batch together: one line each
            print(f"{MODEL}: rank {pipe.rank}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        except StageError as e:  # a rank failed: every rank names it, in one line
            print(f"{MODEL}: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        dist.barrier()
        ms = (time.perf_counter() - t0) * 1e3
        if pipe.rank == 0:
            ranks = dist.get_world_size()
            print(f"{MODEL}: one {pipe.SCHEDULE} step on {ranks} ranks: {ms:.1f} ms, {loss=:.4f}")
        dist.barrier()  # NOTE: tearing gloo down while a peer is still mid-exit can abort it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""
)


_PIPELINING_MAIN = (
    _UNDER_TORCHRUN
    + """

def failure(rank: int, stages: list[int], error: Exception) -> str:
    \"\"\"The line a rank says when its step failed: its own error where it failed first (kept
    in the launch's store, the first writer's), else which rank stopped it (the others then
    fail on a link that rank closed).\"\"\"
    import torch.distributed as dist

    first = str(error).strip().splitlines()
    own = f"rank {rank} (stage {', '.join(map(str, stages))}) failed: {type(error).__name__}"
    own += f": {first[0][:300]}" if first else ""
    key = "gpipe-plan/failed"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.compare_set(key, "", own)
        told = store.get(key).decode()
    except Exception:  # noqa: BLE001 - the store is gone: this rank's own error
        told = own
    return own if told == own else f"rank {rank} stopped: {told}"


def main(argv: list[str] | None = None) -> None:
    \"\"\"One timed training step on random data of the planned shapes, on every rank, on
    torch.distributed.pipelining's runtime.\"\"\"
    import sys
    import time

    import torch.distributed as dist

    under_torchrun(argv)
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        if dist.get_world_size() != NUM_DEVICES:
            print(
                f"{MODEL}: rank {dist.get_rank()}: this program runs on {NUM_DEVICES} processes, "
                f"not {dist.get_world_size()}: torchrun --nproc-per-node {NUM_DEVICES}",
                file=sys.stderr,
            )
            raise SystemExit(2)
        torch.manual_seed(0)  # the same model and batch on every rank
        model = load_model()
        x = random_batch(model).to(device)
        y = torch.zeros(BATCH_SIZE, device=device)
        rank = dist.get_rank()
        refusal = tied_across(list(model), STAGES, RANKS)  # (the same on every rank)
        if refusal is not None:
            print(f"{MODEL}: rank {rank}: {refusal}", file=sys.stderr)
            raise SystemExit(2)
        stages, schedule = torch_pipeline(
            list(model), STAGES, RANKS, RECOMPUTE, SCHEDULE_CSV, MICROBATCHES, stand_in_loss,
            rank, device,
        )  # fmt: skip
        mine = {st.stage_index for st in stages}

        def step() -> None:
            if 0 in mine:
                schedule.step(x, target=y if len(STAGES) - 1 in mine else None)
            elif len(STAGES) - 1 in mine:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()

        try:
            step()  # warm-up
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
        except Exception as e:  # noqa: BLE001 - a rank failed: every rank says which, one line
            print(f"{MODEL}: {failure(rank, sorted(mine), e)}", file=sys.stderr)
            raise SystemExit(1) from None
        ms = (time.perf_counter() - t0) * 1e3
        if rank == 0:
            print(
                f"{MODEL}: one step on torch.distributed.pipelining, {NUM_DEVICES} ranks: {ms:.1f} ms"
            )
        dist.barrier()  # NOTE: tearing gloo down while a peer is still mid-exit can abort it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""
)


def _model_loader(spec: str) -> str:
    """The program's `load_model()`: an example's own source inlined, a file by its absolute path
    (resolved here, against the current directory), or a module imported by name."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:  # e.g. "<python>": profiled from a model object
        return _NO_LOADER
    if not name.isidentifier():
        raise ValueError(f"model {spec!r}: the factory name {name!r} is not a Python identifier")
    if where == "example":
        factory, source = _example_source(name)
        return f'''

{source}


def load_model() -> nn.Module:
    """The planned model: gpipe-plan's own example factory, copied above."""
    return {factory}()
'''
    if where.endswith(".py"):
        return f'''

def load_model() -> nn.Module:
    """The planned model: {name}() from its file, found by absolute path."""
    import importlib.util
    import os
    import sys

    path = {json.dumps(str(Path(where).resolve()))}
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{{MODEL}}: the model's file {{path}} is not there; move it back or run gpipe-plan "
            "codegen again where it is"
        )
    module_spec = importlib.util.spec_from_file_location("_planned_model", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["_planned_model"] = module  # dataclasses and pickling look the module up here
    if os.path.dirname(path) not in sys.path:  # (its folder's modules, as gpipe-plan had them)
        sys.path.append(os.path.dirname(path))
    module_spec.loader.exec_module(module)
    return module.{name}()
'''
    return f'''

def load_model() -> nn.Module:
    """The planned model: {name}() from its module (MODEL), which must be importable."""
    import importlib

    where = {json.dumps(where)}
    try:
        module = importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise ImportError(
            f"{{MODEL}}: cannot import {{where}} ({{e}}); run this program where {{where}} is "
            "importable, e.g. with the directory that holds it on PYTHONPATH"
        ) from None
    return module.{name}()
'''


def _planned_loader(plan: Plan, model: str | None) -> str:
    """The program's load_model: the model as `model` (default: the plan's) names it, in the
    dtype the plan was profiled in."""
    loader = _model_loader(model if model is not None else plan.model)
    if plan.dtype != "float32":
        loader += _DTYPE_LOADER.replace("DTYPE", json.dumps(plan.dtype))
    return loader


_DTYPE_LOADER = '''

_load_float32 = load_model


def load_model() -> nn.Module:
    """The planned model in the dtype it was profiled in (gpipe-plan profile --dtype)."""
    model = _load_float32()
    module = model[0] if isinstance(model, tuple) else model  # (module, keyword inputs)
    if any(p.is_floating_point() for p in module.parameters()):
        module.to(getattr(torch, DTYPE))
    return model
'''


_CAPTURED_LOADER = '''

_load_module = load_model


def load_model() -> nn.Module:
    """The planned model's graph, captured (torch.export) and cut into layers as the profile was."""
    model = _load_module()
    if isinstance(model, tuple):  # (module, keyword inputs), as the factory may return
        model = with_inputs(*model)
    example = getattr(model, "example_input", None)
    if isinstance(example, torch.Tensor) and list(example.shape[1:]) == INPUT_SHAPE:
        sample = torch.cat([example, example])[:2]
        if sample.is_floating_point():  # in the planned dtype (a profile made with --dtype)
            sample = sample.to(getattr(torch, INPUT_DTYPE))
    elif INPUT_DTYPE.startswith(("float", "bfloat")):
        sample = torch.randn(2, *INPUT_SHAPE, dtype=getattr(torch, INPUT_DTYPE))
    else:
        sample = torch.zeros(2, *INPUT_SHAPE, dtype=getattr(torch, INPUT_DTYPE))
    return capture(model, sample)
'''


_NO_LOADER = '''

def load_model() -> nn.Module:
    """The plan names no model to load: it was profiled from a model object in Python."""
    raise NotImplementedError(
        f"{MODEL}: the plan was made from a model object, so this program cannot build it; "
        "construct the model and pass it to Pipeline"
    )
'''


def _example_source(name: str) -> tuple[str, str]:
    """The factory of example `name`, and its source with every top-level definition of
    profiler/examples.py it uses, directly or not, as written there (in file order)."""
    from profiler import examples

    if name not in examples.EXAMPLES:
        raise ValueError(
            f"no example named {name!r}; choose one of {', '.join(sorted(examples.EXAMPLES))}"
        )
    source = Path(examples.__file__).read_text()
    lines = source.splitlines()
    defs: dict[str, ast.stmt] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defs[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defs.update((t.id, node) for t in targets if isinstance(t, ast.Name))
    needed: set[str] = set()
    factory = examples.EXAMPLES[name].__name__
    todo = [factory]
    while todo:
        if (d := todo.pop()) not in needed:
            needed.add(d)
            todo += [n.id for n in ast.walk(defs[d]) if isinstance(n, ast.Name) and n.id in defs]
    chunks = []
    for node in dict.fromkeys(defs[d] for d in needed):  # one chunk per statement
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        chunks.append((first, "\n".join(lines[first - 1 : node.end_lineno])))
    return factory, "\n\n\n".join(text for _, text in sorted(chunks))


def _py_list(name: str, items: list[str], indent: int = 4) -> str:
    """`NAME = [a, b]` as a formatter would write it `indent` spaces in (4: at class level):
    one line when it fits."""
    flat = f"{name} = [{', '.join(items)}]"
    if len(flat) + indent <= 100:
        return flat
    body = "".join(f"{' ' * (indent + 4)}{item},\n" for item in items)
    return f"{name} = [\n{body}{' ' * indent}]"
