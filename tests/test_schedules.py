"""Schedules as data: generators against closed forms, the validator against broken schedules,
the simulator against hand arithmetic, and exchange with torch.distributed.pipelining."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (
    Action,
    Costs,
    Kind,
    ScheduleError,
    StageBytes,
    build_schedule,
    chrome_trace,
    from_csv,
    insert_comms,
    parse_schedule,
    simulate,
    to_csv,
    validate,
)

KM = [(K, M) for K in (1, 2, 3, 4, 5, 8) for M in (1, 2, 3, 4, 7, 8, 16)]


def idle(tl) -> float:
    return tl.makespan * len(tl.busy) - sum(tl.busy)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("K,M", KM)
def test_equal_stages_bubble_is_closed_form(name, K, M):
    tl = simulate(build_schedule(name, K, M), Costs.uniform(K, forward=1, backward=2))
    assert tl.makespan == (M + K - 1) * 3
    assert Fraction(idle(tl)) / Fraction(K * tl.makespan) == Fraction(K - 1, M + K - 1)
    assert tl.bubble_fraction == pytest.approx((K - 1) / (M + K - 1), rel=1e-12)
    assert tl.bubble == [1 - b / tl.makespan for b in tl.busy]  # per rank: equal stages, equal idle
    assert len(set(tl.bubble)) == 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 12), st.data())
def test_gpipe_makespan_matches_closed_form(K, M, data):
    f = data.draw(st.lists(st.integers(1, 20), min_size=K, max_size=K))
    b = data.draw(st.lists(st.integers(1, 20), min_size=K, max_size=K))
    tl = simulate(build_schedule("gpipe", K, M), Costs(f, b))
    assert tl.makespan == (sum(f) + (M - 1) * max(f)) + (sum(b) + (M - 1) * max(b))


def test_gpipe_with_links_adds_one_transfer_per_cut_each_way():
    K, M, c = 4, 6, 0.25
    tl = simulate(build_schedule("gpipe", K, M), Costs.uniform(K, 1, 2, transfer=[c] * (K - 1)))
    assert tl.makespan == (K * 1 + (K - 1) * c + (M - 1) * 1) + (K * 2 + (K - 1) * c + (M - 1) * 2)
    assert len(tl.transfers) == 2 * (K - 1) * M


@pytest.mark.parametrize("K,M", KM)
def test_activations_in_flight(K, M):
    one = simulate(build_schedule("1f1b", K, M), Costs.uniform(K))
    assert one.peak_memory == [min(M, K - s) for s in range(K)]
    gp = simulate(build_schedule("gpipe", K, M), Costs.uniform(K))
    assert gp.peak_memory == [M] * K


def test_recomputation_keeps_inputs_and_one_stash():
    K, M = 3, 5
    sizes = StageBytes(input=7, activations=107, static=1000)  # the stash includes its input
    costs = Costs.uniform(K, memory=[sizes] * K, recompute=["always"] * K)
    tl = simulate(build_schedule("gpipe", K, M), costs)
    # the last backward: M - 1 inputs kept, one micro-batch re-materialised
    assert tl.peak_memory == [1000 + (M - 1) * 7 + 107] * K
    tl = simulate(
        build_schedule("gpipe", K, M), Costs(**{**costs.__dict__, "recompute": ["except_last"] * K})
    )
    assert tl.peak_memory == [1000 + (M - 1) * 7 + 107] * K
    never = simulate(build_schedule("gpipe", K, M), Costs.uniform(K, memory=[sizes] * K))
    assert never.peak_memory == [1000 + M * 107] * K
    # A recomputed backward costs one forward more: the backward flow shop grows by (M + K - 1) f.
    assert (
        simulate(build_schedule("gpipe", K, M), costs).makespan == never.makespan + (M + K - 1) * 1
    )


@pytest.mark.parametrize(
    "R,v,M", [(2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 9), (8, 2, 16), (4, 4, 12)]
)
def test_interleaving_cuts_the_bubble_by_v(R, v, M):
    plain = simulate(build_schedule("1f1b", R, M), Costs.uniform(R, forward=v, backward=2 * v))
    inter = simulate(
        build_schedule("interleaved-1f1b", R * v, M, stages_per_rank=v), Costs.uniform(R * v, 1, 2)
    )
    assert sum(inter.busy) == sum(plain.busy)
    assert idle(inter) * v == idle(plain)


@pytest.mark.parametrize("K,M", [(2, 2), (3, 4), (4, 4), (4, 8), (4, 12), (8, 8), (8, 16), (6, 20)])
def test_zb_h1_bubble_is_a_third_of_1f1b_with_no_more_memory(K, M):
    costs = Costs.uniform(K, forward=1, backward=2, input_grad=[1] * K, weight_grad=[1] * K)
    one = simulate(build_schedule("1f1b", K, M), costs)
    zb = simulate(build_schedule("zb-h1", K, M), costs)
    assert idle(zb) * 3 == idle(one)
    assert max(zb.peak_memory) <= max(one.peak_memory)


@pytest.mark.parametrize("K,M", [(3, 1), (4, 2), (5, 3)])
def test_zb_h1_with_fewer_microbatches_than_stages_still_beats_1f1b(K, M):
    costs = Costs.uniform(K, forward=1, backward=2, input_grad=[1] * K, weight_grad=[1] * K)
    one = simulate(build_schedule("1f1b", K, M), costs)
    zb = simulate(build_schedule("zb-h1", K, M), costs)
    assert zb.makespan < one.makespan and max(zb.peak_memory) <= max(one.peak_memory)


SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("zb-h1", 1),
    ("interleaved-1f1b", 2),
    ("interleaved-1f1b", 3),
]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(SCHEDULES), st.integers(1, 6), st.integers(1, 13), st.data())
def test_every_generated_schedule_is_valid_and_simulates_causally(sched, R, M, data):
    name, v = sched
    if name == "interleaved-1f1b" and M > R and M % R:
        with pytest.raises(ValueError, match="multiple of"):
            build_schedule(name, R * v, M, stages_per_rank=v)
        return
    s = build_schedule(name, R * v, M, stages_per_rank=v)
    validate(s)
    lowered = insert_comms(s)
    validate(lowered)
    S = s.num_stages
    f = data.draw(st.lists(st.integers(1, 9), min_size=S, max_size=S))
    b = data.draw(st.lists(st.integers(2, 9), min_size=S, max_size=S))
    c = data.draw(st.lists(st.integers(0, 3), min_size=S - 1, max_size=S - 1))
    tl = simulate(lowered, Costs(f, b, transfer=c))
    end = {sp.action: sp.end for sp in tl.spans}
    start = {sp.action: sp.start for sp in tl.spans}
    assert len(end) == sum(len(a) for a in lowered.ranks.values())
    for r in range(tl.schedule.num_ranks):
        spans = [sp for sp in tl.spans if sp.rank == r]
        assert all(
            x.end <= y.start for x, y in zip(spans, spans[1:])
        )  # a rank does one thing at a time
    for a in end:
        if a.kind == Kind.F and a.stage > 0:
            assert start[a] >= end[Action(a.stage - 1, Kind.F, a.microbatch)]
        if a.kind in (Kind.B, Kind.I):
            assert start[a] >= end[Action(a.stage, Kind.F, a.microbatch)]
            if a.stage < S - 1:
                nxt = [Action(a.stage + 1, k, a.microbatch) for k in (Kind.B, Kind.I)]
                assert start[a] >= min(end[x] for x in nxt if x in end)
        if a.kind == Kind.W:
            assert start[a] >= end[Action(a.stage, Kind.I, a.microbatch)]
    assert all(m == 0 for steps in tl.memory for m in [steps[-1][1]])  # everything freed at the end


@settings(max_examples=120, deadline=None)
@given(st.sampled_from(SCHEDULES), st.sampled_from([1, 2, 3, 4, 5, 6, 9, 12]), st.integers(1, 13),
       st.data())  # fmt: skip
def test_wave_simulation_equals_the_event_loop_to_the_bit(sched, R, M, data):
    """The planner's simulation, a wave of nodes at a time (waves.py), against the event loop it
    replaces on compute-only schedules: every start, end, busy time and transfer identical."""
    import numpy as np

    from schedules.memory import recomputes
    from schedules.simulate import _by_waves, _cost_lists, _event_loop
    from schedules.waves import durations, waves_of

    name, v = sched
    if name == "interleaved-1f1b" and M > R and M % R:
        return
    s = build_schedule(name, R * v, M, stages_per_rank=v)
    S = s.num_stages
    t = st.floats(0, 10, allow_nan=False)
    f, b, i, w = (data.draw(st.lists(t, min_size=S, max_size=S)) for _ in range(4))
    link = data.draw(st.lists(t, min_size=S - 1, max_size=S - 1))
    modes = data.draw(st.lists(st.sampled_from(["never", "always", "except_last"]), min_size=S,
                               max_size=S))  # fmt: skip
    extra = data.draw(t)  # the runtime's cost per action
    # a frozen prefix: the stages up to the first that trains send no gradient back
    first = data.draw(st.integers(0, S))
    sends = [k > first for k in range(S)] if data.draw(st.booleans()) else None
    costs = Costs(f, b, input_grad=i, weight_grad=w, recompute=modes, transfer=link,
                  action_overhead=extra)  # fmt: skip
    f, b, i, w, rec, link = _cost_lists(s, costs)
    assert rec == [[f0 if recomputes(mode, m, M) else 0.0 for m in range(M)]
                   for f0, mode in zip(costs.forward, modes)]  # fmt: skip
    want = _event_loop(s, f, b, i, w, rec, link, sends)
    waves = waves_of(s, sends)
    assert waves is not None
    got = _by_waves(waves, durations(waves, f, b, i, w, np.array(rec).reshape(S, M), link))
    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3]
    assert sorted(got[2]) == sorted(want[2])
    if R > 1:  # communication actions: the event loop
        assert waves_of(insert_comms(s)) is None


def test_a_stage_that_sends_no_gradient_back_holds_up_no_one():
    """A frozen first stage (F 4 ms, B 0) before a trained one (F 1, B 3), 1F1B, M = 4, 2 ms
    a message. No gradient crosses the cut (the runtimes send none there), so rank 0 runs its
    forwards back to back: they arrive at 6, 10, 14, 18 and rank 1 runs F B after each, ending
    at 18 + 1 + 3 = 22. Counting a gradient back (as the plan did) made each B on rank 0 wait
    for it, and every forward after: 28, the same time as if every gradient came back.
    The torchrun program, whose sends wait for their receives, ends at 28 (rank 0 waits
    2 ms with each send), not 30."""
    s = build_schedule("1f1b", 2, 4)
    for sends, want, want_torchrun in ((None, 28.0, 30.0), ([False, False], 22.0, 28.0)):
        costs = Costs([4.0, 1.0], [0.0, 3.0], transfer=[2.0], sends_grads=sends)
        tl = simulate(s, costs, memory=False)
        assert tl.makespan == want
        assert [t.direction for t in tl.transfers].count("B") == (4 if sends is None else 0)
        assert simulate(s, costs, memory=False, rendezvous=True).makespan == want_torchrun
    with pytest.raises(ValueError, match="sends_grads"):
        simulate(s, Costs([4.0, 1.0], [0.0, 3.0], sends_grads=[False]), memory=False)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"])
def test_wide_schedules_take_numpys_waves_and_still_equal_the_event_loop(name):
    """Past 8 ranks the waves come from numpy, lane by lane, instead of Python's successor
    lists: the same waves, and the same simulation to the bit."""
    import numpy as np

    from schedules.simulate import _by_waves, _event_loop
    from schedules.waves import _kahn, _kahn_python, durations, waves_of

    s = build_schedule(name, 64 if name == "interleaved-1f1b" else 32, 8)
    waves = waves_of(s)
    assert s.num_ranks > 8 and waves is not None
    by_lanes = _kahn(waves.pred, waves.nodes, s.num_ranks, waves.lanes, waves.lane_starts)
    by_python = _kahn_python(waves.pred, waves.nodes)
    assert len(by_lanes) == len(by_python) == len(waves.waves)
    assert all(np.array_equal(a, b) for a, b in zip(by_lanes, by_python))
    S, M = s.num_stages, s.num_microbatches
    f = [0.5 + (k % 3) for k in range(S)]
    b = [1.25 * x for x in f]
    link = [0.1 * (k % 2) for k in range(S - 1)]
    rec = [[f[k] if m % 2 == 0 else 0.0 for m in range(M)] for k in range(S)]
    want = _event_loop(s, f, b, f, b, rec, link)
    got = _by_waves(waves, durations(waves, f, b, f, b, np.array(rec), link))
    assert got[0] == want[0] and got[1] == want[1] and got[3] == want[3]


def test_a_cycle_on_many_ranks_is_reported_by_the_event_loop():
    """The lanes find no wave to take where two ranks wait on each other (past 8 ranks, where
    they run): no waves, and simulate's event loop names the deadlock."""
    s = build_schedule("1f1b", 12, 4)
    acts = s.ranks[5]
    i, j = acts.index(Action(5, Kind.F, 0)), acts.index(Action(5, Kind.B, 0))
    acts[i], acts[j] = acts[j], acts[i]  # B before its own F: nothing runs on rank 5
    from schedules.waves import _build

    assert _build(s) is None
    with pytest.raises(ScheduleError):
        simulate(s, Costs.uniform(12))


