"""Hostile input: nothing is destroyed, nothing hangs, no plan runs the wrong model, every bad
value is one line and exit status 2, and the same inputs give the same plan bytes."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from codegen.pipe import compile_pipe
from planner import Cluster, Plan, plan_pipeline
from planner.units import format_size, parse_size
from profiler.artifact import InputError
from profiler.files import check_output, write_output
from profiler.limits import ArgumentError
from tests.conftest import synthetic_profile
from tests.test_cli import assert_bad_input

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def prof(tmp_path: Path) -> Path:
    path = tmp_path / "prof.json"
    synthetic_profile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], sizes=(1, 2, 4, 8)).save(path)
    return path


@pytest.fixture
def plan_file(run_cli, prof: Path, tmp_path: Path) -> Path:
    out = tmp_path / "plan.json"
    args = ("--devices", 2, "--memory", "1MiB", "--batch-size", 8)
    assert run_cli("plan", prof, *args, "-o", out).code == 0
    return out


PLAN_ARGS = ("--devices", "2", "--memory", "1MiB", "--batch-size", "8")


def _snapshot(*paths: Path) -> list[tuple[int, bytes]]:
    return [(os.lstat(p).st_mode, p.read_bytes() if p.is_file() else b"") for p in paths]


# ------------------------------------------------------------------ outputs that must survive


def test_dev_null_as_output_is_refused_and_stays_a_device(run_cli, prof):
    r = run_cli("plan", prof, *PLAN_ARGS, "-o", "/dev/null")
    assert_bad_input(r, mentions="character device")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_fifo_as_output_is_refused_without_blocking(run_cli, prof, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert_bad_input(run_cli("plan", prof, *PLAN_ARGS, "-o", fifo), mentions="FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_fifo_nobody_writes_to_as_input_is_refused_not_waited_on(
    run_cli, prof, tmp_path, monkeypatch
):
    """A named pipe as the profile: read as it comes (a writer that starts late is waited
    for), but one that nobody writes to is refused in one line instead of hanging."""
    import threading

    import profiler.artifact as artifact

    monkeypatch.setattr(artifact, "FIFO_FIRST_S", 0.5)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert_bad_input(run_cli("plan", fifo, *PLAN_ARGS), mentions="a pipe that sent nothing")
    text = Path(prof).read_bytes()

    def write() -> None:
        with open(fifo, "wb") as f:  # blocks until the reader opens it
            f.write(text)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    r = run_cli("plan", fifo, *PLAN_ARGS, "-o", tmp_path / "plan.json")
    writer.join(5)
    assert r.code == 0, r.err
    assert (tmp_path / "plan.json").exists()


def test_directory_as_output_is_refused(run_cli, prof, tmp_path):
    assert_bad_input(run_cli("plan", prof, *PLAN_ARGS, "-o", tmp_path), mentions="directory")


def test_symlink_output_keeps_the_link_and_writes_its_target(run_cli, prof, tmp_path):
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target.name)
    assert run_cli("plan", prof, *PLAN_ARGS, "-o", link).code == 0
    assert link.is_symlink() and os.readlink(link) == target.name
    assert Plan.load(target).batch_size == 8


@pytest.mark.parametrize("via_link", [False, True])
def test_plan_refuses_to_overwrite_its_own_profile(run_cli, prof, tmp_path, via_link):
    given = prof
    if via_link:
        given = tmp_path / "alias.json"
        given.symlink_to(prof)
    before = _snapshot(prof, given)
    assert_bad_input(run_cli("plan", given, *PLAN_ARGS, "-o", prof), mentions="input")
    assert _snapshot(prof, given) == before


def test_plan_refuses_to_overwrite_its_cluster(run_cli, prof, tmp_path):
    cluster = tmp_path / "cluster.json"
    Cluster.uniform(2, "1MiB").save(cluster)
    before = cluster.read_bytes()
    r = run_cli("plan", prof, "--cluster", cluster, "--batch-size", 8, "-o", cluster)
    assert_bad_input(r, mentions="input")
    assert cluster.read_bytes() == before


def test_commands_refuse_to_overwrite_their_plan(run_cli, plan_file):
    before = plan_file.read_bytes()
    for args in (
        ("codegen", plan_file, "--model", "example:mlp", "-o", plan_file),
        ("simulate", plan_file, "--chrome-trace", plan_file),
        ("simulate", plan_file, "--png", plan_file),
        ("measure", plan_file, "--model", "example:mlp", "-o", plan_file),
    ):
        assert_bad_input(run_cli(*args), mentions="input")
    assert plan_file.read_bytes() == before


def test_profile_refuses_to_overwrite_the_model_file_before_profiling(
    run_cli, tmp_path, monkeypatch
):
    import profiler.measure

    model = tmp_path / "m.py"
    model.write_text(
        "import torch\n"
        "def f():\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
        "    m.example_input = torch.randn(2, 4)\n"
        "    return m\n"
    )
    before = model.read_bytes()
    monkeypatch.setattr(profiler.measure, "profile_model", _must_not_run)
    assert_bad_input(run_cli("profile", f"{model}:f", "-o", model), mentions="input")
    assert model.read_bytes() == before


def _must_not_run(*args, **kwargs):
    raise AssertionError("the work started before the output was checked")


def test_unwritable_output_is_refused_before_profiling(run_cli, monkeypatch):
    import profiler.measure

    monkeypatch.setattr(profiler.measure, "profile_model", _must_not_run)
    # /proc takes no new files, even for root (a chmod-ed directory would not stop root)
    r = run_cli("profile", "example:mlp", "-o", "/proc/gpipe-plan-test.json")
    assert_bad_input(r, mentions="cannot write")


def test_an_empty_output_path_is_refused_before_profiling(run_cli, monkeypatch, tmp_path):
    """Found by the CLI fuzz test: `-o ''` passed the check (os.stat says missing, realpath
    says the current directory), so the model was profiled before the write failed."""
    import profiler.measure

    monkeypatch.setattr(profiler.measure, "profile_model", _must_not_run)
    monkeypatch.chdir(tmp_path)
    r = run_cli("profile", "example:mlp", "-o", "")
    assert_bad_input(r, mentions="-o: empty")
    assert list(tmp_path.iterdir()) == []


def test_two_outputs_of_one_command_must_differ(run_cli, plan_file, tmp_path):
    out = tmp_path / "same.json"
    r = run_cli("simulate", plan_file, "--chrome-trace", out, "--png", out)
    assert_bad_input(r, mentions="--png")
    assert not out.exists()


def test_path_errors_name_the_flag_they_belong_to(run_cli, plan_file, tmp_path):
    r = run_cli("simulate", plan_file, "--chrome-trace", tmp_path / "nope" / "t.json")
    assert_bad_input(r, mentions="--chrome-trace")


def test_new_files_follow_the_umask_and_old_files_keep_their_mode(run_cli, prof, tmp_path):
    old = os.umask(0o027)
    try:
        fresh = tmp_path / "fresh.json"
        assert run_cli("plan", prof, *PLAN_ARGS, "-o", fresh).code == 0
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o640
        kept = tmp_path / "kept.json"
        kept.write_text("old")
        kept.chmod(0o604)
        assert run_cli("plan", prof, *PLAN_ARGS, "-o", kept).code == 0
        assert stat.S_IMODE(kept.stat().st_mode) == 0o604
    finally:
        os.umask(old)


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    out = tmp_path / "out.json"
    out.write_text("old")

    def broken(path: str) -> None:
        Path(path).write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_output(out, broken)
    assert out.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_check_output_leaves_nothing_behind(tmp_path):
    assert check_output(tmp_path / "new.json") == tmp_path / "new.json"
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ values the files may hold


def _mutated_profile(prof: Path, tmp_path: Path, edit) -> Path:
    data = json.loads(prof.read_text())
    edit(data)
    out = tmp_path / "bad_profile.json"
    out.write_text(json.dumps(data))  # json writes NaN / Infinity literals as given
    return out


@pytest.mark.parametrize(
    "edit, mentions",
    [
        (lambda d: d["layers"][2]["forward_ms"]["4"].update(median=float("inf")), "finite"),
        (lambda d: d["layers"][0]["backward_ms"]["1"].update(median=float("nan")), "finite"),
        (
            lambda d: [x["forward_ms"]["8"].update(median=float("inf")) for x in d["layers"]],
            "finite",
        ),
        (lambda d: d["layers"][1]["forward_ms"]["2"].update(median=1e308), "less than or equal"),
        (lambda d: d["layers"][1]["saved_bytes"].update({"2": -5}), "greater than or equal"),
        (lambda d: d["layers"][1]["forward_peak_bytes"].update({"2": -1}), "greater than or equal"),
        (lambda d: d["layers"][3]["shared_bytes"].update({"1": -1}), "greater than or equal"),
        (lambda d: d["layers"][0].update(param_bytes=10**40), "less than or equal"),
        (lambda d: d["layers"][4]["backward_weight_ms"].pop("8"), "every batch size"),
        (lambda d: d.update(batch_sizes=[1, 2, 4, 10**17]), "less than or equal"),
        # found by a red team: read as numbers, or a timing's stray key worded for Python
        (lambda d: d["layers"][1]["forward_ms"]["2"].update(median="0_5"), "valid number"),
        (lambda d: d["layers"][1]["forward_ms"]["2"].update(median=True), "valid number"),
        (lambda d: d["layers"][1]["forward_ms"]["2"].update(samples="3"), "valid integer"),
        (lambda d: d["layers"][1]["forward_ms"]["2"].update(foo=1), "extra inputs"),
        (lambda d: d.update(model="x\u200f\u200b"), "invisible character"),
        # found by a red team: a byte count of true read as 1, of "8" or 8.0 as 8
        (lambda d: d["layers"][1]["saved_bytes"].update({"2": True}), "valid integer"),
        (lambda d: d["layers"][0].update(param_bytes="4096"), "valid integer"),
        (lambda d: d["layers"][2].update(output_bytes=8.0), "valid integer"),
        (lambda d: d.update(input_bytes=True), "valid integer"),
    ],
)
def test_profiles_with_impossible_values_are_refused_at_load(
    run_cli, prof, tmp_path, edit, mentions
):
    bad = _mutated_profile(prof, tmp_path, edit)
    out = tmp_path / "plan.json"
    assert_bad_input(run_cli("plan", bad, *PLAN_ARGS, "-o", out), mentions=mentions, no_file=out)


@pytest.mark.parametrize(
    "device, mentions",
    [
        ({"speed": float("inf")}, "finite"),
        ({"speed": 0}, "greater than or equal to 0.001"),
        ({"memory_bytes": "1e400B"}, "finite"),
        ({"memory_bytes": -1}, "greater than 0"),
        ({"reserved_bytes": -1}, "greater than or equal"),
        ({"name": "dev0"}, "names must differ"),
        # found by the red team: read as "no split fits", and a host of no name accepted
        ({"reserved_bytes": "1MiB"}, "reserved_bytes (1048576) leaves nothing of"),
        ({"host": ""}, "at least 1 character"),
    ],
)
def test_cluster_files_with_impossible_values_are_refused(
    run_cli, prof, tmp_path, device, mentions
):
    data = json.loads(Cluster.uniform(2, "1MiB").canonical_json())
    data["devices"][1].update(device)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    r = run_cli("plan", prof, "--cluster", path, "--batch-size", 8, "-o", tmp_path / "p.json")
    assert_bad_input(r, mentions=mentions)


def _edited_plan(plan_file: Path, edit, reseal: bool = False) -> Path:
    """The plan file edited in place. `reseal`: its content digest made again, as a deliberate
    edit would (what the checks behind the digest are for)."""
    data = json.loads(plan_file.read_text())
    edit(data)
    if reseal:  # (an edit the plan's own validation refuses is refused before its digest)
        try:
            data["meta"]["content_digest"] = Plan.model_validate(data).digest()
        except ValueError:
            pass
    plan_file.write_text(json.dumps(data))
    return plan_file


def _overlap(d: dict) -> None:
    d["stages"][1]["layers"][0] -= 1
    d["stages"][1]["layer_types"].insert(0, "Synthetic")


def _gap(d: dict) -> None:
    d["stages"][1]["layers"][0] += 1
    d["stages"][1]["layer_types"].pop(0)


def _other_schedule(name: str) -> str:
    return "gpipe" if name == "interleaved-1f1b" else "interleaved-1f1b"


def _zero_budget(d: dict) -> None:
    for use in d["devices"]:
        use.update(budget=0, total=0)


@pytest.mark.parametrize(
    "edit, mentions",
    [
        (_overlap, "contiguous"),
        (_gap, "contiguous"),
        (lambda d: d["stages"][1].update(layers=[3, 5]), "cover"),
        (lambda d: d["stages"][0].update(device="dev1"), "cluster puts it on"),
        (lambda d: d.update(microbatch_size=3), "micro-batches of"),
        (lambda d: d.update(microbatches=16), "m <= n"),
        (lambda d: d["stages"][0].update(recompute="always"), "recompute"),
        (lambda d: d.update(schedule=_other_schedule(d["schedule"])), "stages_per_device"),
        (lambda d: d["devices"][0].update(stages=[0, 1]), "lists stages"),
        (_zero_budget, "greater than 0"),
        (lambda d: d["predicted"].update(iteration_ms=float("inf")), "finite"),
        (lambda d: d["stages"][0]["memory"].update(params=-1), "greater than or equal"),
    ],
)
@pytest.mark.parametrize("command", ["check", "show", "simulate", "codegen"])
def test_hand_edited_plans_that_misstate_the_run_are_refused(
    run_cli, plan_file, tmp_path, edit, mentions, command
):
    bad = _edited_plan(plan_file, edit)
    extra = ("--model", "example:mlp", "-o", tmp_path / "prog.py") if command == "codegen" else ()
    assert_bad_input(run_cli(command, bad, *extra), mentions=mentions)
    assert not (tmp_path / "prog.py").exists()


@pytest.mark.parametrize("edit", ["total", "peak", "stage"])
def test_check_refuses_totals_its_stages_do_not_give(run_cli, plan_file, edit):
    """Found by a user trial: a hand-edited device total passed the CI gate ("1000 B of 64
    MiB") while its stages held megabytes. check now holds every device's total, and the
    predicted peaks, to what the plan's own stages and schedule give."""

    def change(d: dict) -> None:
        if edit == "total":
            d["devices"][0]["total"] = 1000
        elif edit == "peak":
            d["predicted"]["peak_memory"][1] += 1
        else:  # a stage's bytes made smaller: its device's total no longer follows
            d["stages"][0]["state_bytes"]["activations"] //= 2

    assert run_cli("check", plan_file).code == 0
    assert_bad_input(run_cli("check", _edited_plan(plan_file, change)), mentions="edited")


def test_a_clusters_reserved_memory_edited_is_refused(run_cli, plan_file):
    """Found by a red team: a plan's cluster given 64 MiB less 1 byte of reserved memory (1 byte
    left for the stages) still passed `check`. Each stage's workspace is its device's reserved
    share."""
    bad = _edited_plan(
        plan_file, lambda d: [dev.update(reserved_bytes=1000) for dev in d["cluster"]["devices"]]
    )
    assert_bad_input(run_cli("check", bad), mentions="reserved_bytes")


def test_a_breakdown_that_is_not_the_bytes_check_simulates_is_refused(run_cli, plan_file):
    """Found by a red team: a device given 60 of its 64 MiB as reserved, its stages' workspace
    raised in the breakdown alone (and the plan resealed), passed `check` at 64%: the gate
    simulates state_bytes, which nothing tied to the breakdown. So was a stage's params set to
    0 with its total lowered to match."""
    half = 512 * 1024
    original = plan_file.read_text()

    def reserve(d: dict) -> None:
        d["cluster"]["devices"][0]["reserved_bytes"] = half
        share = half // d["stages_per_device"]
        for st in d["stages"]:
            if st["rank"] == 0:
                st["memory"]["workspace"] += share
                st["memory"]["total"] += share

    bad = _edited_plan(plan_file, reserve, reseal=True)
    assert_bad_input(run_cli("check", bad), mentions="state_bytes.static")

    def no_params(d: dict) -> None:
        m = d["stages"][0]["memory"]
        m["total"] -= m["params"]
        m["params"] = 0

    plan_file.write_text(original)
    bad = _edited_plan(plan_file, no_params, reseal=True)
    assert_bad_input(run_cli("check", bad), mentions="state_bytes.static")

    def step(d: dict) -> None:  # (the step's term: 0, or the step's temporaries)
        m = d["stages"][0]["memory"]
        m["total"] += 100 - m["optimizer_step"]
        m["optimizer_step"] = 100

    plan_file.write_text(original)  # (each edit above was made on the file in place)
    bad = _edited_plan(plan_file, step, reseal=True)
    assert_bad_input(run_cli("check", bad), mentions="neither 0 nor the step's temporaries")


def test_a_total_edited_by_one_byte_is_refused_in_bytes_by_check_and_measure(run_cli, plan_file):
    """Found by a red team: one byte more on a device's total read "dev1's total (4.55 MiB) is
    not what its stages hold (4.55 MiB)", and measure ran the edited plan and gated its run on
    the edited figure."""
    from planner.version import VERSION

    total = json.loads(plan_file.read_text())["devices"][1]["total"]
    bad = _edited_plan(plan_file, lambda d: d["devices"][1].update(total=total + 1), reseal=True)
    r = run_cli("check", bad)
    assert_bad_input(r, mentions=f"total ({total + 1} B) is not what its stages hold ({total} B)")
    assert "the plan was edited; plan again" in r.err  # (made by this version: nothing else)
    assert_bad_input(run_cli("measure", bad, "--model", "example:mlp"), mentions="edited")
    older = _edited_plan(bad, lambda d: d["meta"].update(tool_version="0.1.0"), reseal=True)
    assert (
        f"made by another version (gpipe-plan 0.1.0; this is {VERSION})"
        in run_cli("check", older).err
    )


def test_a_plan_of_recomputed_stages_from_before_0_4_is_made_again(run_cli, prof, tmp_path):
    """Found by a review: a plan made by 0.3 counts a recomputed stage's re-run as torch's
    checkpoint ran it (up to its last layer's last save, and later than B's start); the
    programs now re-run the stage whole at B's start, which holds more, so `check` would gate
    on figures below the run. Such a plan is refused wherever it is read; one that recomputes
    nothing is read as before."""
    for mode in ("always", "never"):
        out = tmp_path / f"{mode}.json"
        args = ("--devices", 2, "--memory", "1GiB", "--batch-size", 8, "--recompute", mode)
        assert run_cli("plan", prof, *args, "-o", out).code == 0
        assert run_cli("check", out).code == 0
        older = _edited_plan(out, lambda d: d["meta"].update(tool_version="0.3.0"), reseal=True)
        r = run_cli("check", older)
        if mode == "never":
            assert r.code == 0, r.err
            continue
        assert_bad_input(r, mentions="made by gpipe-plan 0.3.0")
        assert "plan again" in r.err
        assert_bad_input(run_cli("show", older), mentions="made by gpipe-plan 0.3.0")
        # (a version that is no release's is not one from before: read, no traceback)
        odd = _edited_plan(out, lambda d: d["meta"].update(tool_version="0.².0"), reseal=True)
        r = run_cli("show", odd)
        assert r.code == 0 and "Traceback" not in r.err, r.err


def test_a_plan_edited_anywhere_is_refused_wherever_it_is_read(run_cli, plan_file, tmp_path):
    """Found by a red team: a plan with `checkpointed` dropped (its program then held 2.6x the
    memory `check` passed), `optimizer` sgd made adam (no state counted), `dtype` or the layer
    count changed, or every byte figure halved and the totals made again with the project's
    own simulator, passed `check`: only what the figures say of one another was checked. The
    plan now carries the digest of its content, checked wherever it is read."""
    edits = [
        lambda d: d.update(checkpointed=[1]),
        lambda d: d.update(optimizer="adam" if d["optimizer"] != "adam" else "sgd"),
        lambda d: d.update(dtype="float64"),
        lambda d: d["stages"][0]["state_bytes"].update(
            activations=d["stages"][0]["state_bytes"]["activations"] // 2
        ),
    ]
    for edit in edits:
        edited = tmp_path / "edited.json"
        edited.write_text(plan_file.read_text())
        _edited_plan(edited, edit)
        for command in ("check", "show", "simulate"):
            r = run_cli(command, edited)
            assert_bad_input(r, mentions="its content is not what gpipe-plan wrote")
        r = run_cli("codegen", edited, "--model", "example:mlp", "-o", tmp_path / "p.py")
        assert_bad_input(r, mentions="edited since", no_file=tmp_path / "p.py")
        with pytest.raises(InputError, match="edited since"):
            Plan.load(edited)
    # without its digest: made before it was written, or taken out
    _edited_plan(edited, lambda d: d["meta"].pop("content_digest"))
    assert_bad_input(run_cli("check", edited), mentions="carries no digest of its content")
    # the file as written reads back, and its digest is of everything but `meta`
    assert run_cli("check", plan_file).code == 0
    data = json.loads(plan_file.read_text())
    assert data["meta"]["content_digest"] == Plan.load(plan_file).digest()


def test_a_parameter_dtype_no_profile_takes_is_one_line(run_cli, tmp_path):
    """Found by a red team: a profile whose `dtype` read int8 (the field takes any torch dtype
    by name) planned, and codegen and measure then stopped with a KeyError traceback."""
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert run_cli("profile", "example:mlp", "--batch-sizes", "2", "--repeats", "1",
                   "--max-repeats", "1", "-o", prof).code == 0  # fmt: skip
    data = json.loads(prof.read_text())
    data["dtype"] = "int8"
    prof.write_text(json.dumps(data))
    args = ("--devices", 2, "--memory", "1GiB", "--batch-size", 4, "--microbatches", 2)
    assert run_cli("plan", prof, *args, "-o", plan).code == 0
    out = tmp_path / "prog.py"
    r = run_cli("codegen", plan, "--model", "example:mlp", "-o", out)
    assert_bad_input(r, mentions="dtype 'int8': a model's parameters are profiled in", no_file=out)
    r = run_cli("measure", plan, "--model", "example:mlp", "--steps", 1)
    assert_bad_input(r, mentions="dtype 'int8'")


def test_a_program_is_not_named_as_a_module_it_would_shadow(run_cli, tmp_path):
    """Found by a red team: `codegen -o torch.py` wrote a program that could not import torch
    (Python puts a script's folder first on its path), and `-o json.py` broke every program
    run beside it. Refused in one line, nothing written; a standard module's name that nothing
    imports, `test.py`, is fine (a review's)."""
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert run_cli("profile", "example:mlp", "--batch-sizes", "2", "--repeats", "1",
                   "--max-repeats", "1", "-o", prof).code == 0  # fmt: skip
    args = ("--devices", 2, "--memory", "1GiB", "--batch-size", 4, "--microbatches", 2)
    assert run_cli("plan", prof, *args, "-o", plan).code == 0
    for name in ("torch.py", "json.py", "numpy.py", "planner.py"):
        out = tmp_path / name
        r = run_cli("codegen", plan, "--model", "example:mlp", "-o", out)
        assert_bad_input(r, mentions="would be imported in place of the module", no_file=out)
    assert run_cli("codegen", plan, "--model", "example:mlp", "-o", tmp_path / "test.py").code == 0


def test_an_empty_value_is_refused_not_read_as_no_value(run_cli, plan_file, prof, tmp_path):
    """Found by a red team: `check --memory-budget "$BUDGET"` with the variable unset gated on
    the plan's own budgets and passed; `--bandwidth ""` planned with free links; `-o ""` and
    `--chrome-trace ""` wrote nothing and exited 0."""
    r = run_cli("check", plan_file, "--memory-budget", "1KiB")
    assert r.code == 1  # (over this budget: the gate that an empty value skipped)
    for flag, argv in (
        ("--memory-budget", ("check", plan_file, "--memory-budget", "")),
        ("--memory-budget", ("check", plan_file, "--memory-budget=")),
        ("--chrome-trace", ("simulate", plan_file, "--chrome-trace", "")),
        ("--bandwidth", ("plan", prof, *PLAN_ARGS, "--bandwidth", "", "-o", tmp_path / "x.json")),
    ):
        assert_bad_input(run_cli(*argv), mentions=f"{flag}: empty")
    assert_bad_input(run_cli("check", ""), mentions="an empty argument")
    assert not (tmp_path / "x.json").exists()


def test_user_code_that_calls_sys_exit_is_one_line_and_exit_2(run_cli, tmp_path):
    """Found by a red team: a loss (or a model's forward) calling sys.exit(0) ended `profile`
    with exit status 0, nothing said and nothing written."""
    (tmp_path / "losses.py").write_text("import sys\ndef exits(out, target):\n    sys.exit(0)\n")
    out = tmp_path / "p.json"
    r = run_cli("profile", "example:mlp", "--batch-sizes", "2", "--repeats", "1",
                "--loss", f"{tmp_path / 'losses.py'}:exits", "-o", out)  # fmt: skip
    assert_bad_input(r, mentions="called sys.exit(0) during `profile`", no_file=out)


def test_a_models_own_base_exception_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Found by a red team: a forward raising a BaseException subclass (not an Exception)
    printed a traceback from `profile`. The process says it in one line; a caller of
    cli.main(argv) in process gets the exception back."""
    (tmp_path / "boom.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class Boom(BaseException):\n    pass\n"
        "class L(nn.Module):\n    def forward(self, x):\n        raise Boom('kaboom\\x1b[31m')\n"
        "def make():\n    m = nn.Sequential(nn.Linear(4, 4), L())\n"
        "    m.example_input = torch.randn(4, 4)\n    return m\n"
    )
    out = tmp_path / "p.json"
    argv = ["profile", f"{tmp_path / 'boom.py'}:make", "--loss", "mse", "-o", str(out)]
    import cli

    monkeypatch.setattr(sys, "argv", ["gpipe-plan", *argv])
    assert cli.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err
    assert "raised Boom: kaboom" in err and "Traceback" not in err and not out.exists()
    with pytest.raises(BaseException, match="kaboom") as raised:
        cli.main(argv)
    assert type(raised.value).__name__ == "Boom"


def test_names_with_terminal_controls_are_refused(run_cli, prof, tmp_path):
    """Found by a red team: device names with a C1 control (CSI) or a bidirectional override
    passed, and `check` printed them to the terminal as they were."""
    for name in ("dev\u009b31m", "a\u202eb"):
        devices = [{"name": name, "memory_bytes": 2**20}, {"name": "d1", "memory_bytes": 2**20}]
        path = tmp_path / "c.json"
        path.write_text(json.dumps({"kind": "cluster", "format_version": 1, "devices": devices}))
        r = run_cli("plan", prof, "--cluster", path, "--batch-size", 8, "-o", tmp_path / "p.json")
        assert_bad_input(r, mentions="devices.0.name", no_file=tmp_path / "p.json")


def test_check_gates_each_device_on_its_own_budget_to_the_byte(run_cli, plan_file, tmp_path):
    """Found by a cold review: no test ran `check` without --memory-budget on a plan over its
    devices' own budgets (gating on no budget at all passed every test), nor --max-bubble at
    the bubble itself."""
    total = json.loads(plan_file.read_text())["devices"][0]["total"]
    for memory, code in ((total, 0), (total - 1, 1)):
        edited = tmp_path / f"m{memory}.json"
        edited.write_text(plan_file.read_text())

        def budget(d, m=memory):
            d["cluster"]["devices"][0]["memory_bytes"] = m
            d["devices"][0]["budget"] = m
            for st in d["stages"]:
                if st["device"] == d["devices"][0]["name"]:
                    st["memory"]["budget"] = m

        _edited_plan(edited, budget, reseal=True)  # (as if planned on that device)
        r = run_cli("check", edited)
        assert r.code == code, r
        if code:
            assert "over by" in r.out and "1 B" in r.out.splitlines()[-1], r.out
    bubble = json.loads(plan_file.read_text())["predicted"]["bubble_fraction"]
    assert run_cli("check", plan_file, "--max-bubble", repr(bubble)).code == 0
    assert run_cli("check", plan_file, "--max-bubble", repr(bubble * (1 - 1e-9))).code == 1


def _refused_device_field(run_cli, prof, tmp_path, field: str, value: object) -> None:
    """`plan` with a cluster file whose first device has `field` set to `value`: refused in
    one line that names the field, nothing written."""
    devices = [{"name": "d0", "memory_bytes": 2**20, field: value},
               {"name": "d1", "memory_bytes": 2**20}]  # fmt: skip
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"kind": "cluster", "format_version": 1, "devices": devices}))
    r = run_cli("plan", prof, "--cluster", path, "--batch-size", 8, "-o", tmp_path / "p.json")
    assert_bad_input(r, mentions=field, no_file=tmp_path / "p.json")


def test_a_devices_speed_is_a_number_not_a_flag_or_a_string(run_cli, prof, tmp_path):
    """Found by a red team: a cluster file's `speed: true` or `"1.0"` read as 1.0."""
    for speed in (True, "1.0"):
        _refused_device_field(run_cli, prof, tmp_path, "speed", speed)


def test_a_cluster_files_sizes_are_whole_numbers_of_bytes(run_cli, prof, tmp_path):
    """Files are read strictly (true, "8" and 8.0 are no counts), but a size written as 80e9 in
    a cluster file is a whole number of bytes, as it was read before."""
    _refused_device_field(run_cli, prof, tmp_path, "reserved_bytes", 1024.5)
    _refused_device_field(run_cli, prof, tmp_path, "memory_bytes", 2e15)  # ("less than or equal")
    devices = [{"name": "d0", "memory_bytes": 1e9}, {"name": "d1", "memory_bytes": 2**30}]
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"kind": "cluster", "format_version": 1, "devices": devices}))
    assert Cluster.load(path).devices[0].memory_bytes == 10**9


