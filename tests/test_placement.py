"""--allow-reorder: which device runs which stage, against brute force over every order; links
given by host, and a pipeline that crosses hosts no more than it must."""

from __future__ import annotations

import itertools

import pytest

from planner import Cluster, plan_pipeline
from planner.cluster import Device, Link
from profiler.limits import ArgumentError
from tests.conftest import synthetic_profile


def test_reordering_puts_the_slow_device_on_the_short_stage():
    profile = synthetic_profile([4.0, 4.0, 1.0], sizes=(1, 2, 4))
    cluster = Cluster(
        devices=[
            Device(name="slow", memory_bytes=10**9, speed=0.25),
            Device(name="fast0", memory_bytes=10**9),
            Device(name="fast1", memory_bytes=10**9),
        ]
    )
    kw = {"microbatches": 4, "schedule": "1f1b", "recompute": "never"}
    plan = plan_pipeline(profile, cluster, 4, allow_reorder=True, **kw)
    assert [d.name for d in plan.cluster.devices][2] == "slow"
    as_listed = plan_pipeline(profile, cluster, 4, **kw)
    assert plan.predicted.iteration_ms < as_listed.predicted.iteration_ms
    # brute force: every order of the three devices, planned as given
    every = [
        plan_pipeline(profile, cluster.reordered(list(p)), 4, **kw).predicted.iteration_ms
        for p in itertools.permutations(range(3))
    ]
    assert plan.predicted.iteration_ms == min(every)
    assert plan.solver.optimal and "3 device orders" in plan.solver.method  # fast0 ~ fast1
    # CP-SAT, re-solving the chosen order's split, agrees
    cpsat = plan_pipeline(profile, cluster, 4, allow_reorder=True, solver="cp-sat", **kw)
    assert cpsat.predicted.iteration_ms == plan.predicted.iteration_ms


def host_cluster(hosts: list[str]) -> Cluster:
    return Cluster.model_validate(
        {
            "kind": "cluster",
            "devices": [
                {"name": f"{h}{k}", "memory_bytes": "1GiB", "host": h} for k, h in enumerate(hosts)
            ],
            "links": {
                "intra_host": {"bandwidth_bytes_per_s": 1e12},
                "inter_host": {"bandwidth_bytes_per_s": 1e5, "latency_ms": 1.0},
            },
        }
    )


def test_an_unlucky_device_list_does_not_make_the_pipeline_cross_hosts_more_than_it_must():
    cluster = host_cluster(["a", "b", "a", "b"])
    inter = Link(bandwidth_bytes_per_s=1e5, latency_ms=1.0)
    assert cluster.links == [inter] * 3  # as listed: every neighbour on another host
    profile = synthetic_profile([1.0] * 8, sizes=(1, 2, 4), output_bytes=[2000] * 8)
    listed = plan_pipeline(profile, cluster, 4)
    plan = plan_pipeline(profile, cluster, 4, allow_reorder=True)
    hosts = [d.host for d in plan.cluster.devices]
    assert sum(a != b for a, b in itertools.pairwise(hosts)) == 1
    assert plan.cluster.links.count(inter) == 1
    assert plan.predicted.iteration_ms < listed.predicted.iteration_ms
    again = Cluster.model_validate_json(plan.cluster.canonical_json())
    assert again.links == plan.cluster.links  # links by host survive the plan file


def test_reordering_needs_links_that_do_not_depend_on_the_order():
    profile = synthetic_profile([1.0] * 4, sizes=(1, 2, 4))
    cluster = Cluster(
        devices=[Device(name=f"d{k}", memory_bytes=10**9) for k in range(3)],
        links=[Link(bandwidth_bytes_per_s=1e9), Link(bandwidth_bytes_per_s=1e6)],
    )
    with pytest.raises(ArgumentError, match="by host"):
        plan_pipeline(profile, cluster, 4, allow_reorder=True)
    with pytest.raises(ValueError, match="needs its `host`"):
        Cluster.model_validate(
            {"kind": "cluster", "devices": [{"name": "x", "memory_bytes": 1}],
             "links": {"intra_host": {}, "inter_host": {}}}
        )  # fmt: skip


