"""The queue's policy (issue 71) as pure functions over a cluster's state and its jobs: which waiting
jobs to start, in what order, and which running jobs to stop so that a team gets its share back.
No clock, no I/O: the gateway calls them with what it knows; the simulator (gateway/simulate.py)
and the unit tests call them with traces.

- A team has a nominal share (GPUs and CPUs, set by an admin). It may hold more by borrowing what
  the others leave idle; what it holds beyond its share is borrowed (its most recently started jobs).
- Order among waiting jobs: the team furthest below its share first, by its usage, which decays with
  a half-life (Slurm's fair-share factor, in short), then the job's place (its submission).
- Starting: in that order, every job that fits what is free and its team's share; then, in that
  order, every job that fits what is still free, borrowing. A job that fits is never held back
  (what it borrows can be taken back).
- Taking back, for a waiting job in order that does not fit, only where enough can be freed for it,
  the most recently started job first:
  1. a job its team's share has room for stops borrowed jobs of other teams at once;
  2. a job of a team further below its share than another (by usage, beyond `margin`) stops that
     team's borrowed jobs that have run `min_run` seconds;
  3. a job that has waited `reserve_after` seconds is reserved for: every job started since then
     (but one that was reserved for itself) may be stopped for it, so it waits at most for the jobs
     that were running when its wait crossed `reserve_after` (nothing waits forever, even a job as
     wide as the cluster).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Res:
    gpus: int = 0
    cpus: int = 0

    def __add__(self, o: Res) -> Res:
        return Res(self.gpus + o.gpus, self.cpus + o.cpus)

    def __sub__(self, o: Res) -> Res:
        return Res(self.gpus - o.gpus, self.cpus - o.cpus)

    def fits_in(self, o: Res) -> bool:
        return self.gpus <= o.gpus and self.cpus <= o.cpus

    def weight(self, total: Res) -> float:
        """This much of `total`, as one number: the larger of its GPU and CPU fractions (a job
        that takes every GPU takes the cluster, whatever its CPUs)."""
        return max(
            self.gpus / total.gpus if total.gpus else 0.0, self.cpus / total.cpus if total.cpus else 0.0
        )


@dataclass(frozen=True)
class Job:
    id: str
    team: str
    demand: Res
    submitted: float  # its place in the queue: kept when it is stopped and queued again
    queued: float = -1.0  # when it last entered the queue (its submission, or its last stop)

    @property
    def since(self) -> float:
        return self.submitted if self.queued < 0 else self.queued


@dataclass(frozen=True)
class Running:
    job: Job
    started: float


@dataclass(frozen=True)
class Policy:
    half_life: float = 7 * 86400.0  # seconds for a team's usage to count half
    min_run: float = 3600.0  # seconds a borrowed job runs before a team not within its share may stop it
    margin: float = 0.1  # how much further over its share a team must be to lose a borrowed job to another
    reserve_after: float = 86400.0  # seconds of waiting after which the cluster is cleared for a job


@dataclass
class State:
    """What the policy needs to know: the cluster's size, the teams' shares, what runs, what waits,
    and each team's decayed usage (share-weighted seconds) as of `now`."""

    capacity: Res
    shares: dict[str, Res]
    running: list[Running] = field(default_factory=list)
    waiting: list[Job] = field(default_factory=list)
    usage: dict[str, float] = field(default_factory=dict)
    now: float = 0.0

    def used(self, team: str | None = None) -> Res:
        total = Res()
        for r in self.running:
            if team is None or r.job.team == team:
                total = total + r.job.demand
        return total

    def free(self) -> Res:
        return self.capacity - self.used()


def decayed(state: State, now: float, half_life: float) -> dict[str, float]:
    """Each team's usage at `now`: what it was at `state.now`, halved every `half_life` seconds, plus
    what its running jobs held in between (their weight of the cluster x seconds, decayed alike)."""
    dt = max(0.0, now - state.now)
    k = 0.5 ** (dt / half_life)
    out = {team: u * k for team, u in state.usage.items()}
    # a job held its weight over [state.now, now]: its decayed integral is w * (1 - k) * half_life / ln 2
    grown = (1 - k) * half_life / math.log(2)
    for r in state.running:
        out[r.job.team] = out.get(r.job.team, 0.0) + r.job.demand.weight(state.capacity) * grown
    return out


