"""The queue's policy (gateway/fairshare.py) alone: pure functions over a cluster's state, and the
deterministic simulator (gateway/simulate.py) driving them over traces."""

from __future__ import annotations

from dataclasses import replace

from gateway.fairshare import Job, Policy, Res, Running, State, borrowed, decayed, never_fits, plan, step
from gateway.simulate import Work, fifo, make_trace, simulate

HOUR = 3600.0
CAP = Res(gpus=4, cpus=32)
SHARES = {"a": Res(gpus=2, cpus=16), "b": Res(gpus=2, cpus=16)}


def job(id: str, team: str, gpus: int, at: float = 0.0) -> Job:
    return Job(id, team, Res(gpus=gpus, cpus=4 * gpus), at)


def work(id: str, team: str, gpus: int, at: float, hours: float, checkpoint: float = 0.5 * HOUR) -> Work:
    return Work(job(id, team, gpus, at), hours * HOUR, checkpoint)


def test_a_team_under_its_share_starts_before_one_over_it():
    # room for one of two jobs, each borrowing; a's came first, but a has used more of its share than b
    state = State(
        CAP,
        SHARES,
        running=[Running(job("a0", "a", 1), 0.0), Running(job("b0", "b", 1), 0.0)],
        waiting=[job("a1", "a", 2, 0.0), job("b1", "b", 2, 10.0)],
        usage={"a": 50.0, "b": 5.0},
        now=20.0,
    )
    start, stop = plan(state, Policy())
    assert [j.id for j in start] == ["b1"] and stop == []
    # with the usage the other way round, a's goes first
    start, _ = plan(replace(state, usage={"a": 5.0, "b": 50.0}), Policy())
    assert [j.id for j in start] == ["a1"]


def test_a_teams_usage_halves_every_half_life_and_grows_with_what_it_holds():
    idle = State(CAP, SHARES, usage={"a": 8.0}, now=0.0)
    assert decayed(idle, 2 * HOUR, half_life=HOUR) == {"a": 2.0}
    busy = State(CAP, SHARES, running=[Running(job("a1", "a", 4), 0.0)], now=0.0)
    # the whole cluster for a long time: its usage tends to the cluster x half-life / ln 2
    assert 0.99 * HOUR / 0.6931 < decayed(busy, 100 * HOUR, half_life=HOUR)["a"] < HOUR / 0.6931


def test_a_job_that_fits_what_is_free_is_never_held_back():
    """Over a month's trace, after every pass of the policy no waiting job fits what is free (one
    within its team's share or borrowing: what it borrows can be taken back)."""
    trace = make_trace({"a": 0.5, "b": 0.3, "c": 0.2}, days=6, gpus=8, seed=3, load=1.0)
    held_back: list[str] = []

    def look(s: State) -> None:
        held_back.extend(f"{j.id} at {s.now:.0f}" for j in s.waiting if j.demand.fits_in(s.free()))

    shares = {t: Res(gpus=2, cpus=16) for t in ("a", "b", "c")}
    simulate(trace, Res(gpus=8, cpus=64), shares, observe=look)
    assert held_back == []
    # FIFO, by contrast, holds back what fits behind a job that does not
    fifo_held: list[str] = []
    state = State(
        Res(gpus=4, cpus=32),
        SHARES,
        running=[Running(job("x", "a", 2), 0.0)],
        waiting=[job("wide", "a", 4, 1.0), job("narrow", "b", 1, 2.0)],
    )
    fifo_held = [j.id for j in state.waiting if j not in fifo(state) and j.demand.fits_in(state.free())]
    assert fifo_held == ["narrow"]