def test_a_schedule_edited_in_place_after_a_simulation_is_simulated_afresh():
    """Found in review: a key kept on the schedule missed an edit that keeps every rank's
    length, and the old waves came back. Only the planner's own schedules keep their key."""
    s = build_schedule("1f1b", 3, 4)
    simulate(s, Costs.uniform(3))
    acts = s.ranks[2]
    i, j = acts.index(Action(2, Kind.F, 1)), acts.index(Action(2, Kind.B, 1))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match="before 2F1"):
        simulate(s, Costs.uniform(3))


def test_broken_schedules_leave_the_wave_path_for_the_event_loops_report():
    from schedules.waves import waves_of

    s = parse_schedule("0: 0F0 0B0 0F1 0B1\n1: 1F1 1F0 1B0 1B1", name="broken")  # deadlock
    assert waves_of(s) is None
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(s, Costs.uniform(2))
    s = build_schedule("gpipe", 3, 3)
    s.ranks[1].remove(Action(1, Kind.B, 2))
    assert waves_of(s) is None
    with pytest.raises(ScheduleError, match=r"stage 1 never runs 1B2"):
        simulate(s, Costs.uniform(3))


def test_comms_pair_every_cross_rank_edge():
    s = insert_comms(build_schedule("1f1b", 4, 5))
    kinds = [a.kind for acts in s.ranks.values() for a in acts]
    for k in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B):
        assert kinds.count(k) == 3 * 5
    r1 = [str(a) for a in s.ranks[1]]
    assert r1[:3] == ["1RECV_F0", "1F0", "1SEND_F0"]