def test_a_cluster_file_names_each_key_once_and_a_size_without_a_unit_in_whole_bytes(
    run_cli, prof, tmp_path
):
    """Found by a red team: a cluster file with "devices" written twice was read with the
    last one (JSON's parsers keep it), and a size "1.5" (a unit forgotten) as 1 byte."""
    out = tmp_path / "p.json"
    one = {"name": "d0", "memory_bytes": "1GiB"}
    d0, d1 = json.dumps(one), json.dumps({**one, "name": "d1"})
    text = f'{{"kind": "cluster", "devices": [{d0}], "devices": [{d0}, {d1}]}}'
    path = tmp_path / "c.json"
    path.write_text(text)
    r = run_cli("plan", prof, "--cluster", path, "--batch-size", 8, "-o", out)
    assert_bad_input(r, mentions="'devices' is written twice", no_file=out)
    path.write_text(json.dumps({"kind": "cluster", "devices": [{**one, "memory_bytes": "1.5"}]}))
    r = run_cli("plan", prof, "--cluster", path, "--batch-size", 8, "-o", out)
    assert_bad_input(r, mentions="a part of a byte; name a unit", no_file=out)


def test_whole_numbers_are_digits_and_an_output_is_no_folder(run_cli, prof, tmp_path):
    """Found by a red team: int() read `--devices 1_0` as 10 (and "+2", " 4", full-width
    digits), and `-o newdir/` wrote a file named newdir."""
    out = tmp_path / "p.json"
    for flag, value in (("--devices", "1_0"), ("--devices", "+2"), ("--batch-size", " 8"),
                        ("--devices", "\uff12"), ("--microbatches", "٢"),
                        ("--checkpoint-layers", "1_0"), ("--checkpoint-layers", "+2,٣"),
                        ("--time-limit", "1_0"), ("--time-limit", "٢"),
                        ("--devices", "9" * 5000),  # (int() raises past 4 300 digits)
                        ("--checkpoint-layers", "9" * 5000)):  # fmt: skip
        args = {"--devices": "2", "--batch-size": "8", flag: value}
        r = run_cli("plan", prof, "--memory", "1GiB", *(x for kv in args.items() for x in kv),
                    "-o", out)  # fmt: skip
        assert_bad_input(r, mentions=flag, no_file=out)
    r = run_cli("plan", prof, "--devices", 2, "--memory", "1GiB", "--batch-size", 8,
                "-o", f"{tmp_path / 'newdir'}/")  # fmt: skip
    assert_bad_input(r, mentions="ends as a folder", no_file=tmp_path / "newdir")
    r = run_cli("plan", prof, "--devices", 2, "--memory", "1GiB", "--batch-size", 8,
                "-o", f"{tmp_path / 'newdir'}/.")  # fmt: skip
    assert_bad_input(r, mentions="ends as a folder", no_file=tmp_path / "newdir")
    assert run_cli("plan", prof, "--devices", 2, "--memory", "1GiB", "--batch-size", 8,
                   "-o", out).code == 0  # fmt: skip