def test_allow_reorder_on_the_command_line(tmp_path, run_cli):
    profile = synthetic_profile([4.0, 4.0, 1.0], sizes=(1, 2, 4))
    prof, clus, out = tmp_path / "p.json", tmp_path / "c.json", tmp_path / "plan.json"
    profile.save(prof)
    Cluster(
        devices=[
            Device(name="slow", memory_bytes=10**9, speed=0.25),
            Device(name="fast0", memory_bytes=10**9),
            Device(name="fast1", memory_bytes=10**9),
        ]
    ).save(clus)
    r = run_cli("plan", prof, "--cluster", clus, "--batch-size", 4, "--allow-reorder", "-o", out)
    assert r.code == 0, r.err
    from planner import Plan

    assert [d.name for d in Plan.load(out).cluster.devices][2] == "slow"


def test_device_orders_are_every_distinct_one_and_any_count_of_devices_is_fine():
    from planner.cluster import _distinct_orders

    for items in (["a", "b", "a"], [1, 2, 3, 1], ["x"] * 4, [2, 1, 2, 1, 3]):
        got = _distinct_orders(items, 10_000)
        assert got[0] == tuple(items)
        assert sorted(got) == sorted(set(itertools.permutations(items)))
        assert len(got) == len(set(got))
    many = Cluster(devices=[Device(name=f"d{k}", memory_bytes=10**9, speed=1 + k / 1e3)
                            for k in range(1024)])  # fmt: skip
    orders, complete = many.placements(limit=50)
    assert len(orders) == 50 and not complete and orders[0] == list(range(1024))


def test_a_time_limit_covers_all_the_orders_together():
    profile = synthetic_profile([4.0, 4.0, 1.0], sizes=(1, 2, 4))
    cluster = Cluster(devices=[Device(name=f"d{k}", memory_bytes=10**9, speed=1 + k)
                               for k in range(3)])  # fmt: skip
    plan = plan_pipeline(profile, cluster, 4, allow_reorder=True, time_limit_s=0.0)
    assert not plan.solver.optimal and "1 device order" in plan.solver.method
    assert "the time limit cut the search of the device orders short" in plan.solver.unproven


def test_where_nothing_fits_a_time_limit_still_ends_the_search_of_orders():
    """No order fits: each order's search (and its search for the least memory that would do)
    ran to the end whatever the time limit said (174 s on 8 devices for a limit of 1 s)."""
    from planner.search import InfeasibleError

    profile = synthetic_profile([4.0, 4.0, 1.0], sizes=(1, 2, 4))
    cluster = Cluster(devices=[Device(name=f"d{k}", memory_bytes=1, speed=1 + k)
                               for k in range(3)])  # fmt: skip
    with pytest.raises(InfeasibleError, match=r"cut the search of the device orders short \(1 "):
        plan_pipeline(profile, cluster, 4, allow_reorder=True, time_limit_s=0.0)


def test_orders_searched_against_the_best_so_far_give_the_brute_force_plan():
    """Each order after the first plan prunes the candidates that cannot beat it, and an order
    none of whose candidates can is skipped: the plan is still the fastest over every order."""
    profile = synthetic_profile([3.0, 1.0, 2.0, 5.0, 1.0], sizes=(1, 2, 4, 8))
    cluster = Cluster(
        devices=[Device(name=f"d{k}", memory_bytes=10**9, speed=s)
                 for k, s in enumerate((1.0, 0.5, 2.0, 1.0))],
        links=[Link(bandwidth_bytes_per_s=1e5, latency_ms=0.5)] * 3,
    )  # fmt: skip
    plan = plan_pipeline(profile, cluster, 8, allow_reorder=True)
    every = [
        plan_pipeline(profile, cluster.reordered(list(p)), 8).predicted.iteration_ms
        for p in itertools.permutations(range(4))
    ]
    assert plan.predicted.iteration_ms == min(every) and plan.solver.optimal
    # (searched from scratch, the 24 orders solved 681 of their 1 152 candidates)
    assert plan.solver.solved < plan.solver.candidates // 4, plan.solver


