"""The smoke steps, one test each, in the order they run (`--only` selects among them; the report
plugin keeps this order): nodes, allreduce, perf, trainers, proxyjump. Each fills `details`, which the
report keeps; a failure's message is the step's error (pytest.fail), a skip's its reason."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dlcluster import baseline, doctor, plots
from dlcluster.smoke.lib import (
    REPO,
    Context,
    check_node_proxyjump,
    fail,
    job_error,
    job_payload,
    log,
    node_problems,
    perf_skip_reason,
    proxyjump_skip_reason,
    trainer_args,
)


def test_nodes(ctx: Context, details: dict):
    """Every node joined with the CPUs and GPUs the cluster record lists, its dashboard agent
    registered, and a task pinned to it runs."""
    payload, run = job_payload(ctx, details, "nodes", ["python", "ray/smoke_checks.py", "nodes"],
                               "the nodes job")
    expected = ctx.rec.nodes
    problems = node_problems(payload, expected)
    nodes = payload["nodes"]
    details.update({
        "expected": len(expected), "alive": len(nodes), "dead": payload.get("dead", 0),
        "agents": sum(1 for n in nodes if n.get("agent")),
        "cpus": sorted(n["cpus"] for n in nodes), "gpus": sorted(n["gpus"] for n in nodes),
        "nodes": nodes, "driver": payload.get("driver"), "job": run.summary(),
    })
    if problems:
        fail(details, "; ".join(problems), problems=problems)


def test_allreduce(ctx: Context, details: dict):
    """Ray Train's TorchTrainer, one worker per node: all-reduce of each size, every element
    checked, nccl-tests' time, algbw and busbw."""
    ctx.need_workers()
    ctx.results["allreduce"] = details
    argv = ["python", "ray/smoke_checks.py", "allreduce", "--num-workers", str(ctx.workers),
            "--sizes", ",".join(map(str, ctx.args.sizes_bytes)),
            "--name", f"smoke-allreduce-{ctx.stamp}"]
    if ctx.use_gpu:
        argv.append("--use-gpu")
    if ctx.args.storage_path:
        argv += ["--storage-path", ctx.args.storage_path]
    payload, run = job_payload(ctx, details, "allreduce", argv, "the allreduce job")
    if "error" in payload:
        fail(details, payload["error"], job=run.summary())
    rows = payload["rows"]
    details.update({"backend": payload["backend"], "world_size": payload["world_size"],
                    "nodes_used": payload["nodes_used"], "placement_strategy": payload["placement_strategy"],
                    "rows": rows, "ranks": payload["ranks"], "fit_s": payload.get("fit_s"),
                    "left_out": ctx.left_out, "job": run.summary()})
    problems = []
    if payload["world_size"] != ctx.workers or payload["nodes_used"] != ctx.workers:
        problems.append(f"{payload['world_size']} ranks on {payload['nodes_used']} node(s), "
                        f"expected one on each of {ctx.workers}")
    wrong = sum(r["wrong"] for r in rows)
    if wrong:
        problems.append(f"{wrong} wrong element(s): " + ", ".join(
            f"{r['bytes']} B: {r['wrong']}" for r in rows if r["wrong"]))
    if [r["bytes"] for r in rows] != ctx.args.sizes_bytes:
        problems.append("the job measured other sizes than asked")
    if problems:
        fail(details, "; ".join(problems), problems=problems)