def test_an_output_through_a_missing_folder_and_dotdot_is_refused(run_cli, prof, plan_file):
    """Found by a red team: `-o nosuch/../prof.json` could not be looked up, so no check saw
    the input, while the write went to the path with `nosuch/..` dropped: the profile was
    replaced by the plan (also `simulate --chrome-trace`, `codegen -o`, and a redirect's file
    through `nosuch/../../dev/stdout`)."""
    before = prof.read_bytes(), plan_file.read_bytes()
    missing = prof.parent / "nosuch"
    for args in (
        ("plan", prof, "--devices", 2, "--memory", "1GiB", "--batch-size", 8,
         "-o", f"{missing}/../{prof.name}"),
        ("simulate", plan_file, "--chrome-trace", f"{missing}/../{plan_file.name}"),
        ("codegen", plan_file, "--model", "example:mlp", "-o", f"{missing}/../{plan_file.name}"),
        ("plan", prof, "--devices", 2, "--memory", "1GiB", "--batch-size", 8,
         "-o", f"{missing}/{'../' * 40}dev/stdout"),
    ):  # fmt: skip
        r = run_cli(*args)
        assert_bad_input(r, mentions="does not exist")
        assert "nosuch/.." in r.err
    assert (prof.read_bytes(), plan_file.read_bytes()) == before
    assert not missing.exists()
    r = run_cli(
        "plan",
        prof,
        "--devices",
        2,
        "--memory",
        "1GiB",
        "--batch-size",
        8,
        "-o",
        f"{prof}/out.json",
    )  # (through a file: said so)
    assert_bad_input(r, mentions=f"{prof} is not a directory")  # fmt: skip