def test_action_and_schedule_text_round_trip():
    for text in ("2F0", "1B3", "0I12", "0W2", "0SEND_F1", "3RECV_B0"):
        assert str(Action.parse(text)) == text
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("F0")
    for name, v in SCHEDULES:
        s = build_schedule(name, 2 * v, 4, stages_per_rank=v)
        again = parse_schedule(str(s), name=s.name)
        assert again.ranks == s.ranks and again.placement == s.placement


def test_csv_round_trip():
    for name, v in SCHEDULES:
        s = build_schedule(name, 3 * v, 6, stages_per_rank=v)
        text = to_csv(s)
        assert len(text.splitlines()) == s.num_ranks
        again = from_csv(text)
        assert again.ranks == s.ranks and again.placement == s.placement
        assert to_csv(insert_comms(s)) == text  # compute_only drops the communication


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_torch_validator_accepts_our_exports(name, tmp_path):
    sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    K, M = 4, 6
    s = build_schedule(name, K, M)
    actions = {
        r: [sched._Action.from_str(cell) for cell in row.split(",")]
        for r, row in enumerate(to_csv(s).splitlines())
    }
    sched._validate_schedule(actions, K, K, M)


def test_validate_rejects_a_missing_backward():
    s = build_schedule("gpipe", 3, 3)
    s.ranks[1].remove(Action(1, Kind.B, 2))
    with pytest.raises(ScheduleError, match=r"stage 1 never runs 1B2") as e:
        validate(s)
    assert ">?<" in str(e.value) and "rank\\step" in str(e.value)


