"""gpipe-plan: the command line, a thin shell over profiler/, planner/, schedules/ and codegen/.

Exit status: 0 done, 1 a check failed or no split fits (with a table), 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from profiler.artifact import InputError
from profiler.files import check_distinct, check_output, write_output
from profiler.limits import MAX_BATCH, MAX_DEVICES, MAX_MS, ArgumentError

if TYPE_CHECKING:
    from profiler.types import Profile

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

# The library names its arguments as Python does; the CLI reports them under its own flags.
FLAGS = {
    "batch_size": "--batch-size",
    "microbatches": "--microbatches",
    "schedule": "--schedule",
    "recompute": "--recompute",
    "optimizer": "--optimizer",
    "solver": "--solver",
    "num_devices": "--devices",
    "memory": "--memory",
    "bandwidth": "--bandwidth",
    "latency_ms": "--latency-ms",
    "steps": "--steps",
    "tolerance": "--tolerance",
    "batch_sizes": "--batch-sizes",
    "repeats": "--repeats",
    "warmup": "--warmup",
    "threads": "--threads",
    "time_budget_s": "--time-budget",
    "loss_fn": "--loss",
    "device": "--device",
    "input_shape": "--input-shape",
    "max_repeats": "--max-repeats",
    "time_limit_s": "--time-limit",
    "checkpoint": "--checkpoint-layers",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line and exit status 2, like any other bad input."""

    def error(self, message: str) -> NoReturn:
        raise InputError(f"{message} (see {self.prog} --help)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    own = argv is None  # the process's own entry point (not a caller's, in process)
    if own and sys.stdout is None:  # (started with its stdout closed: `gpipe-plan ... >&-`)
        if sys.stderr is not None:
            print("gpipe-plan: error: cannot write the output (stdout is closed)", file=sys.stderr)
        return EXIT_BAD_INPUT  # (not check's 1, which a CI job reads as over budget)
    try:
        if own:  # a file name that is not UTF-8 is shown escaped, not an error at the end
            for stream in (sys.stdout, sys.stderr):
                if hasattr(stream, "reconfigure") and not stream.closed:
                    stream.reconfigure(errors="backslashreplace")
        try:
            os.getcwd()
        except FileNotFoundError:
            raise InputError(
                "the current directory no longer exists; cd somewhere that does"
            ) from None
        _no_empty_values(args_list)
        args = parser.parse_args(args_list)
        if args.command is None:
            raise InputError(
                "name a command: profile, links, plan, check, show, simulate, codegen, measure "
                "or schema (see gpipe-plan --help)"
            )
        try:
            code = int(args.run(args))
        except SystemExit as e:  # (argparse's are behind us: this is the user's code)
            raise InputError(
                f"the model, loss or program it runs called sys.exit({e.code!r}) during "
                f"`{args.command}`; gpipe-plan stopped there"
            ) from None
        sys.stdout.flush()  # a full disk or a closed pipe is found here, not at exit
        return code
    except InputError as e:
        if debug:
            raise
        print(f"gpipe-plan: error: {_cli_words(e, args_list)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM / SIGHUP during a launch
        print("gpipe-plan: interrupted", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    except BrokenPipeError:
        # `gpipe-plan show plan.json | head`: the reader left; stop quietly, as Unix tools do.
        # NOTE: point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as e:
        if e.errno not in _UNWRITABLE or e.filename is not None or not own:
            raise
        # the terminal's output cannot be written (`show plan.json > /dev/full`; files written
        # say so themselves): one line, and not check's 1, which a CI job reads as over budget
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"gpipe-plan: error: cannot write the output ({e.strerror})", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BaseException as e:
        # a model's own BaseException (not an Exception: what runs the model does not catch
        # it; found by a red team). A caller in process gets it back as raised.
        if isinstance(e, (Exception, SystemExit, GeneratorExit)) or not own or debug:
            raise
        try:
            text = str(e)
        except Exception:  # noqa: BLE001 - (its own __str__ may raise too)
            text = ""
        said = " ".join("".join(c if c.isprintable() else " " for c in text).split())
        said = said if len(said) <= 200 else said[:200] + "..."
        print(
            f"gpipe-plan: error: the model, loss or program raised {type(e).__name__}"
            f"{': ' + said if said else ''} (a BaseException, not an Exception); gpipe-plan "
            "stopped there",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT


_UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


def _no_empty_values(argv: list[str]) -> None:
    """An empty value is a mistake, never a choice: `--memory-budget "$BUDGET"` with the variable
    unset read as no budget at all (check then gated on the plan's own), `--bandwidth ""` as
    free links, `-o ""` as no report."""
    for k, a in enumerate(argv):
        if a == "--":  # (what follows is positional, a file named `-p=` say)
            break
        flag, eq, value = a.partition("=")
        if a.startswith("-") and eq and not value:
            raise InputError(f"{flag}: empty; give it a value, or leave the flag out")
        if a == "" and k > 0 and argv[k - 1].startswith("-") and "=" not in argv[k - 1]:
            raise InputError(f"{argv[k - 1]}: empty; give it a value, or leave the flag out")
        if a == "":
            raise InputError("an empty argument: name a file or a value")


def _cli_words(e: InputError, argv: list[str]) -> str:
    """The message, with a library argument renamed to the flag the user typed."""
    if not isinstance(e, ArgumentError):
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    if e.arg == "cluster":  # too many devices for the model: say it of what was given
        given = any(a == "--cluster" or a.startswith("--cluster=") for a in argv)
        flag = "--cluster" if given else "--devices"
        return e.named(flag, _given(argv, flag))
    flag = FLAGS.get(e.arg)
    return e.named(flag, _given(argv, flag)) if flag else str(e)


def _given(argv: list[str], flag: str | None) -> str | None:
    """What followed `flag` on the command line (`--flag v` or `--flag=v`), if it was there."""
    for k, a in enumerate(argv):
        if a == flag and k + 1 < len(argv):
            return argv[k + 1]
        if flag and a.startswith(flag + "="):
            return a[len(flag) + 1 :]
    return None


# ---------------------------------------------------------------------------------- commands


def cmd_profile(args: argparse.Namespace) -> int:
    out = check_output(args.output, inputs=_sources(args.model, args.loss))
    for flag, spec in (("MODEL", args.model), ("--loss", args.loss)):
        _recordable(flag, spec)  # the profile names them: refused now, not after the work

    from profiler.measure import profile_model
    from profiler.models import DTYPES, load_model, sample_input

    dtype = DTYPES[args.dtype]
    shape = _int_list(args.input_shape, "--input-shape") if args.input_shape else None
    sizes = _int_list(args.batch_sizes, "--batch-sizes") if args.batch_sizes else None
    if sizes is not None and min(sizes) <= 0:
        raise InputError(f"--batch-sizes {args.batch_sizes}: every size must be positive")
    if sizes is not None and len(set(sizes)) < len(sizes):
        raise InputError(f"--batch-sizes {args.batch_sizes}: a size given twice; give each once")
    if args.max_repeats is not None and args.max_repeats < args.repeats:
        raise InputError(
            f"--max-repeats {args.max_repeats} is below --repeats {args.repeats}: the most timed "
            "rounds cannot be fewer than the least"
        )
    model = load_model(args.model)
    check_output(args.output, inputs=_sources(args.model, args.loss))  # and what it imported
    if any(p.is_floating_point() for p in model.parameters()):
        model = model.to(dtype)
    sample = sample_input(model, shape, dtype)
    profile = profile_model(
        model,
        sample,
        device=args.device,
        batch_sizes=sizes,
        repeats=args.repeats,
        warmup=args.warmup,
        max_repeats=args.max_repeats,
        time_budget_s=args.time_budget,
        model_spec=args.model,
        loss_fn=args.loss,
        threads=args.threads,
    )
    _unsettled_note(profile)
    fwd = sum(x.forward_ms[profile.batch_sizes[-1]].median for x in profile.layers)
    loss = f" and its loss ({profile.loss.type})" if profile.loss is not None else ""
    # (and what it imported as it ran: found by a red team, a helper a layer's forward imports)
    check_output(args.output, inputs=_sources(args.model, args.loss))
    _said_then_written(
        f"profiled {len(profile.layers)} layers of {args.model}{loss} on {profile.device_name} "
        f"at batch sizes {profile.batch_sizes} (forward {fwd:.2f} ms at "
        f"{profile.batch_sizes[-1]}{_runtime_note(profile.runtime)}) -> {out}",
        lambda: profile.save(out),
    )
    return EXIT_OK


def _unsettled_note(profile: Any) -> None:
    """On stderr: the timings that stopped before they settled (the plan balances what they
    measured), with the noisiest, and what to do about it."""
    from profiler.timing import TARGET_RSE, unsettled

    count, total, worst = unsettled(profile.layers)
    if worst is None:
        return
    layer, figure, size, rse = worst
    print(
        f"note: {count} of {total} timed figures did not settle to +-{100 * TARGET_RSE:g}% "
        f"within --time-budget / --max-repeats (the noisiest: layer {layer.index} "
        f"({layer.type}) {figure} at size {size}, +-{100 * rse:.1f}%): the plan balances what "
        "they measured; profile again with a larger --time-budget (or --max-repeats), or on a "
        "quieter machine",
        file=sys.stderr,
    )


def _runtime_note(runtime: Any) -> str:
    if runtime is None:
        return ""
    return f"; the runtime adds {runtime.action_ms:.3f} ms per action, {runtime.step_ms:.2f} ms per step"


def cmd_plan(args: argparse.Namespace) -> int:
    out = check_output(
        args.output, inputs=[args.profile, *([args.cluster] if args.cluster else [])]
    )
    from profiler.types import Profile

    # The profile lives until the plan is made (on 10 000 layers about a million objects, no
    # cycles among them): the collector need not rescan them each time the search's own
    # objects trigger it, nor once as it is switched back on after the load (0.2 s there).
    # Given back after, for a caller that goes on in this process.
    was = gc.isenabled()
    gc.disable()
    try:
        profile = Profile.load(args.profile)
        gc.freeze()
    finally:
        if was:
            gc.enable()
    try:
        return _plan(args, out, profile)
    finally:
        gc.unfreeze()


def _plan(args: argparse.Namespace, out: Path, profile: Profile) -> int:
    from planner import InfeasibleError, plan_pipeline

    cluster = _cluster(args, len(profile.layers))
    microbatches: int | str = "auto"
    if args.microbatches != "auto":
        microbatches = _whole(args.microbatches, "--microbatches", "auto or a whole number")
    if args.allow_reorder and args.time_limit is None and not sys.stderr.isatty():
        # (a terminal shows a bar over the orders; elsewhere a search of many orders was
        # minutes of silence: found by a red team, 12 devices of 4 sizes past 5 minutes)
        orders = len(cluster.placements()[0])
        if orders > 8:
            print(
                f"note: --allow-reorder searches {orders} device orders, each a search of its "
                "own (minutes, on many devices); --time-limit SECONDS bounds it",
                file=sys.stderr,
            )
    try:
        plan = plan_pipeline(
            profile,
            cluster,
            args.batch_size,
            microbatches=microbatches,
            schedule=args.schedule,
            recompute=args.recompute,
            optimizer=args.optimizer,
            solver=args.solver,
            time_limit_s=args.time_limit,
            allow_reorder=args.allow_reorder,
            target=args.target,
            checkpoint=_checkpoint_arg(args.checkpoint_layers, len(profile.layers)),
        )
    except InfeasibleError as e:
        print(f"gpipe-plan: {e}", file=sys.stderr)
        if e.closest is not None:
            print(_stage_table(e.closest), file=sys.stderr)
        return EXIT_FAILED
    _said_then_written(f"{_summary(plan)}\n{_stage_table(plan)}", lambda: plan.save(out))
    if not plan.loss:
        print(
            "note: the profile has no loss, so the last stage's loss is not in this plan "
            "(profile with --loss)",
            file=sys.stderr,
        )
    if plan.optimizer not in profile.optimizer_step:  # (an older or edited profile)
        print(
            f"note: the profile measured no {plan.optimizer} step, so the temporaries of the "
            "optimizer step are not in this plan (profile again to measure them)",
            file=sys.stderr,
        )
    sizes = profile.batch_sizes
    used = [plan.microbatch_size]  # (and an uneven batch's smaller ones: counted at their
    # own size, or at the larger, whose figures stand for them unmeasured below the profile)
    used += [used[0] - 1] if plan.batch_size % plan.microbatches else []
    if outside := [mb for mb in used if mb not in sizes and not sizes[0] < mb < sizes[-1]]:
        named = " and ".join(map(str, outside))
        print(
            f"note: micro-batches of {named} lie outside the profiled batch sizes "
            f"({', '.join(map(str, sizes))}): their costs are extended from them, not measured "
            f"(profile with --batch-sizes including {named})",
            file=sys.stderr,
        )
    print(f"wrote {out}")
    return EXIT_OK


def _said_then_written(lines: str, write: Callable[[], None]) -> None:
    """The terminal's lines, then the file: where they cannot be written (`> /dev/full`), no
    file is (found by a red team: the file was written, then the command exited 2, which says
    nothing was done). A reader that left (`| head`) does not cost the file: it is written,
    then the pipe's end reported."""
    try:
        print(lines)
        sys.stdout.flush()
    except BrokenPipeError:
        write()
        raise
    write()


def _held_as_planned(plan: Any, path: str) -> None:
    """The gate reads each device's total: refuse a plan whose totals are not what its stages'
    bytes give through its own schedule (the simulator's peaks), as after a hand edit."""
    from planner import format_size
    from planner.search import simulate_plan
    from planner.version import VERSION

    made_by = plan.meta.tool_version
    why = (
        "the plan was edited"
        if made_by == VERSION
        else f"the plan was edited, or made by another version (gpipe-plan "
        f"{made_by or 'unnamed'}; this is {VERSION})"
    )
    try:
        timeline = simulate_plan(plan, levels=False)
    except Exception as e:  # a plan that validates but that no schedule runs: refused too
        raise InputError(
            f"{path}: its stages cannot be simulated ({type(e).__name__}: {e}); plan again"
        ) from None
    peaks = timeline.peak_memory
    said = plan.predicted
    for what, stated, got in (
        ("step time", said.iteration_ms, timeline.makespan),
        ("bubble fraction", said.bubble_fraction, timeline.bubble_fraction),
    ):
        if not math.isclose(stated, got, rel_tol=1e-9, abs_tol=1e-12):
            raise InputError(
                f"{path}: its predicted {what} ({stated:.6g}) is not what its schedule gives "
                f"({got:.6g}): {why}; plan again"
            )

    ms = timeline.makespan
    rate = plan.batch_size / ms * 1e3 if ms > 0 else 0.0
    if not math.isclose(said.throughput_samples_per_s, rate, rel_tol=1e-9, abs_tol=1e-12):
        raise InputError(
            f"{path}: its predicted throughput ({said.throughput_samples_per_s:.6g} samples/s) "
            f"is not its batch of {plan.batch_size} per step ({rate:.6g}): {why}; plan again"
        )

    def size(n: int, other: int) -> str:
        """Rounded, or in bytes where the rounded figures would read alike."""
        return f"{n} B" if format_size(n) == format_size(other) else format_size(n)

    for d, peak in zip(plan.devices, peaks):
        if d.total != peak:
            raise InputError(
                f"{path}: {d.name}'s total ({size(d.total, peak)}) is not what its stages "
                f"hold ({size(peak, d.total)}): {why}; plan again"
            )
    if plan.predicted.peak_memory != peaks:
        raise InputError(
            f"{path}: its predicted peaks are not what its stages hold: {why}; plan again"
        )


def cmd_check(args: argparse.Namespace) -> int:
    from planner import Plan, format_size, parse_size

    plan = Plan.load(args.plan)
    budget = (
        parse_size(args.memory_budget, "--memory-budget")
        if args.memory_budget is not None
        else None
    )
    _held_as_planned(plan, args.plan)
    limits = [budget if budget is not None else d.budget for d in plan.devices]
    over = [(d, lim) for d, lim in zip(plan.devices, limits) if d.total > lim]
    bubble = plan.predicted.bubble_fraction
    bubble_bad = args.max_bubble is not None and bubble > args.max_bubble
    if over:
        rows = [
            [
                d.name,
                ",".join(map(str, d.stages)),
                _layers(plan, d.stages),
                format_size(d.total),
                format_size(lim),
                format_size(d.total - lim),
            ]  # fmt: skip
            for d, lim in over
        ]
        print(f"FAIL: {len(over)} of {len(plan.devices)} devices over the memory budget")
        print(_table(["device", "stages", "layers", "needs", "budget", "over by"], rows))
    if bubble_bad:
        print(f"FAIL: bubble fraction {bubble:.3f} exceeds --max-bubble {args.max_bubble:g}")
    if over or bubble_bad:
        return EXIT_FAILED
    fullest, limit = max(zip(plan.devices, limits), key=lambda p: p[0].total / p[1])
    print(
        f"ok: {len(plan.devices)} devices fit (fullest: {fullest.name}, "
        f"{format_size(fullest.total)} of {format_size(limit)}, "
        f"{100 * fullest.total / limit:.0f}%); bubble {bubble:.3f}"
        + (f" <= {args.max_bubble:g}" if args.max_bubble is not None else "")
    )
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from planner import Plan, format_size
    from planner.search import simulate_plan
    from schedules import ascii_timeline, gantt_png, write_chrome_trace

    outputs = {"--chrome-trace": args.chrome_trace, "--png": args.png}
    for flag, out in outputs.items():
        if out:
            check_output(out, flag=flag, inputs=[args.plan])  # fail now, not after the work
    check_distinct(outputs)
    if args.png:
        _needs_matplotlib()  # before anything is written
    plan = Plan.load(args.plan)
    torchrun = (args.target or plan.target) == "torchrun"
    tl = simulate_plan(plan, rendezvous=torchrun)
    note = ""
    if torchrun and len(plan.devices) > 1:
        free = simulate_plan(plan, levels=False, rendezvous=False).makespan
        free += plan.cluster.step_sync_ms or 0.0  # (the step's all-reduces: paid either way)
        note = f" (the torchrun program; {free:.3f} ms where sends never wait)"
    print(
        f"{plan.schedule}, {len(plan.devices)} devices x {plan.stages_per_device} stage(s), "
        f"M={plan.microbatches}: makespan {tl.makespan:.3f} ms, bubble {tl.bubble_fraction:.3f}"
        + note
    )
    rows = [
        [
            d.name,
            f"{100 * u:.1f}%",
            f"{tl.busy[k]:.2f}",
            format_size(tl.peak_memory[k]),
            format_size(d.budget),
        ]
        for k, (d, u) in enumerate(zip(plan.devices, tl.utilisation))
    ]
    print(_table(["device", "utilisation", "busy ms", "peak memory", "budget"], rows))
    print(ascii_timeline(tl))
    if args.chrome_trace:
        write_output(args.chrome_trace, lambda p: write_chrome_trace(tl, p))
        print(f"wrote {args.chrome_trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.png:
        try:
            write_output(args.png, lambda p: gantt_png(tl, p))
        except RuntimeError as e:
            raise InputError(str(e)) from None
        print(f"wrote {args.png}")
        suffix = Path(args.png).suffix
        if suffix and suffix.lower() != ".png":  # (a red team's .svg got PNG data unsaid)
            print(f"note: --png writes a PNG image, whatever {args.png} ends with", file=sys.stderr)
    return EXIT_OK


def _planned_model(spec: str, plan: Any, path: str) -> Any:
    """MODEL as the plan's layers: an nn.Sequential, or its graph captured as the profile did."""
    from codegen.pipe import layers_mismatch
    from profiler.models import as_layers, capture_sample, in_dtype, load_model

    model = in_dtype(load_model(spec), plan.dtype)
    try:
        layers = as_layers(model, capture_sample(model, plan.input_shape, plan.input_dtype))
    except InputError as e:  # on the plan's input: perhaps not the plan's model at all
        if spec == plan.model:
            raise
        raise InputError(
            f"{spec} does not run on the plan's input (the plan was made for {plan.model}): {e}"
        ) from None
    mismatch = layers_mismatch(layers, plan)
    if mismatch and spec != plan.model:  # (another model: say that first; a cold review's)
        raise InputError(
            f"{path} was made for a different model ({plan.model}); profile and plan {spec} first"
        )
    if mismatch:
        raise InputError(f"{path}: {mismatch}")
    return layers


def _same_model(layers: Any, plan: Any, args: argparse.Namespace) -> None:
    """Refuse MODEL where its layers are not the ones the plan was made for (their digest)."""
    from profiler.models import model_digest

    if model_digest(layers) == plan.model_digest:
        return
    if args.model == plan.model:  # (found by a red team: "made for a different model (m.py)")
        raise InputError(
            f"{args.plan} was made for a different model: {plan.model} has other layers or "
            "parameters than when it was profiled; profile and plan it again"
        )
    raise InputError(
        f"{args.plan} was made for a different model ({plan.model}); profile and plan "
        f"{args.model} first"
    )


def _host_available() -> int | None:
    """Bytes of memory this host has available (Linux's MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _resident() -> int | None:
    """Bytes this process holds in memory, None where unknown."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _runs_as_planned(model: Any, plan: Any, path: str) -> None:
    """Refuse, before a program is written, a plan its model would refuse once the program ran:
    a captured graph's routes that are not the model's, an input shape the model does not take
    (a forward on fake tensors: no memory, no compute)."""
    import torch
    from torch._subclasses import fake_tensor

    from codegen._dist_runtime import quiet_fake_tensors
    from codegen._runtime import routes_of

    # (a profile edited to fewer layers keeps the model's digest: the program would refuse)
    if len(list(model)) != plan.num_layers:
        raise InputError(
            f"{path} splits {plan.num_layers} layers, but the model has {len(list(model))}; "
            "profile and plan it again"
        )
    if plan.captured:
        routes = sorted(routes_of(list(model), [tuple(st.layers) for st in plan.stages]))
        if routes != sorted(tuple(r) for r in plan.routes):
            raise InputError(
                f"{path}: its routes {[list(r) for r in plan.routes]} are not what the model's "
                f"graph sends along its stages ({[list(r) for r in routes]}); plan it again"
            )
        return  # (its input shape: the graph was just captured from it)
    # what fake tensors cannot tell (a value that depends on the data, an operator with no
    # fake kernel): the run will; a model that does either is not refused for it
    unknowable = (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
                  fake_tensor.UnsupportedOperatorException)  # fmt: skip
    try:
        with (
            quiet_fake_tensors(),
            torch.no_grad(),
            fake_tensor.FakeTensorMode(allow_non_fake_inputs=True),
        ):
            x = torch.empty((plan.microbatch_size, *plan.input_shape),
                            dtype=getattr(torch, plan.input_dtype))  # fmt: skip
            model(x)
    except unknowable:
        pass
    except Exception as e:  # noqa: BLE001 - what the program would meet at its first step
        raise InputError(
            f"{path}: the model does not run on the plan's input shape {plan.input_shape} "
            f"({type(e).__name__}: {e}); where the model is at fault, mend it; where its input "
            "changed since, profile and plan it again"
        ) from None


def cmd_codegen(args: argparse.Namespace) -> int:
    out = check_output(args.output, inputs=[args.plan, *_sources(args.model)])
    from codegen.emit import emit_program
    from planner import Plan

    plan = Plan.load(args.plan)
    model = _planned_model(args.model, plan, args.plan)
    _same_model(model, plan, args)
    check_output(args.output, inputs=[args.plan, *_sources(args.model)])
    _runs_as_planned(model, plan, args.plan)
    _held_as_planned(plan, args.plan)  # (what check refuses is not compiled either)
    asked, args.target = args.target, args.target or plan.target
    if args.target == "torch-pipelining":
        from codegen.emit import pipelining_refusal

        refusal = pipelining_refusal(plan)
        if refusal is None:  # (not captured: the plan's layers in a row)
            from codegen._pipelining import tied_across

            stages = [st.layers for st in plan.stages]
            refusal = tied_across(list(model), stages, [st.rank for st in plan.stages])
        if refusal is not None:
            raise InputError(refusal)
    if args.check_streams and args.target != "streams":
        raise InputError(
            f"--check-streams checks the streams target's CUDA streams; --target {args.target} "
            "has none"
        )
    source = emit_program(plan, target=args.target, model=args.model)
    _no_module_shadowed(args.output, source)
    # the stream check runs the program before it is written: where it cannot run the model
    # (it says why, in one line), nothing is written, and an earlier file stays as it was
    checked = _check_program_streams(source, args.output) if args.check_streams else EXIT_OK
    if checked == 2:
        return EXIT_BAD_INPUT
    run = (
        f"python {args.output}"
        if args.target == "streams"
        else f"torchrun --nproc-per-node {len(plan.devices)} {args.output}"
    )
    check_output(args.output, inputs=[args.plan, *_sources(args.model)])  # (and as it ran)
    _said_then_written(
        f"wrote {args.output}: {plan.schedule} over {len(plan.devices)} device(s), "
        f"{len(plan.stages)} stage(s), M={plan.microbatches}; run it with: {run}",
        lambda: write_output(out, source),
    )
    _other_target(plan, args.plan, asked)  # (once nothing is refused: errors are one line)
    return checked


def _check_program_streams(source: str, name: str) -> int:
    """What `python PROGRAM --check-streams` does, on the program just written."""
    import types

    program = types.ModuleType("gpipe_plan_program")
    program.__file__ = name
    exec(compile(source, name, "exec"), program.__dict__)
    if sys.stdout is not None:
        sys.stdout.flush()
    return int(program.check_streams())  # 0 clean, 1 problems listed, 2 it could not run


def _loss_named(plan: Any, path: str, given: str | None) -> None:
    """measure runs the loss the plan was profiled with. One that is code (pkg.mod:fn or
    file.py:fn) runs only where the command line names it too: a plan file alone does not make
    gpipe-plan import and run a module (found by a red team)."""
    from profiler.losses import BUILT_IN

    if given is not None and given != plan.loss:
        raise InputError(
            f"--loss {given}: {path} was profiled with "
            + (f"the loss {plan.loss}" if plan.loss else "no loss")
            + ", and its memory figures include it; give that, or plan again"
        )
    if plan.loss and plan.loss not in BUILT_IN and ":" in plan.loss and given is None:
        raise InputError(
            f"{path} names its loss as code ({plan.loss}); measure runs only code its command "
            f"line names: add --loss {plan.loss}"
        )


def cmd_measure(args: argparse.Namespace) -> int:
    tolerance = _fraction(args.tolerance, "--tolerance") + 0.0  # (-0 is 0; before torch loads)
    out = (
        check_output(args.output, inputs=[args.plan, *_sources(args.model)])
        if args.output
        else None
    )
    from codegen.measure import make_data, measure_torchrun
    from codegen.pipe import StageError, compile_pipe
    from planner import Plan

    plan = Plan.load(args.plan)
    _held_as_planned(plan, args.plan)  # (its figures are the gate here too)
    _loss_named(plan, args.plan, args.loss)
    model = _planned_model(args.model, plan, args.plan)
    if args.output:
        check_output(args.output, inputs=[args.plan, *_sources(args.model)])
    _same_model(model, plan, args)
    _host_holds(plan, args.target or plan.target)
    if (args.target or plan.target) == "torchrun":
        # each rank with one thread, as torchrun runs them (found by a review: the profile's
        # threads here would hide how far a profile of more is from the job as it runs)
        if plan.threads not in (None, 1):
            print(
                f"note: the profile measured with {plan.threads} threads and torchrun runs each "
                "rank with one (OMP_NUM_THREADS=1): some kernels' memory and every time differ "
                "with them; profile with --threads 1",
                file=sys.stderr,
            )
        report = measure_torchrun(plan, args.model, steps=args.steps, tolerance=tolerance)
    else:
        import warnings

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # every stage on the CPU: said in the report
                pipe = compile_pipe(model, plan)
            x, y, loss_fn = make_data(model, plan)
            report = pipe.measure(x, y, loss_fn, steps=args.steps, tolerance=tolerance)
        except InputError:
            raise
        except StageError as e:
            raise InputError(f"the pipeline failed: {e}") from e
        except Exception as e:  # the user's model (or a hand-edited plan) on real data
            raise InputError(f"the pipeline failed: {type(e).__name__}: {e}") from e
    _other_target(plan, args.plan, args.target)  # (once it ran: errors are one line)
    if out is None:
        print(_measure_table(report))
    else:  # (a reader that left, `| true`, does not cost the report: found by a red team)
        text = report.model_dump_json(indent=1) + "\n"
        check_output(args.output, inputs=[args.plan, *_sources(args.model)])  # (and as it ran)
        _said_then_written(
            f"{_measure_table(report)}\nwrote {args.output}", lambda: write_output(out, text)
        )
    if not report.ok:
        over = _over(report, tolerance)
        print(
            f"FAIL: measured peak memory exceeds the prediction by more than "
            f"{100 * tolerance:g}% on {', '.join(over)}"
        )
        return EXIT_FAILED
    return EXIT_OK


def _other_target(plan: Any, path: str, target: str | None) -> None:
    """A note where a plan for one of our programs is run as the other: what it predicts is
    the program it was made for."""
    if target in ("streams", "torchrun") and target != plan.target:
        print(
            f"note: {path} predicts the {plan.target} program, not the {target} one: their step "
            f"times differ, and a weight that stages on several devices share keeps its "
            f"optimizer state on each of them under torchrun, on the first alone in streams "
            f"(plan with --target {target} for the {target} program's figures)",
            file=sys.stderr,
        )


def _host_holds(plan: Any, target: str) -> None:
    """Without a GPU every device of the run is this host's memory: refuse a plan whose
    predicted peaks and mini-batch (one per rank under torchrun) are more than it has free,
    instead of meeting the out-of-memory killer."""
    import torch

    free = _host_available()
    if torch.cuda.is_available() or free is None:
        return
    batch = (
        plan.batch_size
        * math.prod(plan.input_shape)
        * torch.empty((), dtype=getattr(torch, plan.input_dtype)).element_size()
    )
    copies = len(plan.devices) if target == "torchrun" else 1
    need = sum(plan.predicted.peak_memory) + copies * batch
    if need > free:
        from planner import format_size

        raise InputError(
            f"measuring this plan here needs about {format_size(need)} (every device's "
            f"predicted peak and the mini-batch, all in this host's memory), more than the "
            f"{format_size(free)} it has free; measure a smaller batch"
        )


def _over(report: Any, tolerance: float) -> list[str]:
    """The devices whose measured peak exceeds their prediction by more than `tolerance`: by the
    bytes, as report.ok (found by a red team: one predicted at 0 bytes, its error 0 in percent,
    went unnamed in the FAIL line)."""
    return [
        d.name for d in report.devices
        if d.measured_peak_bytes > d.predicted_peak_bytes * (1 + tolerance)
    ]  # fmt: skip


def _measure_table(report: Any) -> str:
    from planner import format_size

    def memory_error(d: Any) -> str:  # (over a prediction of 0 bytes: no percent, the bytes)
        if d.predicted_peak_bytes == 0 and d.measured_peak_bytes > 0:
            return f"+{format_size(d.measured_peak_bytes)}"
        return f"{100 * d.memory_error:+.1f}%"

    rows = [
        [d.name, format_size(d.predicted_peak_bytes), format_size(d.measured_peak_bytes),
         memory_error(d), f"{d.predicted_ms:.2f}", f"{d.measured_ms:.2f}",
         f"{100 * d.time_error:+.1f}%"]
        for d in report.devices
    ]  # fmt: skip
    head = ["device", "predicted peak", "measured peak", "error", "busy ms (plan)",
            "busy ms (run)", "error"]  # fmt: skip
    actions = [
        [str(a.stage), a.kind, str(a.count), f"{a.predicted_ms:.3f}" if a.predicted_ms else "-",
         f"{a.measured_ms:.3f}", f"{100 * a.time_error:+.1f}%" if a.predicted_ms else "-"]
        for a in report.actions
    ]  # fmt: skip
    how = "devices at once" if report.concurrent else "one process, stages in turn"
    return "\n".join(
        [
            f"measured {report.steps} step(s) with the {report.target} target ({how}): step "
            f"{report.measured_step_ms:.2f} ms (median; {report.step_range_ms[0]:.2f} to "
            f"{report.step_range_ms[1]:.2f}), predicted {report.predicted_step_ms:.2f} ms "
            f"({100 * report.step_error:+.1f}%)",
            _table(head, rows),
            "",
            _table(["stage", "action", "count", "plan ms", "run ms (median)", "error"], actions),
        ]
    )


def _needs_matplotlib() -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise InputError("--png needs matplotlib: pip install 'gpipe-plan[plot]'")


def _fraction(text: str, flag: str) -> float:
    """`5%` or `0.05`."""
    body = text.strip()
    try:
        value = float(body[:-1]) / 100 if body.endswith("%") else float(body)
    except ValueError:
        raise InputError(f"{flag} {text!r}: expected a fraction such as 5% or 0.05") from None
    if not 0 <= value < 10:
        raise InputError(f"{flag} {text!r}: expected a fraction such as 5% or 0.05")
    if value >= 1 and not body.endswith("%"):
        # (found by a red team: 5, meant as 5%, was a gate of 500% that nothing fails)
        raise InputError(
            f"{flag} {text!r}: a bare number is a fraction, this one {100 * value:g}%; write "
            f"{body}% for {body} percent, or {100 * value:g}% if that is meant"
        )
    return value


def cmd_show(args: argparse.Namespace) -> int:
    from planner import Plan
    from planner.search import schedule_of
    from schedules import grid

    plan = Plan.load(args.plan)
    print(_summary(plan))
    print(_stage_table(plan))
    far = [(a, b) for a, b in plan.routes if b > a + 1]
    if far:  # a captured graph: what skips stages goes straight to the stage that reads it
        print("\nstraight to a later stage: " + ", ".join(f"{a} -> {b}" for a, b in far))
    if plan.alternatives:
        print("\n" + _runners_up(plan))
    print(f"\nschedule (rank x step; {plan.schedule}):")
    print(grid(schedule_of(plan)))
    return EXIT_OK


def cmd_links(args: argparse.Namespace) -> int:
    out = check_output(args.output)
    import subprocess
    import tempfile

    import torch

    from codegen.measure import _run, rank_error
    from planner import Cluster
    from planner.units import parse_size

    if args.memory is not None:
        parse_size(args.memory, what="memory")  # refused here, before anything is launched
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and torch.cuda.device_count() < args.nproc_per_node:
        raise InputError(
            f"--nproc-per-node {args.nproc_per_node}: NCCL needs a GPU per rank and this host "
            f"has {torch.cuda.device_count()}; measure fewer ranks, or --device cpu"
        )
    if device == "cpu" and args.memory is None:
        raise InputError("--memory is required on the CPU: what a stage may use, e.g. 16GiB")
    free, rank = _host_available(), _resident()
    if free is not None and rank is not None and args.nproc_per_node * rank > free:
        raise InputError(
            f"--nproc-per-node {args.nproc_per_node}: that many ranks of about {rank >> 20} "
            f"MiB each (torch loaded, as in this process) are more than the {free >> 20} MiB "
            "this host has free; measure fewer ranks"
        )
    root = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory(prefix="gpipe-links-") as tmp:
        result = Path(tmp) / "cluster.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.nproc_per_node}", "-m", "profiler.links",
               "--device", device,
               "--rounds", str(args.rounds), "--busy-ms", str(args.busy_ms),
               "--max-bytes", str(args.max_bytes), "-o", str(result),
               *(["--memory", args.memory] if args.memory is not None else [])]  # fmt: skip
        run: subprocess.CompletedProcess = _run(cmd, env, args.timeout)
        said = [line for line in run.stderr.splitlines() if line.startswith("links: error: ")]
        if said:
            raise InputError(said[0][len("links: error: ") :])
        if run.returncode != 0 or not result.exists():
            why = rank_error(run.stderr) or " | ".join(run.stderr.strip().splitlines()[-3:])
            raise InputError(f"the measuring ranks failed (exit {run.returncode}): {why}")
        cluster = Cluster.load(result)
    print(run.stdout.rstrip())
    write_output(out, cluster.model_dump_json(indent=1, exclude_none=True) + "\n")
    print(f"wrote {args.output}: {cluster.size} devices ({device}), links measured as "
          f"hand-offs after {args.busy_ms + 0.0:g} ms of compute")  # fmt: skip
    return EXIT_OK


def cmd_schema(args: argparse.Namespace) -> int:
    from planner import Cluster, Plan
    from profiler.types import Profile

    model = {"profile": Profile, "cluster": Cluster, "plan": Plan}[args.what]
    print(json.dumps(model.model_json_schema(), indent=2, sort_keys=True))
    return EXIT_OK


# ---------------------------------------------------------------------------------- helpers


def _cluster(args: argparse.Namespace, num_layers: int) -> Any:
    from planner import Cluster, parse_bandwidth, parse_size

    if args.cluster:
        flags = {"--devices": args.devices, "--memory": args.memory,
                 "--bandwidth": args.bandwidth, "--latency-ms": args.latency_ms}  # fmt: skip
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise InputError(
                f"give either --cluster or {given[0]} (the cluster file says what its devices "
                "and links are), not both"
            )
        return Cluster.load(args.cluster)
    if args.devices is None or args.memory is None:
        raise InputError("say where to run: --devices K --memory SIZE, or --cluster cluster.json")
    devices = _whole(args.devices, "--devices", "a whole number of devices")
    if devices < 1:
        raise InputError(f"--devices {args.devices}: need at least one device")
    if devices > num_layers:
        raise InputError(
            f"--devices {args.devices}: the model has only {num_layers} layers and every stage "
            f"needs at least one; use {num_layers} devices or fewer"
        )
    return Cluster.uniform(
        devices,
        parse_size(args.memory, "--memory"),
        bandwidth=parse_bandwidth(args.bandwidth, "--bandwidth") if args.bandwidth else None,
        latency_ms=0.0 if args.latency_ms is None else args.latency_ms,
    )


def _ranges(ks: list[int]) -> str:
    """[1, 2, 3, 5] as "1-3, 5"."""
    runs: list[list[int]] = []
    for k in ks:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _checkpoint_arg(text: str, num_layers: int) -> str | list[int]:
    """--checkpoint-layers: auto, none, or layer indices and ranges ("1,3,5-8")."""
    if text in ("auto", "none"):
        return "auto" if text == "auto" else []
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        a, b = _ascii_int(lo), _ascii_int(hi if sep else lo)
        a, b = (-1, -1) if a is None or b is None else (a, b)
        if not 0 <= a <= b < num_layers or len(part) > 40:
            raise InputError(
                f"--checkpoint-layers {text[:60]!r}: expected auto, none, or layers 0 .. "
                f"{num_layers - 1} such as 1,3,5-8"
            )
        out += range(a, b + 1)
    return sorted(set(out))


def _summary(plan: Any) -> str:
    p = plan.predicted
    return (
        f"{plan.model}: {len(plan.stages)} stages on {len(plan.devices)} devices, "
        f"batch {plan.batch_size} as {plan.microbatches} "
        f"micro-batches of <= {plan.microbatch_size}, schedule {plan.schedule}, "
        f"recompute {plan.recompute}"
        + (
            f" (layers {_ranges(plan.checkpointed)} each under a checkpoint of their own)"
            if plan.checkpointed
            else ""
        )
        + f", optimizer {plan.optimizer}\n"
        f"predicted {p.iteration_ms:.2f} ms/iteration"
        + (" (the torchrun program" + _synced(plan) + ")" if plan.target == "torchrun" else "")
        + f", bubble {p.bubble_fraction:.3f}, "
        f"{p.throughput_samples_per_s:.1f} samples/s "
        f"(solver {plan.solver.method}, "
        # (what `optimal` proves: the least bottleneck; with few micro-batches and slow links a
        # split with a larger one but cheaper fill and drain can take less time)
        f"{'bottleneck proven minimal' if plan.solver.optimal else 'bottleneck not proven minimal'}, "
        f"{plan.solver.candidates} candidates, {plan.solver.solved} solved, "
        f"{plan.solver.pruned} pruned by their bound"
        + (f" in {plan.solve_ms:.0f} ms)" if plan.solve_ms else ")")
        + (f"\nnot proven: {plan.solver.unproven}" if plan.solver.unproven else "")
        + (f"\nthe last stage includes the loss ({plan.loss})" if plan.loss else "")
    )


def _synced(plan: Any) -> str:
    """What of a torchrun plan's step is its two all-reduces (the cluster's step_sync_ms)."""
    sync = plan.cluster.step_sync_ms
    if not sync or len(plan.devices) < 2:
        return ""
    return f", {sync:.2f} ms of it the step's two all-reduces"


def _runners_up(plan: Any) -> str:
    """The alternatives the search weighed, best first, and why each lost."""
    from planner import format_size

    rows = [("runner-up", "predicted", "peak", "why not")]
    for a in plan.alternatives:
        ms = (
            f"{a.iteration_ms:.2f} ms"
            if a.iteration_ms is not None
            else f">= {a.at_least_ms:.2f} ms"
            if a.at_least_ms is not None
            else "-"
        )
        peak = format_size(a.peak_bytes) if a.peak_bytes is not None else "-"
        rows.append((f"M={a.microbatches} {a.schedule} {a.recompute}", ms, peak, a.reason))
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    return "\n".join(
        "  ".join(r[c].ljust(widths[c]) if c == 0 else r[c].rjust(widths[c]) for c in range(3))
        + "  "
        + r[3]
        for r in rows
    )


def _stage_table(plan: Any) -> str:
    from planner import format_size

    rows = []
    zero_bubble = plan.schedule == "zb-h1"
    for st in plan.stages:
        m = st.memory
        back = st.input_grad_ms + st.weight_grad_ms if zero_bubble else st.backward_ms
        rows.append(
            [
                str(st.index),
                st.device,
                f"{st.layers[0]}-{st.layers[1] - 1}",
                _types(st.layer_types),
                f"{st.forward_ms:.2f}",
                f"{back:.2f}",
                f"{st.recompute_ms:.2f}"
                + (f" {st.recompute}" if plan.recompute == "per_stage" else ""),
                f"{st.send_ms:.2f}",
                format_size(m.params + m.grads + m.optimizer),
                format_size(m.stashed_activations + m.loss),
                format_size(m.gradient_buffers),
                format_size(m.live_activations + m.optimizer_step),
                format_size(m.total),
                format_size(m.budget),
                (f"{100 * m.total / m.budget:.0f}%" if m.budget else "-")
                # (over where its device is, by what check gates: the stage's own figure may
                # be above its budget where the device's is not, on an uneven batch)
                + (" OVER" if m.total > m.budget and _device_over(plan.devices[st.rank]) else ""),
            ]
        )
    head = ["stage", "device", "layers", "types", "fwd ms", "I+W ms" if zero_bubble else "bwd ms",
            "recomp ms", "send ms", "weights+opt", "activations", "grad bufs", "transient",
            "total", "budget", "used"]  # fmt: skip
    table = _table(head, rows)
    # a device's own peak, where its stages' figures do not give it (two stages on it, or the
    # torchrun program's messages held where it posts them): the figure `check` gates
    own = [sum(st.memory.total for st in plan.stages if st.rank == k) for k in range(len(plan.devices))]  # fmt: skip
    if any(d.total != n for d, n in zip(plan.devices, own)):
        table += "\non each device, as its program holds it (what check gates): " + ", ".join(
            f"{d.name} {format_size(d.total)} of {format_size(d.budget)} "
            f"({100 * d.total / d.budget:.0f}%{' OVER' if d.total > d.budget else ''})"
            for d in plan.devices
        )
    return table


def _device_over(device: Any) -> bool:
    return device.total > device.budget


def _layers(plan: Any, stages: list[int]) -> str:
    return ",".join(f"{plan.stages[s].layers[0]}-{plan.stages[s].layers[1] - 1}" for s in stages)


def _types(types: list[str]) -> str:
    runs: list[list[Any]] = []
    for t in types:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    text = ", ".join(f"{n}x{t}" if n > 1 else t for t, n in runs)
    return text if len(text) <= 32 else text[:31] + "…"


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _int_list(text: str, flag: str) -> list[int]:
    # (an empty part, "1,,2" or "1,2,", is refused: found by a red team, as --checkpoint-layers
    # refuses it)
    values = [_ascii_int(v.strip()) for v in text.replace("x", ",").split(",")]
    if None in values or not values:
        raise InputError(f"{flag} {text!r}: expected whole numbers separated by commas")
    return values  # type: ignore[return-value]


def _recordable(flag: str, spec: str | None) -> None:
    """A name the profile records (its model, its loss) must be one line of at most 1024
    characters (profiler.limits.Text)."""
    if spec is None:
        return
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in spec):
        raise InputError(f"{flag} {spec!r}: a control character in the name; rename or move it")
    if len(spec) > 1024:
        raise InputError(
            f"{flag}: a name of {len(spec)} characters, past the 1024 a profile records; "
            "move it somewhere shorter"
        )


def _sources(*specs: str | None) -> list[str]:
    """Python files an output must not replace: those the specs (MODEL, --loss) name, found
    without running them, and every module this process has loaded (a model file's helpers)."""
    files = []
    for spec in specs:
        where = (spec or "").rpartition(":")[0]
        if where.endswith(".py"):
            files.append(where)
        elif where and where != "example":
            files += _module_file(where)
    loaded = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
    return files + [f for f in loaded if f]


def _no_module_shadowed(output: str, source: str) -> None:
    """A program written as NAME.py where NAME is a module it imports (itself, or through
    torch: every module this process has loaded by now, torch and the model's included), or
    one of gpipe-plan's, would be imported in its place by every program run from that folder,
    itself first: Python puts a script's folder first on its path (found by a red team: `-o
    torch.py`, or `-o json.py`, which broke every program run beside it). A standard module
    nothing loads (`test`, `this`) is a fine name (a review's)."""
    import ast

    path = Path(output)
    name = path.stem
    if path.suffix != ".py" or not name.isidentifier():
        return
    imported = {m.partition(".")[0] for m in list(sys.modules)}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module.partition(".")[0])
    if name in imported or name in OUR_MODULES:
        raise InputError(
            f"{output}: a program named {name}.py would be imported in place of the module "
            f"{name!r} by every program run from its folder, this one first; name it "
            f"otherwise, as {name}_pipeline.py"
        )


# gpipe-plan's own top-level modules (installed editable, they are found by its own finder)
OUR_MODULES = ("cli", "planner", "profiler", "schedules", "codegen")


def _module_file(name: str) -> list[str]:
    """Where `pkg.mod` lives, found on sys.path without importing (running) any of it."""
    from importlib.machinery import PathFinder

    parts, path, spec = name.split("."), None, None
    for k in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[: k + 1]), path)
        if spec is None:
            return []
        path = spec.submodule_search_locations
    return [spec.origin] if spec is not None and spec.origin else []