def test_a_devices_torch_device_is_one_to_train_on(run_cli, prof, tmp_path):
    """Found by a red team: `torch_device: "meta"` (or "nonsense") passed, and the program
    failed when it ran, inside torch. Refused where the cluster is read; cuda:N and cpu pass."""
    from planner import Cluster

    for named in ("meta", "nonsense", "cuda:-1", "cuda:0 "):
        _refused_device_field(run_cli, prof, tmp_path, "torch_device", named)
    # (cpu:3 too: torch runs it on the one CPU, and plans that name it were made and must load)
    for named in ("cpu", "cpu:3", "cuda", "cuda:3"):
        Cluster.model_validate(
            {"devices": [{"name": "d", "memory_bytes": 1, "torch_device": named}]}
        )


def test_a_loss_that_fails_is_named_as_the_loss(run_cli, tmp_path):
    """Found by a red team: a loss that raised read "the model rejected input ... at layer 4
    (LossLayer)", and one whose module exited on import was labelled MODEL."""
    (tmp_path / "raising.py").write_text("def boom(out, target):\n    raise ValueError('no')\n")
    (tmp_path / "exiting.py").write_text("import sys\nsys.exit(0)\n")
    out = tmp_path / "p.json"
    for spec, says in ((f"{tmp_path / 'raising.py'}:boom", "failed on the model's output"),
                       (f"{tmp_path / 'exiting.py'}:l", "loss '")):  # fmt: skip
        r = run_cli("profile", "example:mlp", "--batch-sizes", "2", "--repeats", "1",
                    "--loss", spec, "-o", out)  # fmt: skip
        assert_bad_input(r, mentions=says, no_file=out)
        assert "MODEL" not in r.err and "LossLayer" not in r.err


def test_plans_written_before_meta_was_trimmed_still_load(plan_file):
    data = json.loads(plan_file.read_text())
    data["meta"].update(created="2026-11-01T00:00:00+00:00", solve_ms=12.5)
    assert Plan.from_json_text(json.dumps(data)).meta.tool_version == data["meta"]["tool_version"]


# ------------------------------------------------------------------ flags


@pytest.mark.parametrize(
    "flags, mentions",
    [
        (("--devices", "2", "--memory", "1e309"), "--memory 1e309: must be a finite number"),
        (("--devices", "2", "--memory", "2PiB"), "--memory 2PiB: more than 1 PiB"),
        (
            ("--devices", "2", "--memory", "1MiB", "--bandwidth", "1e400GB/s"),
            "--bandwidth 1e400GB/s",
        ),
        (("--devices", "2", "--memory", "1MiB", "--latency-ms", "nan"), "--latency-ms nan"),
        (("--devices", "2", "--memory", "1MiB", "--latency-ms", "inf"), "--latency-ms inf"),
        (("--devices", "1000000", "--memory", "1MiB"), "only 6 layers"),
        (("--devices", "two", "--memory", "1MiB"), "--devices 'two'"),
        (("--devices", "2", "--memory", "1MiB", "--microbatches", "2.7"), "--microbatches '2.7'"),
        (("--devices", "2", "--memory", "1MiB", "--microbatches", "9"), "--microbatches 9"),
        (("--devices", "2", "--memory", "1MiB", "--schedule", "zigzag"), "--schedule zigzag"),
        (
            ("--devices", "2", "--memory", "1MiB", "--recompute", "sometimes"),
            "--recompute sometimes",
        ),
    ],
)
def test_bad_plan_flags_are_named_as_typed(run_cli, prof, tmp_path, flags, mentions):
    out = tmp_path / "plan.json"
    r = run_cli("plan", prof, *flags, "--batch-size", "8", "-o", out)
    assert_bad_input(r, mentions=mentions, no_file=out)


@pytest.mark.parametrize("size", ["10000000000000000", "1e16", "0", "-3", "8.5"])
def test_absurd_batch_sizes_are_refused_at_once(run_cli, prof, tmp_path, size):
    r = run_cli("plan", prof, "--devices", 2, "--memory", "1MiB", "--batch-size", size)
    assert_bad_input(r, mentions="--batch-size")


def test_check_flags_are_bounded(run_cli, plan_file):
    assert_bad_input(run_cli("check", plan_file, "--max-bubble", "nan"), mentions="--max-bubble")
    r = run_cli("check", plan_file, "--memory-budget", "1e999")
    assert_bad_input(r, mentions="--memory-budget")


def test_infeasible_message_states_enough_memory_to_paste_back(run_cli, prof, tmp_path):
    r = run_cli("plan", prof, "--devices", 2, "--memory", "200B", "--batch-size", 8)
    assert r.code == 1
    match = re.search(r"needs (\S+ \S+) \((\d+) bytes\) per device", r.err)
    assert match, r.err
    shown, exact = match.group(1), int(match.group(2))
    assert parse_size(shown.replace(" ", "")) >= exact  # the rounded figure is never short
    for memory in (shown.replace(" ", ""), str(exact)):
        assert run_cli("plan", prof, "--devices", 2, "--memory", memory, "--batch-size", 8,
                       "-o", tmp_path / "p.json").code == 0  # fmt: skip
    r = run_cli("plan", prof, "--devices", 2, "--memory", exact - 1, "--batch-size", 8)
    assert r.code == 1


def test_format_size_rounds_up_when_asked():
    assert format_size(5760) == "5.62 KiB"
    assert format_size(5760, up=True) == "5.63 KiB"
    assert format_size(5 * 1024, up=True) == "5 KiB"
    assert format_size(1025, up=True) == "1.01 KiB"


def test_cp_sat_with_the_largest_memory_answers(run_cli, prof, tmp_path):
    out = tmp_path / "p.json"
    r = run_cli("plan", prof, "--devices", 2, "--memory", "1PiB", "--batch-size", 8,
                "--solver", "cp-sat", "-o", out)  # fmt: skip
    assert r.code == 0, r.err
    assert Plan.load(out).solver.method == "cp-sat"


# ------------------------------------------------------------------ byte-identical plans


def test_the_same_inputs_give_the_same_plan_bytes(run_cli, prof, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run_cli("plan", prof, *PLAN_ARGS, "-o", a).code == 0
    r = run_cli("plan", prof, *PLAN_ARGS, "-o", b)
    assert a.read_bytes() == b.read_bytes()
    assert re.search(r"in \d+ ms\)", r.out)  # the solve time is still shown, only not saved
    assert "solve_ms" not in a.read_text() and "created" not in a.read_text()


# ------------------------------------------------------------------ the Python API


@pytest.fixture(scope="module")
def small_profile():
    return synthetic_profile([1.0, 2.0, 3.0, 4.0], sizes=(1, 2, 4, 8))


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"batch_size": "8"}, "batch_size"),
        ({"batch_size": 8.5}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 10**16}, "batch_size"),
        ({"microbatches": 2.7}, "microbatches"),
        ({"microbatches": "2"}, "microbatches"),
        ({"microbatches": 9}, "microbatches"),
        ({"schedule": "GPipe"}, "schedule"),
        ({"recompute": True}, "recompute"),
        ({"optimizer": "lamb"}, "optimizer"),
        ({"solver": None}, "solver"),
        # (the default path, with checkpoints chosen, read it before its check: a TypeError,
        # and -1 or True taken as times; found by a red team)
        ({"time_limit_s": "5"}, "time_limit_s"),
        ({"time_limit_s": -1}, "time_limit_s"),
        ({"time_limit_s": True}, "time_limit_s"),
        ({"time_limit_s": float("nan")}, "time_limit_s"),
    ],
)
def test_plan_pipeline_names_the_bad_argument(small_profile, kwargs, arg):
    args = {"batch_size": 8, **kwargs}
    with pytest.raises(ArgumentError) as e:
        plan_pipeline(small_profile, Cluster.uniform(2, "1MiB"), **args)
    assert e.value.arg == arg
    assert str(e.value).startswith(f"{arg}=") and "--" not in str(e.value)


@pytest.mark.parametrize(
    "args, kwargs, arg",
    [
        (("2", "1MiB"), {}, "num_devices"),
        ((0, "1MiB"), {}, "num_devices"),
        ((2, "lots"), {}, "memory"),
        ((2, float("inf")), {}, "memory"),
        ((2, "1MiB"), {"bandwidth": float("nan")}, "bandwidth"),
        ((2, "1MiB"), {"latency_ms": -1.0}, "latency_ms"),
        ((2, "1MiB"), {"speed": 0}, "speed"),
    ],
)
def test_cluster_uniform_names_the_bad_argument(args, kwargs, arg):
    with pytest.raises(ArgumentError) as e:
        Cluster.uniform(*args, **kwargs)
    assert e.value.arg == arg and "--" not in str(e.value)


@pytest.mark.parametrize(
    "kwargs, arg",
    [({"repeats": 9, "max_repeats": 3}, "max_repeats"), ({"device": "cpu:1"}, "device")],
)
def test_profile_model_names_the_bad_argument(kwargs, arg):
    from profiler.measure import profile_model

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(ArgumentError) as e:
        profile_model(model, torch.ones(2, 4), progress=False, **kwargs)
    assert e.value.arg == arg and "--" not in str(e.value)


def test_profile_model_times_more_rounds_than_the_default_most_where_asked():
    """repeats past 100 without max_repeats: the most is raised to them, not refused."""
    from profiler.measure import profile_model

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    prof = profile_model(model, torch.ones(1, 4), batch_sizes=[1], repeats=150, warmup=0,
                         progress=False, overhead=False)  # fmt: skip
    assert prof.layers[0].forward_ms[1].samples >= 150


@pytest.fixture(scope="module")
def mlp_pipe():
    from profiler.examples import EXAMPLES
    from profiler.measure import profile_model

    torch.manual_seed(0)
    model = EXAMPLES["mlp"]()
    profile = profile_model(model, model.example_input[:4], batch_sizes=[1, 2], repeats=1,
                            warmup=0, max_repeats=1, progress=False)  # fmt: skip
    plan = plan_pipeline(profile, Cluster.uniform(2, "1GiB"), 4, microbatches=2)
    return model, plan


def test_compile_pipe_refuses_a_string_for_devices(mlp_pipe):
    model, plan = mlp_pipe
    with pytest.raises(ArgumentError, match="devices='cpu': expected a list of 2 devices"):
        compile_pipe(model, plan, devices="cpu")


def test_a_pipe_refuses_a_batch_larger_than_its_plan(mlp_pipe):
    model, plan = mlp_pipe
    pipe = compile_pipe(model, plan, devices=["cpu", "cpu"])
    x = model.example_input[:1].repeat(8, *[1] * (model.example_input.dim() - 1))
    with pytest.raises(ArgumentError, match="batch_size=8"):
        pipe(x)
    with pytest.raises(ArgumentError, match="batches of 2 to 4"):
        pipe(x[:1])
    assert pipe(x[:3]).shape[0] == 3  # a smaller last batch of an epoch is fine