def test_an_order_only_the_memory_search_finds_a_plan_for_still_wins():
    """Found by the review: an order whose only plan is an interleaved split that the memory
    search finds (the split search finds none) was dropped once another order had a plan."""
    profile = synthetic_profile(
        [1.3, 0.4, 2.0, 2.3, 1.6, 0.6, 1.1, 2.7, 0.4],
        saved=[492, 165, 498, 590, 306, 149, 590, 433, 427],
        params=[397, 240, 161, 349, 356, 353, 344, 145, 64],
        sizes=(1, 2, 4, 8),
    )
    cluster = Cluster(devices=[Device(name="d0", memory_bytes=6346, speed=1.1),
                               Device(name="d1", memory_bytes=6346, speed=1.0)])  # fmt: skip
    kw = {"schedule": "interleaved-1f1b", "checkpoint": ()}
    plan = plan_pipeline(profile, cluster, 8, allow_reorder=True, **kw)
    every = [
        plan_pipeline(profile, cluster.reordered(list(p)), 8, **kw).predicted.iteration_ms
        for p in itertools.permutations(range(2))
    ]
    assert plan.predicted.iteration_ms == min(every) < max(every)


def test_an_order_that_splits_a_host_is_planned_where_it_is_the_fastest():
    """Found by the red team: only orders keeping each host's devices together were planned,
    and the plan said optimal. With the link inside a host slower than the one across (a
    cluster file may say so), the fastest order alternates hosts; every order is planned where
    there are at most 120, and the plan is brute force's."""
    profile = synthetic_profile([1.0] * 8, output_bytes=[2000] * 8, sizes=(1, 2, 4))
    cluster = Cluster.model_validate({
        "kind": "cluster",
        "devices": [{"name": f"{h}{k}", "memory_bytes": "1GiB", "host": h}
                    for k, h in enumerate("aabb")],
        "links": {"intra_host": {"bandwidth_bytes_per_s": 1e5, "latency_ms": 5.0},
                  "inter_host": {"bandwidth_bytes_per_s": 1e9}},
    })  # fmt: skip
    orders, complete = cluster.placements()
    # a's two alike, b's two alike: 4! / (2! 2!) = 6 orders, and aabb is bbaa with the hosts'
    # names swapped (so are abab and baba, abba and baab): 3 problems
    assert complete and len(orders) == 3
    plan = plan_pipeline(profile, cluster, 4, allow_reorder=True)
    every = [  # brute force: all 24 orders
        plan_pipeline(profile, cluster.reordered(list(p)), 4).predicted.iteration_ms
        for p in itertools.permutations(range(4))
    ]
    assert plan.predicted.iteration_ms == min(every) < every[0] and plan.solver.optimal
    hosts = [d.host for d in plan.cluster.devices]
    assert hosts[0] != hosts[1] != hosts[2] != hosts[3]
    # past the most it lists, the orders keeping hosts together only, and not proven
    big = host_cluster(["a", "b"] * 4)  # 8 devices, 4 per host: 70 orders, 35 problems
    assert len(big.placements()[0]) == 35 and big.placements()[1]
    orders, complete = big.placements(limit=30)
    assert not complete and orders[0] == list(range(8))  # the order given, hosts alternating
    assert len(orders) == len({tuple(o) for o in orders})


def test_orders_alike_but_for_the_hosts_names_are_planned_once():
    """Alike devices on two hosts: an order and the one with the hosts' names swapped have the
    same devices and the same links position by position, so the same plan; only one of each
    pair is planned (70 orders of 8 devices, 35 problems). Devices that differ keep every
    order: a host's larger device makes aabb and bbaa two problems."""
    big = host_cluster(["a", "b"] * 4)
    orders, complete = big.placements()
    hosts = [[big.devices[k].host for k in o] for o in orders]
    flips = {tuple(x == y for x, y in itertools.pairwise(h)) for h in hosts}
    assert complete and len(orders) == len(flips) == 35 and orders[0] == list(range(8))
    swapped = {tuple("b" if x == "a" else "a" for x in h) for h in hosts}
    assert not swapped & {tuple(h) for h in hosts}  # (of each pair, one)
    assert len(swapped | {tuple(h) for h in hosts}) == 70  # (and together, every order)
    mixed = host_cluster(["a", "a", "b", "b"])
    mixed.devices[0].memory_bytes = 2 << 30
    orders, complete = mixed.placements()
    assert complete and len(orders) == 12  # a's devices differ: 4! / 2!