def _ascii_int(text: str, signed: bool = False) -> int | None:
    """Digits 0-9 alone (after a minus sign, `signed`) as an int, else None (found by a red
    team: int() also read "1_0", "+2", " 4" and other scripts' digits). Past 30 digits, a
    number past every limit (int() refuses 4 300 digits with a ValueError)."""
    if not re.fullmatch(r"-?[0-9]+" if signed else r"[0-9]+", text):
        return None
    if len(text) > 30:
        return -(10**30) if text.startswith("-") else 10**30
    return int(text)


def _whole(text: str, flag: str, what: str) -> int:
    """_ascii_int, signed, or one line saying what was expected."""
    value = _ascii_int(text, signed=True)
    if value is None:
        raise InputError(f"{flag} {text!r}: expected {what}")
    return value


def _number(flag: str, lo: float, hi: float) -> Callable[[str], float]:
    """A finite float flag in [lo, hi]."""

    def parse(text: str) -> float:
        try:  # (as _whole: float() also reads "1_0", " 4" and other scripts' digits)
            if "_" in text or not text.isascii() or text != text.strip():
                raise ValueError(text)
            value = float(text)
        except ValueError:
            raise InputError(f"{flag} {text!r}: expected a number") from None
        if not (lo <= value <= hi):  # NaN fails this too
            raise InputError(f"{flag} {text}: must be between {lo:g} and {hi:g}")
        return value

    return parse