def test_a_loss_that_does_not_reduce_is_reported_as_the_loss(mlp_pipe):
    from codegen.pipe import StageError

    model, plan = mlp_pipe
    pipe = compile_pipe(model, plan, devices=["cpu", "cpu"])
    x = model.example_input[:4]
    y = torch.zeros(4, dtype=torch.long)
    with pytest.raises(StageError, match="not a scalar tensor"):
        pipe.train_step(x, y, lambda out, target: out * 2)  # forgot to reduce
    # a loss that computes no gradient: detached, a constant, an integer (found by a red team:
    # the step went on and silently computed nothing)
    for loss in (lambda out, target: out.detach().mean(), lambda out, target: torch.tensor(1.0),
                 lambda out, target: out.argmax(-1).sum()):  # fmt: skip
        with pytest.raises(StageError, match="without a gradient"):
            pipe.train_step(x, y, loss)
    assert torch.isfinite(pipe.train_step(x, y, torch.nn.functional.cross_entropy))  # (it goes on)


def test_a_model_changed_after_compiling_is_refused_not_left_out():
    """Found by a red team: a layer replaced in the model after compile_pipe was left out of
    every step (the pipe runs the layers it was given), unsaid: the loss stayed the old one's,
    the new layer got no gradient, and an optimizer over the model stepped it for nothing."""
    from profiler.examples import EXAMPLES
    from profiler.measure import profile_model

    torch.manual_seed(0)
    model = EXAMPLES["mlp"]()
    profile = profile_model(model, model.example_input[:4], batch_sizes=[1, 2], repeats=1,
                            warmup=0, max_repeats=1, progress=False)  # fmt: skip
    plan = plan_pipeline(profile, Cluster.uniform(2, "1GiB"), 4, microbatches=2)
    pipe = compile_pipe(model, plan, devices=["cpu", "cpu"])
    x, y = model.example_input[:4], torch.zeros(4, dtype=torch.long)
    loss = torch.nn.functional.cross_entropy
    pipe.train_step(x, y, loss)
    first = next(k for k, m in enumerate(model) if isinstance(m, torch.nn.Linear))
    model[first].weight.requires_grad_(False)  # (a change the step sees and warns of: allowed)
    model[first].weight.requires_grad_(True)
    pipe.train_step(x, y, loss)
    old = model[first]
    model[first] = torch.nn.Linear(old.in_features, old.out_features)
    for call in (lambda: pipe.train_step(x, y, loss), lambda: pipe(x),
                 lambda: pipe.measure(x, y, loss, steps=1)):  # fmt: skip
        with pytest.raises(InputError, match="the model changed since compile_pipe"):
            call()
    model[first] = old  # as it was: runs again
    pipe.train_step(x, y, loss)
    # a parameter replaced on a module the pipe runs is used as it is (a review's): let be
    old.weight = torch.nn.Parameter(torch.zeros_like(old.weight))
    pipe.train_step(x, y, loss)
    assert old.weight.grad is not None


def test_sizes_refuse_non_numbers_and_leave_parts_of_a_byte_out():
    """A size is a capacity: a budget of 4776107.5 bytes does not hold 4776108 (the red team's:
    `check --memory-budget 4776107.5` passed a plan needing that), and decimal units are worked
    out exactly (a float read 16.000000012GB as one byte more)."""
    # (a part of a byte written without a unit is refused, as a unit forgotten: "1.5" was read
    # as 1 byte; a later red team's)
    for bad in ("", "16QB", "nan", True, None, "-1GiB", "0", "0.99999999999999999999",
                "4776107.5", "17179869183.99999999999999999999999"):  # fmt: skip
        with pytest.raises(InputError):
            parse_size(bad)  # type: ignore[arg-type]
    assert parse_size(16e9) == 16_000_000_000
    assert parse_size("1.64KiB") == 1679  # 1679.36
    assert parse_size(1.5) == 1 and parse_size(4776107.5) == 4776107  # (a number: floored)
    assert parse_size("16.000000012GB") == 16_000_000_012 and parse_size("0.001002MB") == 1002
    assert parse_size("16.99999999999999999999999999999GB") == 16_999_999_999  # (not up)
    assert parse_size("1PiB") == 2**50


def test_cli_translates_library_argument_names(run_cli, prof):
    r = run_cli("plan", prof, "--devices", 2, "--memory", "1MiB", "--batch-size", 8,
                "--microbatches", 100)  # fmt: skip
    assert_bad_input(r, mentions="--microbatches 100: must be from 1 to 8")
    assert "microbatches=" not in r.err


@pytest.mark.parametrize(
    "costs, mentions",
    [
        ({"forward": [1.0, float("nan")]}, "costs.forward: nan"),
        ({"backward": [1.0, -2.0]}, "costs.backward: -2.0"),
        ({"transfer": [float("inf")]}, "costs.transfer: inf"),
        ({"transfer": [1.0, 1.0]}, "2 values for 1 cuts"),
        ({"recompute": ["never", "often"]}, "costs.recompute"),
    ],
)
def test_simulate_refuses_costs_that_are_not_times(costs, mentions):
    from schedules import Costs, build_schedule, simulate

    args = {"forward": [1.0, 1.0], "backward": [2.0, 2.0], **costs}
    with pytest.raises(ValueError, match=re.escape(mentions)):
        simulate(build_schedule("gpipe", 2, 2), Costs(**args))


# ------------------------------------------------------------------ found by review


@pytest.mark.parametrize(
    "field, value",
    [
        ("input_dtype", 'float32"\nprint("INJECTED")\n_x = "'),
        ("input_dtype", "int4"),
        ("model", 'synthetic:chain\nprint("INJECTED")'),
    ],
)
def test_plan_text_cannot_carry_code_into_the_program(run_cli, plan_file, tmp_path, field, value):
    bad = _edited_plan(plan_file, lambda d: d.update({field: value}))
    out = tmp_path / "prog.py"
    r = run_cli("codegen", bad, "--model", "example:mlp", "-o", out)
    assert_bad_input(r, mentions=field, no_file=out)


def test_a_plan_for_another_kind_of_model_is_refused_before_a_program(run_cli, plan_file, tmp_path):
    """Found by a red team: a resealed plan that says `captured` for an nn.Sequential gave
    codegen a traceback, and one for a graph that says it is not, a program that failed when
    it ran. Both are refused in one line, from the CLI and from Python."""
    from codegen.pipe import compile_pipe

    plan = Plan.load(plan_file)
    bad = _edited_plan(plan_file, lambda d: d.update(captured=True), reseal=True)
    out = tmp_path / "prog.py"
    r = run_cli("codegen", bad, "--model", "example:mlp", "-o", out)
    assert_bad_input(r, mentions="made for a different model (synthetic", no_file=out)
    bad = _edited_plan(bad, lambda d: d.update(model="example:mlp"), reseal=True)
    r = run_cli("codegen", bad, "--model", "example:mlp", "-o", out)
    assert_bad_input(r, mentions="splits a graph captured from the model, but the model given "
                     "is an nn.Sequential", no_file=out)  # fmt: skip

    class TwoPaths(torch.nn.Module):  # no nn.Sequential: its graph is captured
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) + self.b(x)

    with pytest.raises(InputError, match="layers, but the model given is no nn.Sequential"):
        compile_pipe(TwoPaths(), plan, check_model=False)


def test_device_names_are_one_line(run_cli, prof, tmp_path):
    data = json.loads(Cluster.uniform(2, "1MiB").canonical_json())
    data["devices"][0]["name"] = "gpu0\nimport os"
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    r = run_cli("plan", prof, "--cluster", path, "--batch-size", 8, "-o", tmp_path / "p.json")
    assert_bad_input(r, mentions="devices.0.name")