def priority(state: State, team: str) -> float:
    """A team's place: its usage over its share (lower: further below its share, first)."""
    share = state.shares.get(team, Res()).weight(state.capacity)
    return state.usage.get(team, 0.0) / share if share else math.inf


def order(state: State) -> list[Job]:
    return sorted(state.waiting, key=lambda j: (priority(state, j.team), j.submitted, j.id))


def never_fits(state: State, demand: Res) -> bool:
    return not demand.fits_in(state.capacity)


def borrowed(state: State) -> list[Running]:
    """The running jobs beyond their team's share (per team, the most recently started are the
    borrowed ones), the most recently started first."""
    out: list[Running] = []
    for team in {r.job.team for r in state.running}:
        share = state.shares.get(team, Res())
        mine = sorted((r for r in state.running if r.job.team == team), key=lambda r: (r.started, r.job.id))
        held = Res()
        for r in mine:
            held = held + r.job.demand
            if not held.fits_in(share):
                out.append(r)
    return sorted(out, key=lambda r: (-r.started, r.job.id))


def reserved(state: State, policy: Policy) -> Job | None:
    """The job the cluster is cleared for: the first in order that does not fit what is free and has
    waited `reserve_after` seconds."""
    free = state.free()
    for job in order(state):
        if not job.demand.fits_in(free) and state.now - job.since >= policy.reserve_after:
            return job
    return None


def was_reserved(r: Running, policy: Policy) -> bool:
    """Whether a running job started as a reserved one (no other reservation may stop it)."""
    return r.started - r.job.since >= policy.reserve_after


def plan(state: State, policy: Policy) -> tuple[list[Job], list[Running]]:
    """The jobs to start and the running jobs to stop now (see the module's rules): first, in order,
    each job that fits what is free and its team's share; then, in order, each job that does not fit
    and for which the rules free enough; then, in order, each that fits what is still free, borrowing."""
    free = state.free()
    held = {team: state.used(team) for team in state.shares}
    start: list[Job] = []
    stop: list[Running] = []

    def take(job: Job) -> None:
        nonlocal free
        start.append(job)
        free = free - job.demand
        held[job.team] = held.get(job.team, Res()) + job.demand

    def within(job: Job) -> bool:
        return (held.get(job.team, Res()) + job.demand).fits_in(state.shares.get(job.team, Res()))

    for job in order(state):
        if job.demand.fits_in(free) and within(job):
            take(job)
    hold = reserved(state, policy)
    lenders = borrowed(state)
    newest = sorted(state.running, key=lambda r: (-r.started, r.job.id))
    for job in order(state):
        if job in start or job.demand.fits_in(free):
            continue
        if job == hold:
            cleared = job.since + policy.reserve_after
            candidates = [
                r
                for r in newest
                if not was_reserved(r, policy)
                and (r.started >= cleared or (r in lenders and r.job.team != job.team))
            ]
        else:
            mine, mine_within = priority(state, job.team), within(job)
            candidates = [
                r
                for r in lenders
                if r.job.team != job.team
                and (
                    mine_within
                    or (
                        priority(state, r.job.team) > mine * (1 + policy.margin)
                        and state.now - r.started >= policy.min_run
                    )
                )
            ]
        taken, gained = [], free
        for r in candidates:
            if r in stop:
                continue
            taken.append(r)
            gained = gained + r.job.demand
            if job.demand.fits_in(gained):
                break
        if job.demand.fits_in(gained):
            stop += taken
            free = gained
            take(job)
    for job in order(state):
        if job not in start and job.demand.fits_in(free):
            take(job)
    return start, stop


def step(state: State, policy: Policy, now: float) -> tuple[State, list[Job], list[Running]]:
    """The policy's one pass at `now`: usage brought up to date, the running jobs to stop, then the
    jobs to start in what is free once they stopped. A new state (the input is not changed)."""
    usage = decayed(state, now, policy.half_life)
    s = replace(state, usage=usage, now=now, running=list(state.running), waiting=list(state.waiting))
    started, stopped = plan(s, policy)
    s.running = [r for r in s.running if r not in stopped] + [Running(j, now) for j in started]
    s.waiting = [j for j in s.waiting if j not in started] + [replace(r.job, queued=now) for r in stopped]
    return s, started, stopped