def test_validate_rejects_a_swapped_dependency():
    s = build_schedule("1f1b", 3, 4)
    acts = s.ranks[2]
    i, j = acts.index(Action(2, Kind.F, 1)), acts.index(Action(2, Kind.B, 1))
    acts[i], acts[j] = acts[j], acts[i]  # backward of micro-batch 1 before its forward
    with pytest.raises(
        ScheduleError, match=r"rank 2 runs 2B1 before 2F1, which it depends on"
    ) as e:
        validate(s)
    assert ">2B1<" in str(e.value)


def test_validate_rejects_a_cross_rank_deadlock():
    # Rank 0 waits for the gradient of micro-batch 0 before sending micro-batch 1, while rank 1
    # wants micro-batch 1 before it will send that gradient back.
    s = parse_schedule("0: 0F0 0B0 0F1 0B1\n1: 1F1 1F0 1B0 1B1", name="broken")
    with pytest.raises(ScheduleError, match="deadlock") as e:
        validate(s)
    text = str(e.value)
    assert ">0B0<" in text and ">1F1<" in text


def test_validate_rejects_duplicates_and_strangers():
    s = build_schedule("gpipe", 2, 2)
    s.ranks[0].append(Action(0, Kind.F, 0))
    with pytest.raises(ScheduleError, match="more than once"):
        validate(s)
    s = build_schedule("gpipe", 2, 2)
    s.ranks[0].append(Action(0, Kind.F, 9))
    with pytest.raises(ScheduleError, match="outside 2 stages x 2 micro-batches"):
        validate(s)


def test_chrome_trace_has_one_event_per_action():
    s = insert_comms(build_schedule("interleaved-1f1b", 4, 4))
    tl = simulate(s, Costs.uniform(4, transfer=[0.5] * 3))
    trace = json.loads(json.dumps(chrome_trace(tl)))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") != "transfer"]
    assert len(complete) == sum(len(a) for a in s.ranks.values())
    assert {e["tid"] for e in complete} == {0, 1}
    f0 = next(e for e in complete if e["name"] == "0F0")
    assert f0["ts"] == 0 and f0["dur"] == 1000.0  # microseconds
    assert any(e["ph"] == "C" for e in trace["traceEvents"])


def test_gantt_png(tmp_path):
    pytest.importorskip("matplotlib")
    from schedules import gantt_png

    path = tmp_path / "g.png"
    gantt_png(simulate(build_schedule("zb-h1", 3, 4), Costs.uniform(3)), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
