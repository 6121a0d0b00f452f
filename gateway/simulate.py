"""A deterministic simulator of the queue's policy (gateway/fairshare.py) over a trace of jobs, with
plain FIFO over the same trace beside it.

Time moves from event to event (a submission, a job's end) and on a fixed tick, when the policy
runs. A job needs `work` seconds of running; a stopped job keeps what it had reached at its last
checkpoint (every `checkpoint` seconds of its running), goes back to the queue at its place and
resumes from there when started again. Nothing is random unless the trace is (make_trace takes a
seed). `restart_at` writes the policy's state out as JSON at that time and reads it back, as a
gateway's restart would: the outcome must not change.

    python -m gateway.simulate            # a month of a 4-team, 8-GPU cluster: fair share and FIFO
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gateway.fairshare import Job, Policy, Res, Running, State, never_fits, step

DEFAULT = Policy()


@dataclass(frozen=True)
class Work:
    job: Job
    work: float  # seconds of running it needs
    checkpoint: float  # seconds of running between two checkpoints


@dataclass
class Outcome:
    started: dict[str, float] = field(default_factory=dict)  # first start
    ended: dict[str, float] = field(default_factory=dict)
    stopped: dict[str, int] = field(default_factory=dict)  # times each job was stopped
    held: list[tuple[float, float, str, int]] = field(default_factory=list)  # (from, to, team, GPUs) running
    waited: list[tuple[float, float, str, int]] = field(default_factory=list)  # (from, to, team, GPUs) queued
    lost: float = 0.0  # GPU-seconds of work lost to stops (run since the last checkpoint)

    def waits(self, trace: list[Work]) -> list[float]:
        """Each job's wait from its submission to its first start."""
        return [self.started[w.job.id] - w.job.submitted for w in trace]


def fifo(state: State) -> list[Job]:
    """Plain FIFO: in submission order while the first waiting job fits; no shares, no stops."""
    free, chosen = state.free(), []
    for job in sorted(state.waiting, key=lambda j: (j.submitted, j.id)):
        if not job.demand.fits_in(free):
            break
        chosen.append(job)
        free = free - job.demand
    return chosen


def dump(state: State, progress: dict[str, float], since: dict[str, float]) -> str:
    return json.dumps({"state": asdict(state), "progress": progress, "since": since}, sort_keys=True)


def load(text: str) -> tuple[State, dict[str, float], dict[str, float]]:
    d = json.loads(text)
    s = d["state"]

    def job(j: dict[str, Any]) -> Job:
        return Job(j["id"], j["team"], Res(**j["demand"]), j["submitted"], j["queued"])

    state = State(
        Res(**s["capacity"]),
        {t: Res(**r) for t, r in s["shares"].items()},
        [Running(job(r["job"]), r["started"]) for r in s["running"]],
        [job(j) for j in s["waiting"]],
        s["usage"],
        s["now"],
    )
    return state, d["progress"], d["since"]