def test_perf(ctx: Context, details: dict):
    """Against the cluster's baseline (or recorded as it, --record-baseline): each node's step time
    of a fixed batch and its shared storage's throughput, each link's bandwidth (iperf3 through the
    bastion), the allreduce step's bus bandwidth against the link peak. One line per figure worse
    than its threshold; a table, and a plot beside the report."""
    a = ctx.args
    reason = perf_skip_reason(ctx.rec, a.record_baseline)
    if reason:
        pytest.skip(reason)
    rec, th = ctx.rec, a.thresholds
    if a.record_baseline and "allreduce" not in ctx.results:
        fail(details, "a baseline needs the allreduce step: leave --only out, or list allreduce in it")
    ref = baseline.latest(rec.name)
    base = ref[1] if ref else None
    only = [n for n in rec.nodes if n.name in a.nodes] if a.nodes else None  # --nodes
    addresses = [n.ip for n in only or [] if n.ip]  # none on the local cluster: its nodes share one
    ips = ["--ips", ",".join(addresses)] if addresses else []
    payload, run = job_payload(ctx, details, "perf", ["python", "ray/smoke_checks.py", "perf", *ips],
                               "the perf job")
    nodes, found = baseline.from_payload(rec, payload)
    log(f"perf: {len(nodes)} node(s) measured in {run.seconds:.0f} s; the links, through {rec.bastion}")
    links, more = baseline.links(rec, note=lambda m: log(f"perf: {m}"), only=only)
    found += more
    now = baseline.Perf(cluster=rec.name, recorded=baseline.now_utc(), commit=baseline.commit(REPO),
                        inventory_digest=baseline.inventory_digest(rec.inventory), nodes=nodes, links=links,
                        allreduce=baseline.allreduce(ctx.results.get("allreduce")))
    measured_ok = not found and set(nodes) >= {n.name for n in rec.nodes}
    if a.record_baseline:
        found += baseline.compare(None, now, th)  # what holds without a baseline (NCCL against the links)
    else:
        found += baseline.compare(base, now, th)
    details["table"] = baseline.table(base, now)
    for line in details["table"]:
        log(f"perf: {line}")
    details.update({"now": now.model_dump(), "baseline": str(ref[0]) if ref else None,
                    "thresholds": th.model_dump(), "job": run.summary(),
                    "findings": [f.model_dump() for f in found]})
    if base and not a.record_baseline:
        png = Path(a.report).with_suffix(".perf.png")
        png.parent.mkdir(parents=True, exist_ok=True)
        try:
            details["plot"] = str(baseline.plot(base, now, th, png, plots.pyplot()))
            log(f"perf: plot {png}")
        except Exception as e:  # the figures stand without their picture
            log(f"perf: no plot ({type(e).__name__}: {e})")
    lines = [f.line() for f in found]
    for line in lines:
        log(f"perf: {line}")
    if a.quarantine and found:
        details["quarantine"] = quarantined = quarantine(rec, found)
        for line in quarantined:
            log(f"perf: {line}")
    if a.record_baseline:
        if not measured_ok or found:
            fail(details, "no baseline recorded: " + ("; ".join(lines) or "not every node was measured"))
        details["recorded"] = str(baseline.save(now))
        log(f"perf: baseline recorded: {details['recorded']}")
    elif lines:
        fail(details, "; ".join(lines))


def quarantine(rec, found) -> list[str]:
    """The nodes named (not links nor the all-reduce) taken out of Ray, as make doctor QUARANTINE=1
    does (the doctor's report tells which are quarantined already and which Ray lists)."""
    names = {n.name for n in rec.nodes}
    mine = [f for f in found if f.node in names]
    if not mine:
        return ["nothing to quarantine: no single node is named"]
    _, report = doctor.doctor(rec, min_free_gb=0, max_clock_offset=1e9)
    return doctor.quarantine(rec, mine, report)