def test_more_memory_can_give_a_slower_plan_so_no_order_is_skipped_for_it():
    """Found by the red team, against a shortcut tried and dropped: skipping the orders left
    once a plan is as fast as the plan for every device at the most memory. The split is the
    least bottleneck, not the least step time: with every device large, the bottleneck's split
    fills the pipe through a slow cut, and an order that keeps the small device first is
    faster (27.5 ms against 35.5)."""
    profile = synthetic_profile([1.0, 0.5, 1.0, 2.0, 1.0, 1.0],
                                output_bytes=[100, 100, 500, 100, 100, 2000], sizes=(1, 2, 4))  # fmt: skip
    cluster = Cluster(
        devices=[Device(name=n, memory_bytes=m) for n, m in
                 (("d0", 10**6), ("d1", 10**6), ("d2", 1668))],
        links=[Link(bandwidth_bytes_per_s=1e5, latency_ms=1.0)] * 2,
    )  # fmt: skip
    kw = {"schedule": "gpipe", "recompute": "never", "checkpoint": ()}
    plan = plan_pipeline(profile, cluster, 1, allow_reorder=True, **kw)
    every = [
        plan_pipeline(profile, cluster.reordered(list(p)), 1, **kw).predicted.iteration_ms
        for p in itertools.permutations(range(3))
    ]
    large = Cluster(devices=[Device(name=f"d{k}", memory_bytes=10**6) for k in range(3)],
                    links=cluster.links)  # fmt: skip
    assert plan_pipeline(profile, large, 1, **kw).predicted.iteration_ms == 35.5
    assert plan.predicted.iteration_ms == min(every) == 27.5


def test_the_device_orders_searched_show_one_bar(monkeypatch):
    """Found by a red team: `--allow-reorder` on 8 devices of two hosts took 140 s without a
    word on the terminal (each order's search was under the second a bar waits for). A bar now
    counts the orders, and each order's own search shows none."""
    import contextlib

    import planner.search as search

    bars: list[tuple[str, int, bool, list[int]]] = []

    @contextlib.contextmanager
    def recorded(total, show, desc="planning"):
        ticks: list[int] = []
        bars.append((desc, total, show, ticks))
        yield lambda: ticks.append(1)

    monkeypatch.setattr(search, "_progress_bar", recorded)
    profile = synthetic_profile([4.0, 4.0, 1.0], sizes=(1, 2, 4))
    cluster = Cluster(devices=[Device(name="slow", memory_bytes=10**9, speed=0.25),
                               Device(name="fast0", memory_bytes=10**9),
                               Device(name="fast1", memory_bytes=10**9)])  # fmt: skip
    plan = plan_pipeline(profile, cluster, 4, allow_reorder=True, progress=True,
                         microbatches=4, schedule="1f1b", recompute="never")  # fmt: skip
    orders = [b for b in bars if b[0] == "device orders"]
    assert len(orders) == 1 and orders[0][2]
    tried = int(plan.solver.method.split(", ")[1].split()[0])
    assert orders[0][1] == len(cluster.placements()[0]) and len(orders[0][3]) == tried > 1
    assert not any(shown for desc, _, shown, _ in bars if desc != "device orders")


def test_the_device_orders_read_the_profile_once(monkeypatch):
    """Every order's search reads the same per-layer costs and memory tables (they depend on
    the profile, not on the devices' order): the profile is digested and read into its table
    once for all of them, and the memory tables found for one order serve the next. The plan
    is the one each order planned alone gives at best."""
    import planner.search as search
    from profiler.types import Profile

    calls = {"digest": 0, "table": 0}
    digest, table, memory = Profile.digest, search.ProfileTable, search.MemoryModel
    made: list[int] = []  # the micro-batch size of each MemoryModel made

    def model(chain):
        made.append(chain.mb)
        return memory(chain)

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    monkeypatch.setattr(Profile, "digest", counted("digest", digest))
    monkeypatch.setattr(search, "ProfileTable", counted("table", table))
    monkeypatch.setattr(search, "MemoryModel", model)
    profile = synthetic_profile([1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 2.0, 1.0],
                                output_bytes=[4000] * 8, sizes=(1, 2, 4))  # fmt: skip
    cluster = host_cluster(["a", "b", "a", "b"])
    plan = plan_pipeline(profile, cluster, 4, allow_reorder=True, checkpoint=())
    assert "3 device orders" in plan.solver.method and calls == {"digest": 1, "table": 1}
    assert len(made) == len(set(made)) > 1  # each size's memory tables made once, for all
    alone = [
        plan_pipeline(profile, cluster.reordered(o), 4, checkpoint=()).predicted.iteration_ms
        for o in cluster.placements()[0]
    ]
    assert plan.predicted.iteration_ms == min(alone)