def _share(flag: str) -> Callable[[str], float]:
    """A share in [0, 1], written 0.25 or 25%."""

    def parse(text: str) -> float:
        body = text.strip()
        try:
            value = float(body[:-1]) / 100 if body.endswith("%") else float(body)
        except ValueError:
            raise InputError(f"{flag} {text!r}: expected a share such as 0.25 or 25%") from None
        if not (0 <= value <= 1):  # NaN fails this too
            raise InputError(f"{flag} {text}: must be between 0 and 1 (0% and 100%)")
        return value

    return parse


def _message_size(text: str) -> int:
    """`--max-bytes`: a size as people write it (4MiB), 4 KiB to 1 GiB (a line needs two)."""
    from planner.units import parse_size

    value = parse_size(text, what="--max-bytes")
    if not 4096 <= value <= 2**30:
        raise InputError(
            f"--max-bytes {text}: must be from 4KiB (two sizes, 1 and 4 KiB, to fit a line "
            "through) to 1GiB"
        )
    return value


def _count(flag: str, hi: int, lo: int = 1) -> Callable[[str], int]:
    """A whole-number flag in [lo, hi]."""

    def parse(text: str) -> int:
        value = _whole(text, flag, "a whole number")
        if not lo <= value <= hi:
            raise InputError(f"{flag} {text}: must be from {lo} to {hi}")
        return value

    return parse