def test_borrowed_capacity_goes_back_to_its_owner_within_one_checkpoint_interval():
    # a borrows the whole cluster with four one-GPU jobs; b submits two GPUs of its share
    trace = [work(f"a{i}", "a", 1, at=i * 60.0, hours=10) for i in range(4)] + [
        work("b1", "b", 2, at=3 * HOUR, hours=1)
    ]
    out = simulate(trace, CAP, SHARES)
    assert out.started["b1"] - 3 * HOUR <= 0.5 * HOUR  # within one checkpoint interval (one tick, in fact)
    # the two most recently started of a's were stopped, once each; all of a's finished from their
    # checkpoints: what they lost is at most one checkpoint interval each
    assert out.stopped == {"a3": 1, "a2": 1}
    assert set(out.ended) == {"a0", "a1", "a2", "a3", "b1"}
    assert 0 < out.lost <= 2 * 0.5 * HOUR
    # nothing is stopped for a job that would not start: b asks for more than a's borrowed jobs free
    state = State(
        CAP,
        SHARES,
        running=[Running(job(f"a{i}", "a", 1), 0.0) for i in range(3)] + [Running(job("b0", "b", 1), 0.0)],
        waiting=[job("b2", "b", 3, 1.0)],
        now=HOUR,
    )
    assert [r.job.id for r in borrowed(state)] == ["a2"]
    assert plan(state, Policy()) == ([], [])


def test_nothing_waits_forever_even_a_job_as_wide_as_the_cluster():
    """A team keeps its share busy with a stream of jobs and borrows the rest; another asks for the
    whole cluster: once it has waited reserve_after, what starts is stopped for it, so it waits at
    most that plus the longest job already running."""
    stream = [work(f"a{i}", "a", 1, at=i * HOUR, hours=4) for i in range(24 * 6)]
    wide = work("b-wide", "b", 4, at=2 * HOUR, hours=2)
    policy = Policy(reserve_after=6 * HOUR)
    out = simulate(stream + [wide], CAP, SHARES, policy=policy)
    assert set(out.ended) == {w.job.id for w in stream + [wide]}
    assert out.started["b-wide"] - wide.job.submitted <= policy.reserve_after + 4 * HOUR + 60
    # without the reservation it would wait for the stream to end
    late = simulate(stream + [wide], CAP, SHARES, policy=Policy(reserve_after=1e9))
    assert late.started["b-wide"] > 24 * 6 * HOUR - 24 * HOUR


def test_every_job_of_a_months_trace_ends():
    trace = make_trace(
        {"vision": 0.4, "nlp": 0.3, "speech": 0.2, "rl": 0.1}, days=10, gpus=8, seed=7, load=1.1
    )
    out = simulate(
        trace, Res(gpus=8, cpus=64), {t: Res(gpus=2, cpus=16) for t in ("vision", "nlp", "speech", "rl")}
    )
    assert set(out.ended) == {w.job.id for w in trace}
    assert any(w.job.demand.gpus == 8 for w in trace)  # jobs as wide as the cluster among them


def test_a_restart_in_the_middle_of_a_trace_changes_no_outcome():
    trace = make_trace({"a": 0.6, "b": 0.4}, days=4, gpus=4, seed=5, load=1.2)
    whole = simulate(trace, CAP, SHARES)
    assert sum(whole.stopped.values()) > 0  # stops and requeues happened around the restart's time
    for at in (1.5 * 86400, 2 * 86400 + 17):
        assert simulate(trace, CAP, SHARES, restart_at=at) == whole


def test_a_job_that_can_never_fit_is_named_as_such():
    state = State(CAP, SHARES)
    assert never_fits(state, Res(gpus=5)) and never_fits(state, Res(cpus=33)) and not never_fits(state, CAP)


def test_a_pass_of_the_policy_changes_nothing_it_is_given():
    state = State(
        CAP, SHARES, running=[Running(job("a1", "a", 4), 0.0)], waiting=[job("b1", "b", 2, 1.0)], now=1.0
    )
    before = repr(state)
    new, started, stopped = step(state, Policy(), now=2.0)
    assert repr(state) == before
    assert [j.id for j in started] == ["b1"] and [r.job.id for r in stopped] == ["a1"]
    assert (
        [j.id for j in new.waiting] == ["a1"]
        and new.waiting[0].queued == 2.0
        and new.waiting[0].submitted == 0.0
    )