def _module(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


MODEL_MODULE = (
    "import torch\n"
    "from helper import width\n"
    "def make():\n"
    "    m = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))\n"
    "    m.example_input = torch.randn(2, width)\n"
    "    return m\n"
)


@pytest.fixture
def module_model(tmp_path, monkeypatch):
    """A package-less module model that imports a helper module, both on sys.path."""
    import sys

    _module(tmp_path, "helper", "width = 4\n")
    _module(tmp_path, "mymodel", MODEL_MODULE)
    _module(tmp_path, "myloss", "import torch\ndef fn(out, y):\n    return out.sum()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in ("helper", "mymodel", "myloss"):
        sys.modules.pop(name, None)


def test_measure_refuses_to_overwrite_the_model_module(run_cli, module_model):
    from profiler.models import load_model

    prof, plan = module_model / "prof.json", module_model / "plan.json"
    args = ("--batch-sizes", "1,2", "--repeats", "1", "--warmup", "0", "--max-repeats", "1")
    assert run_cli("profile", "mymodel:make", *args, "-o", prof).code == 0
    assert run_cli("plan", prof, "--devices", 2, "--memory", "1GiB", "--batch-size", 2,
                   "-o", plan).code == 0  # fmt: skip
    load_model("mymodel:make")
    for target in ("mymodel.py", "helper.py"):
        before = (module_model / target).read_bytes()
        r = run_cli("measure", plan, "--model", "mymodel:make", "--steps", 1, "-o", target)
        assert_bad_input(r, mentions="input")
        assert (module_model / target).read_bytes() == before


def test_profile_refuses_to_overwrite_its_loss_module_or_a_helper(
    run_cli, module_model, monkeypatch
):
    import profiler.measure

    monkeypatch.setattr(profiler.measure, "profile_model", _must_not_run)
    for target in ("myloss.py", "helper.py"):
        before = (module_model / target).read_bytes()
        r = run_cli("profile", "mymodel:make", "--loss", "myloss:fn", "-o", target)
        assert_bad_input(r, mentions="input")
        assert (module_model / target).read_bytes() == before


def test_a_helper_the_model_imports_as_it_runs_is_not_overwritten(run_cli, tmp_path, monkeypatch):
    """Found by a red team: a layer whose forward imports a helper of its own folder; the
    outputs were checked before the model ran, and `-o helper.py` replaced the helper's source
    with the profile (also codegen's program, measure's report)."""
    (tmp_path / "late_helper.py").write_text("def act(x):\n    return x * 2\n")
    (tmp_path / "latemodel.py").write_text(
        "import os\nimport sys\n\nimport torch\nfrom torch import nn\n\n"
        "sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\n\n"
        "class Lazy(nn.Module):\n"
        "    def forward(self, x):\n"
        "        import late_helper\n\n"
        "        return late_helper.act(x)\n\n"
        "def make():\n"
        "    m = nn.Sequential(nn.Linear(8, 8), Lazy(), nn.Linear(8, 4))\n"
        "    m.example_input = torch.randn(4, 8)\n"
        "    return m\n"
    )
    before = (tmp_path / "late_helper.py").read_bytes()
    monkeypatch.setattr(sys, "path", list(sys.path))  # (whatever loading the model adds)
    spec, helper = f"{tmp_path}/latemodel.py:make", tmp_path / "late_helper.py"
    profile = ("profile", spec, "--batch-sizes", "1,2", "--repeats", 1, "--max-repeats", 1,
               "--warmup", 0, "--loss", "mse")  # fmt: skip
    try:
        r = run_cli(*profile, "-o", helper)
        assert_bad_input(r, mentions="late_helper")
        assert "profiled" not in r.out  # (nothing said written)
        assert helper.read_bytes() == before
        # codegen too: its model runs (on fake tensors) after its first check
        for name in ("late_helper", "latemodel"):
            sys.modules.pop(name, None)
        assert run_cli(*profile, "-o", tmp_path / "p.json").code == 0
        r = run_cli("plan", tmp_path / "p.json", "--devices", 2, "--memory", "1GiB",
                    "--batch-size", 4, "-o", tmp_path / "plan.json")  # fmt: skip
        assert r.code == 0, r.err
        for name in ("late_helper", "latemodel"):
            sys.modules.pop(name, None)
        r = run_cli("codegen", tmp_path / "plan.json", "--model", spec, "-o", helper)
        assert_bad_input(r, mentions="late_helper")
        assert helper.read_bytes() == before
    finally:
        for name in ("late_helper", "latemodel"):
            sys.modules.pop(name, None)


def test_a_pipe_given_as_output_is_refused_as_a_fifo(run_cli, prof, tmp_path):
    read, write = os.pipe()
    try:
        r = run_cli("plan", prof, *PLAN_ARGS, "-o", f"/proc/self/fd/{write}")
        assert_bad_input(r, mentions="FIFO")
    finally:
        os.close(read), os.close(write)


def test_flags_cannot_be_abbreviated(run_cli, prof):
    r = run_cli("plan", prof, "--dev", 2, "--memory", "1MiB", "--batch-size", 8)
    assert_bad_input(r, mentions="unrecognized arguments: --dev")


def test_too_many_devices_in_a_cluster_file_name_the_cluster(run_cli, prof, tmp_path):
    path = tmp_path / "c.json"
    Cluster.uniform(9, "1MiB").save(path)
    r = run_cli("plan", prof, f"--cluster={path}", "--batch-size", 8)
    assert_bad_input(r, mentions="--cluster")


def test_a_device_too_small_to_halve_is_infeasible_not_a_crash(run_cli, prof):
    r = run_cli("plan", prof, "--devices", 2, "--memory", "1B", "--batch-size", 4,
                "--schedule", "interleaved-1f1b")  # fmt: skip
    assert r.code == 1 and "no split fits" in r.err


def test_bandwidth_below_a_kilobyte_per_second_is_refused(run_cli, prof):
    r = run_cli("plan", prof, *PLAN_ARGS, "--bandwidth", "1e-30")
    assert_bad_input(r, mentions="--bandwidth 1e-30")


def test_a_batch_whose_bytes_overflow_is_refused_before_the_search(tmp_path):
    profile = synthetic_profile([1.0, 1.0], output_bytes=[2**40, 2**40], saved=[2**40, 2**40])
    with pytest.raises(ArgumentError, match="batch_size=16777216"):
        plan_pipeline(profile, Cluster.uniform(2, "1PiB"), 2**24)


def test_a_module_that_raises_on_import_is_one_line_not_a_traceback(run_cli, tmp_path, monkeypatch):
    """Finding the module's file (to protect it) must not run it: only load_model may."""
    (tmp_path / "badpkg").mkdir()
    (tmp_path / "badpkg" / "__init__.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert_bad_input(run_cli("profile", "badpkg.mod:f", "-o", tmp_path / "o.json"), mentions="boom")


def test_json_nested_past_the_parsers_depth_is_refused_in_one_line(run_cli, tmp_path):
    """Found in review: 200 000 nested brackets took the checked path to a RecursionError."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    r = run_cli("show", str(deep))
    assert r.code == 2 and "nested too deeply" in r.err and "Traceback" not in r.err


@pytest.mark.parametrize("kind", ["plan", "profile", "cluster"])
def test_a_number_longer_than_python_reads_is_refused_in_one_line(run_cli, tmp_path, kind):
    """Found by a red team: an integer of more than 4300 digits anywhere in a file (here an
    unknown field, so the one-pass reader refuses it first) made json raise a plain ValueError
    past the checked path's handlers: a traceback, exit 1, for every kind of file."""
    bad = tmp_path / "big.json"
    bad.write_text(f'{{"kind": "{kind}", "format_version": 1, "x": {"7" * 5000}}}')
    out = tmp_path / "out.json"
    out.write_text("kept")
    if kind == "plan":
        r = run_cli("show", str(bad))
    elif kind == "profile":
        r = run_cli("plan", str(bad), "--devices", "2", "--memory", "1GiB", "--batch-size", "8",
                    "-o", str(out))  # fmt: skip
    else:
        profile = tmp_path / "p.json"
        synthetic_profile([1.0, 2.0]).save(profile)
        r = run_cli("plan", str(profile), "--cluster", str(bad), "--batch-size", "8",
                    "-o", str(out))  # fmt: skip
    assert r.code == 2 and "Traceback" not in r.err, r.err
    assert (
        "not valid JSON (Exceeds the limit (4300 digits)" in r.err and len(r.err.splitlines()) == 1
    )
    assert out.read_text() == "kept"


def test_sigterm_during_a_launch_kills_it_and_restores_the_handler():
    """SIGTERM (or SIGHUP) while torchrun runs stops the command as Ctrl-C does: the launch and
    what it started in sessions of their own are killed (the red team found them orphaned)."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from codegen.measure import Stopped, _run

    mark = f"gpipe-test-{os.getpid()}-{time.time_ns()}"
    child = f"import time; time.sleep(60)  # {mark}"
    launch = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True); "
        f"time.sleep(60)  # {mark}"
    )

    def unhandled(signum: int, frame: object) -> None:  # (not the runner's death, a failure)
        raise RuntimeError("_run left SIGTERM to whatever handled it before")

    outer = signal.signal(signal.SIGTERM, unhandled)
    try:
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(Stopped) as stopped:
            _run([sys.executable, "-c", launch], dict(os.environ), timeout_s=30)
        assert stopped.value.exit_code == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is unhandled  # put back as it was
    finally:
        signal.signal(signal.SIGTERM, outer)
    left = subprocess.run(["pgrep", "-f", mark], capture_output=True, text=True).stdout
    assert left.strip() == ""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_launch_ends_with_the_command_that_started_it_even_when_that_is_sigkilled():
    """Found by a red team: `measure --target torchrun` killed with SIGKILL (no handler runs)
    left torchrun and its ranks running for good. The launch is now told SIGTERM when the
    command that started it dies, however it dies."""
    import subprocess
    import time

    mark = f"gpipe-test-{os.getpid()}-{time.time_ns()}"
    child = f"import time; time.sleep(60)  # {mark}"  # (only the launch's command line has it)
    parent = (
        f"import os, sys; sys.path.insert(0, {str(ROOT)!r}); from codegen.measure import _run; "
        "_run([sys.executable, '-c', os.environ['CHILD']], dict(os.environ), timeout_s=60)"
    )

    def left() -> str:
        return subprocess.run(["pgrep", "-f", mark], capture_output=True, text=True).stdout.strip()

    runner = subprocess.Popen([sys.executable, "-c", parent], env={**os.environ, "CHILD": child})
    deadline = time.monotonic() + 60
    # the launch is up: seen twice, 0.2 s apart (its guard exec()s the command, and while it
    # does its command line may read empty: a CI run once saw it gone in between)
    while not (left() and (time.sleep(0.2) or left())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left() and runner.poll() is None
    runner.kill()
    runner.wait()
    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left() == ""


def test_a_model_that_cannot_run_on_the_plans_input_names_the_plans_model(run_cli, tmp_path):
    """Found by a red team: `codegen mlp_plan.json --model example:gpt` said only that GPT's
    graph could not be captured (float tokens), not that the plan is another model's."""
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert run_cli("profile", "example:mlp", "--batch-sizes", "2", "--repeats", "1",
                   "--max-repeats", "1", "-o", prof).code == 0  # fmt: skip
    assert run_cli("plan", prof, "--devices", 2, "--memory", "1GiB", "--batch-size", 4,
                   "-o", plan).code == 0  # fmt: skip
    r = run_cli("codegen", plan, "--model", "example:gpt", "-o", tmp_path / "x.py")
    assert_bad_input(
        r, mentions="does not run on the plan's input (the plan was made for example:mlp)"
    )
    assert not (tmp_path / "x.py").exists()


def test_an_output_is_never_gpipe_plans_own_code_nor_a_loaded_module(tmp_path):
    """`links -o cli.py` once replaced the tool's own entry point (and every later command then
    did nothing, quietly); so could any command whose output named a module it runs."""
    import json as loaded

    import cli

    for code in (
        Path(cli.__file__),
        ROOT / "planner" / "search.py",
        ROOT / "profiler" / "links.py",
    ):
        with pytest.raises(InputError, match="gpipe-plan's own source files"):
            check_output(code)
    with pytest.raises(InputError, match="module json, which this command runs"):
        check_output(loaded.__file__)
    check_output(tmp_path / "fine.py")  # a new file of any name is fine


def test_a_full_disk_on_stdout_or_a_name_not_in_utf8_is_one_line(plan_file, prof, tmp_path):
    """`show plan.json > /dev/full` gave a traceback (and `check` exited 1, which a CI job reads
    as over budget); a written file's name that is not UTF-8 failed its closing message."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    cli_py = str(ROOT / "cli.py")
    if os.path.exists("/dev/full"):
        for command in ("show", "check"):
            with open("/dev/full", "w") as full:
                done = subprocess.run([sys.executable, cli_py, command, str(plan_file)],
                                      stdout=full, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
            assert done.returncode == 2, done.stderr
            assert done.stderr.splitlines() == [
                "gpipe-plan: error: cannot write the output (No space left on device)"
            ]
    odd = os.fsencode(str(tmp_path)) + b"/\xfe.json"
    done = subprocess.run([sys.executable, cli_py, "plan", str(prof), *PLAN_ARGS, "-o", odd],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert os.path.exists(odd) and done.stdout.splitlines()[-1].endswith("\\udcfe.json")


def test_a_terminal_that_cannot_be_written_leaves_no_file_and_a_closed_one_no_traceback(
    plan_file, prof, tmp_path
):
    """Found by a red team: `plan ... -o out.json > /dev/full` wrote out.json and then exited 2
    (bad input, nothing done); with stdout closed (`>&-`) `check` gave a traceback and exit 1,
    which a CI job reads as over budget, and `plan` wrote its file. A pipe whose reader left
    (`| head`) is no reason to lose the plan, though."""
    import subprocess
    import sys

    cli_py = str(ROOT / "cli.py")
    out = tmp_path / "out.json"
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, cli_py, "plan", str(prof), *PLAN_ARGS, "-o",
                                   str(out)], stdout=full, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines()[-1] == (
            "gpipe-plan: error: cannot write the output (No space left on device)"
        )
        assert not out.exists() and not list(tmp_path.glob(".out.json.*"))
        with open("/dev/full", "w") as full:  # (a review's: profile and codegen did too)
            done = subprocess.run([sys.executable, cli_py, "profile", "example:mlp",
                                   "--batch-sizes", "2", "--repeats", "1", "--max-repeats", "1",
                                   "-o", str(out)], stdout=full, stderr=subprocess.PIPE,
                                  text=True)  # fmt: skip
        assert done.returncode == 2 and not out.exists(), done.stderr
    # a reader that left (`| head`): the file is still written, and the pipe's end reported
    piped = subprocess.Popen([sys.executable, cli_py, "plan", str(prof), *PLAN_ARGS, "-o",
                              str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    piped.stdout.close()  # (before anything is read)
    assert piped.wait(timeout=120) == 141 and out.exists(), piped.stderr.read()
    piped.stderr.close()
    out.unlink()
    for command in (["check", str(plan_file)], ["plan", str(prof), *PLAN_ARGS, "-o", str(out)]):
        done = subprocess.run(
            [sys.executable, cli_py, *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, pass_fds=(), preexec_fn=lambda: os.close(1),
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [
            "gpipe-plan: error: cannot write the output (stdout is closed)"
        ]
        assert not out.exists()


def test_a_factory_that_calls_sys_exit_is_reported_not_obeyed(run_cli, tmp_path):
    model = tmp_path / "quits.py"
    model.write_text("import sys\ndef make():\n    sys.exit(0)\n")
    assert_bad_input(run_cli("profile", f"{model}:make", "-o", tmp_path / "p.json"),
                     mentions="the factory raised SystemExit")  # fmt: skip
    assert not (tmp_path / "p.json").exists()


def test_a_plans_input_shape_past_memory_is_refused_before_it_is_made():
    """A hand-edited plan's input_shape of 10**12 reached torch.randn (a traceback from the
    allocator); as profile's --input-shape, it is now one line."""
    from profiler.models import capture_sample

    with pytest.raises(InputError, match="two samples of the plan's input"):
        capture_sample(torch.nn.Linear(2, 2), [10**12], "float32")
    assert capture_sample(torch.nn.Linear(2, 2), [3], "float32").shape == (2, 3)


def test_a_model_or_loss_name_no_profile_can_record_is_refused_before_profiling(
    run_cli, monkeypatch, tmp_path
):
    """A tab in the model's folder, or a path past 1024 characters, failed the profile's own
    validation only after the whole profile was measured (a traceback)."""
    import profiler.measure

    monkeypatch.setattr(profiler.measure, "profile_model", _must_not_run)
    odd = tmp_path / "tab\there"
    odd.mkdir()
    (odd / "m.py").write_text("def f(): pass\ndef loss(o, y): pass\n")
    out = tmp_path / "p.json"
    assert_bad_input(run_cli("profile", f"{odd}/m.py:f", "-o", out), mentions="control character")
    assert_bad_input(run_cli("profile", "example:mlp", "--loss", f"{odd}/m.py:loss", "-o", out),
                     mentions="control character")  # fmt: skip
    long = "example:" + "x" * 1100
    assert_bad_input(run_cli("profile", long, "-o", out), mentions="past the 1024")
    assert not out.exists()


@pytest.mark.parametrize(
    "edit, mentions",
    [
        ({"format_version": "9"}, 'format_version "9" is not a whole number'),
        ({"format_version": True}, "format_version true is not a whole number"),
        ({"format_version": 1.5}, "format_version 1.5 is not a whole number"),
        ({"format_version": "2"}, 'format_version "2" is not a whole number'),  # (lax: read
        ({"format_version": 2.0}, "format_version 2.0 is not a whole number"),  # as this one's)
        ({"routes": [[0, 1]]}, "only a captured graph's plan lists routes"),
        ({"kind": "pl\nan" + "x" * 10_000}, "is a 'pl\\nanxxx"),
        ({"kind": True}, "its kind is true, not a name"),  # (it read "is a True")
        ({"batch_size": True}, "batch_size: Input should be a valid integer"),  # (read as 1)
        ({"microbatches": "2"}, "microbatches: Input should be a valid integer"),
    ],
)
def test_hand_edits_the_red_team_slipped_past_are_refused(run_cli, plan_file, edit, mentions):
    """A future version written as text ("9") was read past the version check; a sequential
    plan with routes was accepted and its program failed at run time; a kind with a newline cut
    the message short, and a long one filled the terminal."""
    data = json.loads(plan_file.read_text())
    data.update(edit)
    plan_file.write_text(json.dumps(data))
    r = run_cli("show", plan_file)
    assert_bad_input(r, mentions=mentions)
    assert len(r.err) < 300


def test_a_trickling_pipe_or_a_character_device_as_input_is_refused(
    run_cli, prof, tmp_path, monkeypatch
):
    """A pipe sending a byte now and then never paused long enough to be refused, and a
    terminal (or /dev/zero) was read with no end."""
    import contextlib
    import threading
    import time

    import profiler.artifact as artifact

    assert_bad_input(run_cli("show", "/dev/zero"), mentions="character device")
    monkeypatch.setattr(artifact, "FIFO_TOTAL_S", 0.6)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def trickle() -> None:
        with contextlib.suppress(BrokenPipeError), open(fifo, "wb", buffering=0) as f:
            for _ in range(8):  # (the reader gives up first: then the pipe is broken)
                f.write(b" ")
                time.sleep(0.2)

    writer = threading.Thread(target=trickle, daemon=True)
    writer.start()
    assert_bad_input(run_cli("plan", fifo, *PLAN_ARGS), mentions="still sending after 0.6 s")
    writer.join(5)


def test_a_cluster_size_of_true_is_refused_not_read_as_one_byte():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="not true/false"):
        Cluster.model_validate(
            {"kind": "cluster", "devices": [{"name": "a", "memory_bytes": True}]}
        )
    with pytest.raises(ValidationError, match="not true/false"):
        Cluster.model_validate(
            {
                "kind": "cluster",
                "devices": [{"name": "a", "memory_bytes": 9, "reserved_bytes": False}],
            }
        )


def test_an_output_is_never_inside_the_python_installation(tmp_path):
    """`plan` and `simulate` load no torch, so `-o .../site-packages/torch/__init__.py` replaced
    torch itself (the red team's venv lost it): nothing in the installation is an output, a new
    file there neither (it could shadow a module)."""
    import sysconfig

    inside = Path(torch.__file__).parent / "_VF.pyi"  # torch's own, and no module
    assert inside.exists()
    for where in (inside, Path(sysconfig.get_paths()["purelib"]) / "new.json"):
        with pytest.raises(InputError, match="inside the Python installation"):
            check_output(where)
    check_output(tmp_path / "plan.json")


def test_an_output_through_an_open_descriptor_is_refused_and_its_file_kept(tmp_path):
    """`-o /dev/stdout >> log.txt` replaced log.txt by the plan (the redirect's file is what
    /dev/stdout resolves to): a path through /dev/fd, /proc/PID/fd or /dev/std* is refused
    whatever it leads to, also by a link of the user's own."""
    log = tmp_path / "log.txt"
    log.write_text("precious\n")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    link = tmp_path / "out.json"
    link.symlink_to(f"/proc/self/fd/{fd}")
    try:
        for path in (f"/proc/self/fd/{fd}", f"/dev/fd/{fd}", link):
            with pytest.raises(InputError, match="open file descriptor"):
                check_output(path)
    finally:
        os.close(fd)
    assert log.read_text() == "precious\n"


def test_check_refuses_a_plan_whose_time_or_bubble_was_edited(run_cli, plan_file, tmp_path):
    """`check --max-bubble` read the bubble the file states: set to 0 by hand, the gate passed a
    plan whose schedule idles 55% of the time. Both figures are now what the schedule gives."""
    for field, value in (("bubble_fraction", 0.0), ("iteration_ms", 0.001)):
        edited = tmp_path / f"{field}.json"
        edited.write_text(plan_file.read_text())
        _edited_plan(edited, lambda d, f=field, v=value: d["predicted"].update({f: v}), reseal=True)
        r = run_cli("check", edited, "--max-bubble", "0.99")
        assert_bad_input(r, mentions="the plan was edited")
    assert run_cli("check", plan_file, "--max-bubble", "0.99").code == 0


def test_a_throughput_edited_is_refused_and_codegen_refuses_what_check_does(
    run_cli, plan_file, tmp_path
):
    """Found by a red team: a plan's batch and micro-batch size raised 1024x (and resealed)
    passed `check` while `show` printed the old throughput; and `codegen` compiled plans that
    `check` refuses (an edited micro-batch count among them)."""
    edited = _edited_plan(
        plan_file, lambda d: d["predicted"].update(throughput_samples_per_s=1e9), reseal=True
    )
    assert_bad_input(run_cli("check", edited), mentions="its predicted throughput")
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert run_cli("profile", "example:mlp", "--batch-sizes", "2", "--repeats", "1",
                   "--max-repeats", "1", "-o", prof).code == 0  # fmt: skip
    args = ("--devices", 2, "--memory", "1GiB", "--batch-size", 4, "--microbatches", 2)
    assert run_cli("plan", prof, *args, "-o", plan).code == 0
    out = tmp_path / "program.py"
    assert run_cli("codegen", plan, "--model", "example:mlp", "-o", out).code == 0
    out.unlink()
    _edited_plan(plan, lambda d: d["predicted"].update(iteration_ms=1.0), reseal=True)
    r = run_cli("codegen", plan, "--model", "example:mlp", "-o", out)
    assert_bad_input(r, mentions="its predicted step time", no_file=out)


def test_a_plan_that_disagrees_with_itself_is_refused(run_cli, plan_file, tmp_path):
    """`show` printed a stage's own budget and `check` its device's: a plan whose two differ, a
    stage total that is not the sum of its parts, and state bytes past what the simulator's
    int64 counts hold (it printed a peak of -8192 PiB) are refused in one line."""
    edits = {
        "budget": lambda d: d["stages"][0]["memory"].update(budget=d["devices"][0]["budget"] // 3),
        "sum of its parts": lambda d: d["stages"][0]["memory"].update(
            total=d["stages"][0]["memory"]["total"] + 1
        ),
        "past what a device holds": lambda d: d["stages"][1]["state_bytes"].update(
            activations=2**61
        ),
    }
    for says, edit in edits.items():
        edited = tmp_path / "edited.json"
        edited.write_text(plan_file.read_text())
        _edited_plan(edited, edit, reseal=True)
        for command in ("show", "check", "simulate"):
            assert_bad_input(run_cli(command, edited), mentions=says)


def test_link_flags_with_a_cluster_file_are_refused(run_cli, prof, tmp_path):
    """--bandwidth and --latency-ms beside --cluster were dropped without a word; so was a
    cluster file's list of links beside links by host that say otherwise."""
    path = tmp_path / "c.json"
    Cluster.uniform(2, "1MiB").save(path)
    for flag, value in (("--bandwidth", "1GB/s"), ("--latency-ms", "5")):
        r = run_cli("plan", prof, "--cluster", path, "--batch-size", 8, flag, value)
        assert_bad_input(r, mentions=f"give either --cluster or {flag}")
    devices = [{"name": f"d{k}", "memory_bytes": 2**20, "host": f"h{k}"} for k in range(2)]
    by_host = {"intra_host": {"latency_ms": 0.1}, "inter_host": {"latency_ms": 5.0}}
    mixed = {"kind": "cluster", "format_version": 1, "devices": devices,
             "links": [{"latency_ms": 0.1}], "host_links": by_host}  # fmt: skip
    path.write_text(json.dumps(mixed))
    r = run_cli("plan", prof, "--cluster", path, "--batch-size", 8)
    assert_bad_input(r, mentions="they differ")
    mixed["links"] = [{"latency_ms": 5.0}]  # what the hosts give, as a saved cluster holds
    path.write_text(json.dumps(mixed))
    assert run_cli("plan", prof, "--cluster", path, "--batch-size", 8, "-o",
                   tmp_path / "p.json").code == 0  # fmt: skip
    # (found by a red team: links by host given twice, as `links` and as `host_links`, and
    # the second dropped unread)
    twice = {**mixed, "links": {"intra_host": {}, "inter_host": {}}}
    path.write_text(json.dumps(twice))
    r = run_cli("plan", prof, "--cluster", path, "--batch-size", 8)
    assert_bad_input(r, mentions="given by host twice")
    path.write_text(json.dumps({**mixed, "links": by_host}))  # the same twice: as once
    assert run_cli("plan", prof, "--cluster", path, "--batch-size", 8, "-o",
                   tmp_path / "p.json").code == 0  # fmt: skip


def test_codegen_refuses_an_input_shape_its_model_does_not_take(
    run_cli, transformer_profile_path, tmp_path
):
    """An edited input shape passed codegen, and the program failed with a traceback at its
    first step; the model now runs on fake tensors of the plan's shape first (no memory)."""
    plan = tmp_path / "plan.json"
    args = ("--devices", 2, "--memory", "1GiB", "--batch-size", 8, "--target", "torchrun")
    assert run_cli("plan", transformer_profile_path, *args, "-o", plan).code == 0
    assert run_cli("check", plan).code == 0  # (its time: the torchrun program's, as simulated)
    out = tmp_path / "prog.py"
    for shape in ([], [8, 8]):
        bad = tmp_path / "bad.json"
        bad.write_text(plan.read_text())
        _edited_plan(bad, lambda d, shape=shape: d.update(input_shape=shape), reseal=True)
        r = run_cli("codegen", bad, "--model", "example:transformer", "-o", out)
        assert_bad_input(r, mentions="does not run on the plan's input shape", no_file=out)
    assert run_cli("codegen", plan, "--model", "example:transformer", "-o", out).code == 0


def test_a_torchrun_program_started_without_torchrun_says_how_in_one_line(
    run_cli, transformer_profile_path, tmp_path, monkeypatch, capsys
):
    """`python program.py` of a torchrun program gave torch's traceback ("environment variable
    RANK expected"); it now says how to launch it, and --help works."""
    plan = tmp_path / "plan.json"
    args = ("--devices", 2, "--memory", "1GiB", "--batch-size", 8, "--microbatches", 2)
    assert run_cli("plan", transformer_profile_path, *args, "-o", plan).code == 0
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("sys.argv", ["prog.py"])
    for target in ("torchrun", "torch-pipelining"):
        out = tmp_path / "prog.py"
        assert run_cli("codegen", plan, "--model", "example:transformer", "--target", target,
                       "-o", out).code == 0  # fmt: skip
        program: dict = {"__name__": "program"}
        exec(compile(out.read_text(), str(out), "exec"), program)
        with pytest.raises(SystemExit) as stop:
            program["main"]([])
        said = capsys.readouterr()
        assert stop.value.code == 2 and said.out == "", said
        assert said.err.count("\n") == 1 and "torchrun --nproc-per-node 2 prog.py" in said.err
        with pytest.raises(SystemExit) as stop:
            program["main"](["--help"])
        assert stop.value.code == 0
        assert "torchrun --nproc-per-node 2" in capsys.readouterr().out.replace("\n", " ")


def test_codegen_does_not_refuse_what_fake_tensors_cannot_tell():
    """The check on the plan's input shape runs the model on fake tensors: a step that reads
    its data (a NaN guard, `.item()`) cannot run there, yet runs for real. Such a model passes;
    a shape it does not take is refused."""
    from types import SimpleNamespace

    from cli import _runs_as_planned

    class Guard(torch.nn.Module):
        def forward(self, x):
            if not torch.isfinite(x).all():
                raise ValueError("not finite")
            return x * x.abs().max().item()

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Guard(), torch.nn.Linear(4, 2))
    plan = SimpleNamespace(captured=False, microbatch_size=2, input_shape=[4],
                           input_dtype="float32", num_layers=3)  # fmt: skip
    _runs_as_planned(model, plan, "plan.json")
    plan.input_shape = [5]
    with pytest.raises(InputError, match=r"does not run on the plan's input shape \[5\]"):
        _runs_as_planned(model, plan, "plan.json")


def test_launches_the_host_cannot_hold_are_refused_before_they_start(
    run_cli, transformer_profile_path, tmp_path
):
    """`links --nproc-per-node 1024` started that many torch processes whatever the host held,
    and `measure` of a plan whose batch alone passed the allocation check went on to the
    out-of-memory killer: both are refused, in one line, before anything is launched."""
    r = run_cli("links", "--nproc-per-node", 1024, "--memory", "1GiB", "--device", "cpu")
    assert_bad_input(r, mentions="this host has free")
    plan = tmp_path / "plan.json"
    args = ("--devices", 2, "--memory", "1PiB", "--batch-size", 2**24)
    assert run_cli("plan", transformer_profile_path, *args, "-o", plan).code == 0
    for target in ("streams", "torchrun"):
        r = run_cli("measure", plan, "--model", "example:transformer", "--target", target)
        assert_bad_input(r, mentions="all in this host's memory")


@pytest.mark.parametrize("median", [5e-324, 1e-310, 1e-7])
def test_a_time_below_a_nanosecond_is_planned_as_zero(run_cli, prof, tmp_path, median):
    """Found by a red team: subnormal times hung the split search (a bisection whose middle
    no longer moved), and 1e-310 ms overflowed the throughput into a traceback; the runtime's
    own figures too (a review). Read as 0 (no timer measures them), the plan is the one of
    zeros, at once."""
    plans = []
    for ms in (median, 0.0):
        edited = _mutated_profile(prof, tmp_path, lambda d, ms=ms: [
            [t.update(median=ms, min=0.0) for t in x["forward_ms"].values()]
            for x in d["layers"]
        ] and d.update(runtime={"action_ms": ms, "step_ms": ms, "call_ms": ms}))  # fmt: skip
        out = tmp_path / f"plan{len(plans)}.json"
        done = run_cli("plan", edited, *PLAN_ARGS, "-o", out)
        assert done.code == 0 and "Traceback" not in done.err, done.err
        plan = json.loads(out.read_text())
        plans.append((plan["stages"], plan["predicted"], plan["microbatches"], plan["schedule"]))
    assert plans[0] == plans[1]


def test_the_split_time_alone_ends_on_subnormal_times():
    """The partition's own guard, for a caller that passes such times."""
    from planner.partition import _time_alone

    lo, fast = _time_alone(np.full(6, 5e-324), [1.0, 1.0])
    assert 0 <= lo <= fast


def test_bytes_that_do_not_grow_with_the_samples_are_refused_at_any_micro_batch_count(
    run_cli, prof, tmp_path
):
    """Found by a red team: every layer saving 1 PiB at every size passed the size check (made
    at the batch's own size) and then overflowed the planner's int64 sums with 500
    micro-batches in flight: the least-memory search never ended."""
    big = {str(b): 2**50 for b in (1, 2, 4, 8)}
    bad = _mutated_profile(
        prof, tmp_path, lambda d: [x.update(saved_bytes=big) for x in d["layers"]]
    )
    out = tmp_path / "plan.json"
    args = ("--devices", 2, "--memory", "1PiB", "--batch-size", 500, "--microbatches", 500)
    assert_bad_input(run_cli("plan", bad, *args, "-o", out), mentions="past what any device",
                     no_file=out)  # fmt: skip


def test_the_size_check_counts_no_more_micro_batches_than_a_plan_may_have(run_cli, prof, tmp_path):
    """Found by a review: the check above counted micro-batches of one sample, 2**24 of them,
    where no plan has more than 1 024 (or --microbatches): an honest model whose weight
    gradients' temporaries are 64 GiB was refused at a large batch."""
    big = {str(b): 2**36 for b in (1, 2, 4, 8)}
    edited = _mutated_profile(
        prof, tmp_path, lambda d: d["layers"][2].update(backward_transient_bytes=big)
    )  # fmt: skip
    args = ("--devices", 2, "--memory", "1PiB", "--batch-size", 2**24, "--microbatches", 16)
    done = run_cli("plan", edited, *args, "-o", tmp_path / "plan.json")
    assert done.code == 0, done.err


def test_a_profile_without_the_optimizers_step_is_said_to_leave_it_out(run_cli, prof, tmp_path):
    step = {"adam": {"foreach": True, "per_byte": 1.0}}
    measured = _mutated_profile(prof, tmp_path, lambda d: d.update(optimizer_step=step))
    done = run_cli("plan", measured, *PLAN_ARGS, "-o", tmp_path / "plan.json")
    assert done.code == 0 and "measured no" not in done.err
    done = run_cli("plan", measured, *PLAN_ARGS, "--optimizer", "sgd", "-o", tmp_path / "p2.json")
    assert done.code == 0 and "measured no sgd step" in done.err


@pytest.mark.parametrize(
    "edit, mentions",
    [
        (
            lambda d: d["layers"][0].update(largest_param_bytes=100, param_tensor_bytes=[2**49]),
            "more than its largest_param_bytes",
        ),
        (
            lambda d: d["layers"][0].update(largest_param_bytes=100, param_tensor_bytes=["100"]),
            "valid integer",
        ),
        (
            lambda d: d["layers"][0].update(largest_param_bytes=100, param_tensor_bytes=[True]),
            "valid integer",
        ),
        (lambda d: d["meta"].update(threads=-3), "greater than or equal to 0"),
        (lambda d: d["meta"].update(threads=10**6), "less than or equal to 1024"),
        (
            lambda d: d["optimizer_step"].update(
                adam={"foreach": False, "per_byte": 0.0, "carry": 1.0}
            ),
            "a thousand times",
        ),
        (
            lambda d: d["optimizer_step"].update(
                adam={"foreach": True, "per_byte": 2.0, "carry": 1.0}
            ),
            "not of foreach",
        ),
    ],  # fmt: skip
)
def test_the_profiles_step_order_and_threads_are_read_strictly(run_cli, prof, tmp_path, edit,
                                                                 mentions):  # fmt: skip
    """Found by a red team: a profile's meta.threads of -3 gave `plan` a traceback (the plan
    takes 1 to 1024); param_tensor_bytes contradicting the layer's largest tensor, or given as
    strings, and a carry on a step that makes nothing of its own, were planned."""
    bad = _mutated_profile(prof, tmp_path, edit)
    out = tmp_path / "plan.json"
    assert_bad_input(run_cli("plan", bad, *PLAN_ARGS, "-o", out), mentions=mentions, no_file=out)


def test_a_float64_model_profiled_as_float32_compiles_against_its_plan(run_cli, tmp_path):
    """Found by a red team: `profile` casts a model to --dtype (float32 unless told), and
    codegen and measure compared the model in its own dtype with the plan's, float32 left
    uncast: "a different model ... profile and plan it again", whatever was done again."""
    model = tmp_path / "f64.py"
    model.write_text(
        "import torch\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),\n"
        "                            torch.nn.Linear(16, 4)).double()\n"
        "    m.example_input = torch.randn(4, 8, dtype=torch.float64)\n"
        "    return m\n"
    )
    prof, plan, prog = tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "prog.py"
    assert run_cli("profile", f"{model}:make", "--batch-sizes", "1,2", "--repeats", "1",
                   "-o", prof).code == 0  # fmt: skip
    assert json.loads(prof.read_text())["dtype"] == "float32"
    assert run_cli("plan", prof, "--devices", "2", "--memory", "1GiB", "--batch-size", "4",
                   "-o", plan).code == 0  # fmt: skip
    done = run_cli("codegen", plan, "--model", f"{model}:make", "-o", prog)
    assert done.code == 0, done.err
    assert "class Pipeline" in prog.read_text()