def _one_of(flag: str, allowed: tuple[str, ...]) -> Callable[[str], str]:
    """A flag taking one of `allowed`, checked where it is given: a bad value is refused even
    where a later flag of the same destination (an alias) would have replaced it."""

    def parse(text: str) -> str:
        if text not in allowed:
            raise InputError(f"{flag} {text[:60]}: expected one of {', '.join(allowed)}")
        return text

    return parse


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gpipe-plan", description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    from planner.version import VERSION

    # (the version a plan names in meta.tool_version, which `check` compares with its own)
    p.add_argument("--version", action="version", version=f"gpipe-plan {VERSION}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    sub_parser = sub.add_parser

    def add_parser(name: str, **kw: Any) -> argparse.ArgumentParser:
        # flags are translated by name (FLAGS): an abbreviation would slip past that
        return sub_parser(name, allow_abbrev=False, **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    s = sub.add_parser("profile", help="measure each layer of a model")
    s.add_argument("model", help="example:NAME, package.module:factory or path/to/file.py:factory")
    s.add_argument("--input-shape", help="full input shape, batch first, e.g. 8,128")
    s.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16", "float64"], default="float32"
    )
    s.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    s.add_argument("--batch-sizes", help="micro-batch sizes to measure, e.g. 1,2,4,8")
    s.add_argument("--loss", help="mse, cross_entropy or pkg.mod:fn (examples carry their own)")
    s.add_argument("--repeats", type=_count("--repeats", 10_000), default=5,
                   help="timed rounds at least (identical layers are timed together)")  # fmt: skip
    s.add_argument("--max-repeats", type=_count("--max-repeats", 100_000),
                   help="timed rounds at most, until the median is stable (default 100, or "
                   "--repeats where more)")  # fmt: skip
    s.add_argument("--time-budget", type=_number("--time-budget", 0, 86400), default=30.0,
                   help="seconds of timing beyond the minimum rounds")  # fmt: skip
    s.add_argument("--threads", type=_count("--threads", 1024),
                   help="intra-op threads while measuring (1 to match torchrun on CPU)")  # fmt: skip
    s.add_argument("--warmup", type=_count("--warmup", 1000, lo=0), default=2)
    s.add_argument("-o", "--output", default="profile.json")
    s.set_defaults(run=cmd_profile)

    s = sub.add_parser("plan", help="choose stages, micro-batches and recomputation")
    s.add_argument("profile")
    s.add_argument("--devices")
    s.add_argument("--memory", help="per device, e.g. 16GiB")
    s.add_argument("--bandwidth", help="between neighbouring devices, e.g. 25GB/s")
    s.add_argument("--latency-ms", type=_number("--latency-ms", 0, MAX_MS))
    s.add_argument("--cluster", help="cluster.json (see: gpipe-plan schema cluster)")
    s.add_argument("--batch-size", type=_count("--batch-size", MAX_BATCH), required=True)
    s.add_argument("--microbatches", default="auto")
    s.add_argument(
        "--schedule", default="auto", help="auto, gpipe, 1f1b, interleaved-1f1b or zb-h1"
    )
    s.add_argument("--recompute", "--checkpoint", dest="recompute", default="auto",
                   type=_one_of("--recompute", ("auto", "never", "except_last", "always",
                                                  "per_stage")),
                   help="auto, never, except_last, always, or per_stage: each stage its "
                        "own (--checkpoint is an alias)")  # fmt: skip
    s.add_argument("--checkpoint-layers", default="auto",
                   help="layers each run under an activation checkpoint of their own (keeping "
                        "only their input for backward): auto (tried where memory binds, with "
                        "--recompute auto), none, or layers such as 1,3,5-8")  # fmt: skip
    s.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="adam")
    s.add_argument(
        "--solver",
        choices=["auto", "probe", "dp", "cp-sat"],
        default="auto",
        help="probe (exact, fast; auto), dp (reference), cp-sat (re-solves the chosen plan with "
        "OR-tools and reports its bound)",
    )
    s.add_argument("--time-limit", type=_number("--time-limit", 0, 86400),
                   help="seconds: then return the best plan found so far, marked not proven "
                   "(CP-SAT's re-solve of it included; --solver dp finishes the split it is on)")  # fmt: skip
    s.add_argument("--allow-reorder", action="store_true",
                   help="let the planner choose which device runs which stage (hosts kept "
                        "together when the cluster gives links by host)")  # fmt: skip
    s.add_argument("--target", choices=["streams", "torchrun"], default="streams",
                   help="the program to plan for: streams (one process; a transfer never "
                   "holds its sender) or torchrun (a process per device; each rank waits in "
                   "its batches of sends and receives until every message in them has gone)")  # fmt: skip
    s.add_argument("-o", "--output", default="plan.json")
    s.set_defaults(run=cmd_plan)

    s = sub.add_parser("check", help="CI gate: exit 1 when a stage is over its memory budget")
    s.add_argument("plan")
    s.add_argument("--memory-budget", help="override every device's budget, e.g. 16GiB")
    s.add_argument("--max-bubble", type=_share("--max-bubble"),
                   help="fail when the bubble fraction is larger")  # fmt: skip
    s.set_defaults(run=cmd_check)

    s = sub.add_parser("show", help="print a plan")
    s.add_argument("plan")
    s.set_defaults(run=cmd_show)

    s = sub.add_parser("simulate", help="run a plan's schedule through the event simulator")
    s.add_argument("plan")
    s.add_argument("--chrome-trace", help="write a Chrome trace (Perfetto) JSON here")
    s.add_argument("--png", help="write a Gantt chart PNG here (needs matplotlib)")
    s.add_argument("--target", choices=["streams", "torchrun"],
                   help="the program to time (default: the plan's): streams, where a transfer "
                   "never holds its sender; torchrun, each rank held in its batch of sends and "
                   "receives until every message in it has gone")  # fmt: skip
    s.set_defaults(run=cmd_simulate)

    s = sub.add_parser("codegen", help="emit the pipeline program for a plan")
    s.add_argument("plan")
    s.add_argument("--model", required=True, help="the model the plan was made for")
    s.add_argument("--target", choices=["streams", "torchrun", "torch-pipelining"],
                   help="default: the plan's own target. "
                   "streams: one process, a CUDA stream per stage (CPU without CUDA); "
                   "torchrun: one process per device, over torch.distributed (gloo or NCCL); "
                   "torch-pipelining: the same on torch.distributed.pipelining's runtime")  # fmt: skip
    s.add_argument("-o", "--output", default="program.py")
    s.add_argument("--check-streams", action="store_true",
                   help="then run the program's CUDA stream code on the CPU under a "
                   "happens-before checker (as `python PROGRAM --check-streams`); exit 1 if it "
                   "finds a use of memory the streams do not order, 2 if it cannot run the "
                   "model")  # fmt: skip
    s.set_defaults(run=cmd_codegen)

    s = sub.add_parser("measure", help="run a plan and compare its predictions with the run")
    s.add_argument("plan")
    s.add_argument("--model", required=True, help="the model the plan was made for")
    s.add_argument("--target", choices=["streams", "torchrun"],
                   help="default: the plan's own target. streams: in this process (on CPU, "
                   "stages in turn: memory and per-action times compare); torchrun: one "
                   "process per device on this host")  # fmt: skip
    s.add_argument("--steps", type=_count("--steps", 10_000), default=3)
    s.add_argument("--tolerance", default="5%",
                   help="exit 1 when a device's measured peak exceeds its prediction by more")  # fmt: skip
    s.add_argument("--loss", help="the plan's loss, where it is code (pkg.mod:fn or file.py:fn): "
                   "measure runs only code its command line names")  # fmt: skip
    s.add_argument("-o", "--output", help="write the report as JSON here")
    s.set_defaults(run=cmd_measure)

    s = sub.add_parser("links", help="measure the links between this host's ranks; write a "
                       "cluster file")  # fmt: skip
    s.add_argument("--nproc-per-node", type=_count("--nproc-per-node", MAX_DEVICES, lo=2),
                   required=True, help="ranks to launch on this host (as torchrun's)")  # fmt: skip
    s.add_argument("--device", choices=["cpu", "cuda"],
                   help="cpu (gloo) or cuda (NCCL, a GPU per rank); default: cuda if present")  # fmt: skip
    s.add_argument("--memory", help="per device, e.g. 16GiB (on CUDA: each GPU's, by default)")
    s.add_argument("--threads", type=_count("--threads", 1024), default=1,
                   help="intra-op threads per rank (1, as the torchrun program runs)")  # fmt: skip
    s.add_argument("--rounds", type=_count("--rounds", 10_000), default=20,
                   help="hand-offs timed per message size and direction")  # fmt: skip
    s.add_argument("--busy-ms", type=_number("--busy-ms", 0, 10_000), default=1.0,
                   help="what the sender computes before each hand-off, while its receiver "
                   "waits (as a pipeline's stages do)")  # fmt: skip
    s.add_argument("--max-bytes", type=_message_size, default=4 * 2**20,
                   help="the largest message timed, e.g. 4MiB (sizes from 1 KiB, 4x apart)")  # fmt: skip
    s.add_argument("--timeout", type=_number("--timeout", 1, 86400), default=600.0,
                   help="seconds before the ranks are stopped")  # fmt: skip
    s.add_argument("-o", "--output", default="cluster.json")
    s.set_defaults(run=cmd_links)

    s = sub.add_parser("schema", help="print the JSON schema of a file kind")
    s.add_argument("what", choices=["profile", "cluster", "plan"])
    s.set_defaults(run=cmd_schema)
    return p


if __name__ == "__main__":
    sys.exit(main())