def simulate(
    trace: list[Work],
    capacity: Res,
    shares: dict[str, Res],
    fair: bool = True,
    policy: Policy = DEFAULT,
    tick: float = 60.0,
    restart_at: float | None = None,
    observe: Callable[[State], None] | None = None,
) -> Outcome:
    by_id = {w.job.id: w for w in trace}
    wide = [w.job.id for w in trace if never_fits(State(capacity, shares), w.job.demand)]
    if wide:
        raise ValueError(
            f"{', '.join(wide)} can never fit the cluster's {capacity}: "
            "the gateway refuses them at submission"
        )
    arrivals = sorted(trace, key=lambda w: (w.job.submitted, w.job.id))
    state = State(capacity, shares)
    progress = {w.job.id: 0.0 for w in trace}  # seconds of running reached (at its checkpoint, once stopped)
    since: dict[str, float] = {}  # a running job's start (this stint)
    queued: dict[str, float] = {}  # a waiting job's entry into the queue (this stint)
    out = Outcome()
    now, i = 0.0, 0
    restarted = restart_at is None
    while i < len(arrivals) or state.waiting or state.running:
        ends = [since[r.job.id] + by_id[r.job.id].work - progress[r.job.id] for r in state.running]
        now = max(now, min([now + tick] + ([arrivals[i].job.submitted] if i < len(arrivals) else []) + ends))
        if not restarted and restart_at is not None and now >= restart_at:  # the gateway restarts
            state, progress, since = load(dump(state, progress, since))
            restarted = True
        for r in [
            r for r in state.running if since[r.job.id] + by_id[r.job.id].work - progress[r.job.id] <= now
        ]:
            out.ended[r.job.id] = now
            out.held.append((since.pop(r.job.id), now, r.job.team, r.job.demand.gpus))
            state.running.remove(r)
        while i < len(arrivals) and arrivals[i].job.submitted <= now:
            state.waiting.append(arrivals[i].job)
            queued[arrivals[i].job.id] = arrivals[i].job.submitted
            i += 1
        if fair:
            state, started, stopped = step(state, policy, now)
        else:
            started, stopped = fifo(state), []
            state.waiting = [j for j in state.waiting if j not in started]
            state.running = state.running + [Running(j, now) for j in started]
            state.now = now
        if observe:
            observe(state)
        for r in stopped:
            w = by_id[r.job.id]
            began = since.pop(r.job.id)
            ran = progress[r.job.id] + now - began
            progress[r.job.id] = (ran // w.checkpoint) * w.checkpoint  # back to its last checkpoint
            out.lost += (ran - progress[r.job.id]) * r.job.demand.gpus
            out.stopped[r.job.id] = out.stopped.get(r.job.id, 0) + 1
            out.held.append((began, now, r.job.team, r.job.demand.gpus))
            queued[r.job.id] = now
        for j in started:
            since[j.id] = now
            out.started.setdefault(j.id, now)
            out.waited.append((queued.pop(j.id), now, j.team, j.demand.gpus))
    return out


def make_trace(
    teams: dict[str, float], days: float, gpus: int, seed: int = 1, load: float = 0.9, widest: int = 8
) -> list[Work]:
    """Jobs of each team arriving at random (Poisson), `teams` giving each one's part of the demand;
    1, 2, 4 or 8 GPUs (no more than the cluster has, nor `widest`), an hour to two days long,
    checkpointing every 30 minutes; in all about `load` times what the cluster's GPUs can serve in
    `days`."""
    rng = random.Random(seed)
    trace: list[Work] = []
    horizon = days * 86400
    for team, part in sorted(teams.items()):
        t, n = 0.0, 0
        while True:
            width = rng.choice([w for w in (1, 1, 2, 2, 4, 8) if w <= min(gpus, widest)])
            work = rng.choice([1, 2, 4, 8, 12, 24, 48]) * 3600.0
            t += rng.expovariate(1.0) * (width * work) / (load * part * gpus)
            if t > horizon:
                break
            trace.append(
                Work(Job(f"{team}-{n}", team, Res(gpus=width, cpus=4 * width), round(t)), work, 1800.0)
            )
            n += 1
    return sorted(trace, key=lambda w: (w.job.submitted, w.job.id))


def water_fill(asked: dict[str, float], weights: dict[str, float], total: float) -> dict[str, float]:
    """Max-min fair shares of `total` among teams by weight, none given more than it asks."""
    alloc = {t: 0.0 for t in asked}
    left, active = total, {t for t, d in asked.items() if d > 0}
    while left > 1e-9 and active:
        w = sum(weights[t] for t in active)
        give = {t: left * weights[t] / w for t in active}
        done = {t for t in active if alloc[t] + give[t] >= asked[t]}
        if not done:
            for t in active:
                alloc[t] += give[t]
            break
        for t in done:
            left -= asked[t] - alloc[t]
            alloc[t] = asked[t]
        active -= done
    return alloc


def fairness(
    out: Outcome, shares: dict[str, Res], gpus: int, horizon: float, step_s: float = 600.0
) -> dict[str, float]:
    """Per team, its part of the GPU-hours used over [0, horizon] against its part of those due: at each
    moment the cluster's GPUs shared out by the teams' shares among the teams with work (running or
    queued), none given more than it asked, what one leaves going to the others (max-min fairness,
    what a share promises). 1.0: it got exactly its due."""
    got = {t: 0.0 for t in shares}
    due = {t: 0.0 for t in shares}
    t = 0.0
    while t < horizon:
        held = {team: 0.0 for team in shares}
        for a, b, team, g in out.held:
            if a <= t < b:
                held[team] += g
        asked = dict(held)
        for a, b, team, g in out.waited:
            if a <= t < b:
                asked[team] += g
        fair = water_fill(asked, {team: s.gpus for team, s in shares.items()}, gpus)
        for team in shares:
            got[team] += held[team]
            due[team] += fair[team]
        t += step_s
    all_got, all_due = sum(got.values()) or 1.0, sum(due.values()) or 1.0
    return {team: (got[team] / all_got) / (due[team] / all_due) if due[team] else 1.0 for team in shares}


def utilisation(out: Outcome, gpus: int, horizon: float) -> float:
    """The part of the cluster's GPU-seconds used over [0, horizon] (the trace's month)."""
    return sum(max(0.0, min(b, horizon) - a) * g for a, b, _, g in out.held) / (gpus * horizon)


def report(
    trace: list[Work], capacity: Res, shares: dict[str, Res], horizon: float, policy: Policy = DEFAULT
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name in ("fifo", "fair"):
        out = simulate(trace, capacity, shares, fair=name == "fair", policy=policy)
        waits = sorted(out.waits(trace))
        results[name] = {
            "fairness": fairness(out, shares, capacity.gpus, horizon),
            "wait_median_h": statistics.median(waits) / 3600,
            "wait_p95_h": waits[int(0.95 * (len(waits) - 1))] / 3600,
            "wait_max_h": waits[-1] / 3600,
            "utilisation": utilisation(out, capacity.gpus, horizon),
            "stops": sum(out.stopped.values()),
            "lost_gpu_h": out.lost / 3600,
        }
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m gateway.simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--days", type=float, default=30)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--widest", type=int, default=8, help="the most GPUs one job asks for")
    p.add_argument("--load", type=float, default=0.9, help="the demand, as a part of what the GPUs can serve")
    config = Path(os.environ.get("DLC_CONFIG", "~/.config/dlcluster")).expanduser()
    p.add_argument("--out", type=Path, default=config / "bench", help="for fairshare.json and .png")
    a = p.parse_args(argv)
    teams = {"vision": 0.4, "nlp": 0.3, "speech": 0.2, "rl": 0.1}  # each one's part of the demand
    shares = {t: Res(gpus=a.gpus // len(teams), cpus=8 * a.gpus // len(teams)) for t in teams}
    capacity = Res(gpus=a.gpus, cpus=8 * a.gpus)
    trace = make_trace(teams, a.days, a.gpus, a.seed, a.load, a.widest)
    print(
        f"{len(trace)} jobs of {len(teams)} teams over {a.days:g} days on {a.gpus} GPUs "
        f"(equal shares of {a.gpus // len(teams)} GPUs)"
    )
    results = report(trace, capacity, shares, a.days * 86400)
    print(
        f"\n{'':<6}"
        + "".join(f"{t:>9}" for t in teams)
        + f"{'median wait':>13}{'p95 wait':>10}{'longest':>9}{'util':>7}{'stops':>7}{'lost':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<6}"
            + "".join(f"{r['fairness'][t]:>9.0%}" for t in teams)
            + f"{r['wait_median_h']:>12.1f}h{r['wait_p95_h']:>9.1f}h{r['wait_max_h']:>8.0f}h"
            + f"{r['utilisation']:>7.1%}{r['stops']:>7}{r['lost_gpu_h']:>7.0f}h"
        )
    worst = max(abs(f - 1) for f in results["fair"]["fairness"].values())
    print(
        f"\n(each team: its part of the GPU-hours used against its part of those its share entitled it to)\n"
        f"fair share: the farthest team {worst:.0%} off its due (goal 10%); "
        f"utilisation {results['fair']['utilisation'] / results['fifo']['utilisation']:.1%} "
        "of FIFO's (goal 95%)"
    )
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "fairshare.json").write_text(json.dumps(results, indent=2) + "\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        for k, name in enumerate(results):
            ax.bar(
                [x + 0.4 * k - 0.2 for x in range(len(teams))],
                [results[name]["fairness"][t] for t in teams],
                0.4,
                label=name,
            )
        ax.axhspan(0.9, 1.1, color="green", alpha=0.15, label="within 10% of its due")
        ax.set_xticks(range(len(teams)), list(teams))
        ax.set_ylabel("GPU-hours got / due by its share")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.out / "fairshare.png", dpi=110)
        print(f"wrote {a.out / 'fairshare.json'} and {a.out / 'fairshare.png'}")


if __name__ == "__main__":
    main()