def test_trainers(ctx: Context, details: dict):
    """The three jobs (--trainers: some of them), one tiny epoch with one worker per node; each
    must succeed and leave an ONNX model that a check job on the cluster loads, runs and checks
    against its manifest. As many run at once as every worker node has CPUs (GPUs) for: one
    worker of each on every node."""
    ctx.need_workers()
    results: dict[str, dict] = {job: {} for job in ctx.trainers}  # the report's order, whatever ends first
    at_once = ctx.trainers_at_once
    details.update({"jobs": results, "workers": ctx.workers, "left_out": ctx.left_out, "at_once": at_once})
    log(f"trainers: {at_once} at a time (one worker of each on every node)")

    def train(job: str) -> None:
        name = f"smoke-{job.replace('_', '-')}-{ctx.stamp}"
        argv = ["python", f"jobs/{job}.py", *trainer_args(job, ctx.workers, ctx.use_gpu), "--name", name]
        if ctx.args.storage_path:
            argv += ["--storage-path", ctx.args.storage_path]
        if ctx.args.models_dir:
            argv += ["--output", str(Path(ctx.args.models_dir) / name)]
        if time.monotonic() >= ctx.deadline:
            results[job].update(name=name, ok=False, error=f"{job}: no time left in the step")
            return
        run = ctx.client.run(job, argv, ctx.deadline)
        results[job].update(name=name, **run.summary())
        if not run.ok:
            results[job].update(ok=False, error=job_error(job, run), log_tail=run.tail())
            log(f"{job}: {run.status} after {run.seconds:.0f} s; the job's last {len(run.tail())} lines:\n"
                + "\n".join(f"    {line}" for line in run.tail()))
        else:
            log(f"{job}: succeeded in {run.seconds:.0f} s")

    with ThreadPoolExecutor(max_workers=at_once) as pool:
        try:
            for done in [pool.submit(train, job) for job in ctx.trainers]:
                done.result()
        except BaseException:  # the step's hard stop, Ctrl-C: no trainer outlives it
            ctx.client.stop_all()
            raise
    # the check job finds each model through the run's record (published.json)
    models = [{"job": job, "name": r["name"], "storage_path": ctx.args.storage_path}
              for job, r in results.items() if r.get("status") == "SUCCEEDED"]
    if models:
        argv = ["python", "ray/smoke_checks.py", "models", "--world-size", str(ctx.workers),
                "--runs", json.dumps(models)]
        if ctx.args.clean:
            argv.append("--clean")
        run = ctx.client.run("models", argv, max(ctx.deadline, time.monotonic() + 300))
        payload = run.payload() if run.ok else None
        checked = {m["job"]: m for m in (payload or {}).get("models", [])}
        for m in models:
            r = results[m["job"]]
            got = checked.get(m["job"])
            if got is None:
                r.update(ok=False, error=f"{m['job']}: the model check job {run.status.lower()} "
                         f"without a verdict", check_job=run.summary(), log_tail=run.tail())
                continue
            r.update(ok=got["ok"], verified=got["ok"], check=got, model=got.get("model"),
                     manifest=got.get("manifest"))
            if not got["ok"]:
                r["error"] = f"{m['job']}: model check: " + "; ".join(got["problems"])
    failed = [j for j, r in results.items() if not r.get("ok")]
    if failed:
        fail(details, "; ".join(str(results[j].get("error")) for j in failed))


def test_proxyjump(ctx: Context, details: dict):
    """(Only with ssh_config and bastion) every node with an ip refuses a direct TCP connection
    to port 22 from here, and `ssh -F ssh_config NODE hostname` gets through the bastion."""
    reason = proxyjump_skip_reason(ctx.rec)
    if reason:
        pytest.skip(reason)
    cfg, bastion = ctx.rec.ssh_config, ctx.rec.bastion
    assert cfg is not None and bastion is not None  # proxyjump_skip_reason: both set
    if not Path(cfg).is_file():
        fail(details, f"the ssh config {cfg} does not exist on this machine")
    nodes = [n for n in ctx.rec.nodes if n.ip]
    with ThreadPoolExecutor(max_workers=min(8, len(nodes))) as pool:
        checked = list(pool.map(lambda n: check_node_proxyjump(n, cfg, bastion), nodes))
    details.update({"bastion": bastion, "ssh_config": cfg, "nodes": checked,
                    "not_checked": [n.name for n in ctx.rec.nodes if not n.ip]})
    problems = [f"{c['name']}: {p}" for c in checked for p in c["problems"]]
    if problems:
        fail(details, "; ".join(problems))
