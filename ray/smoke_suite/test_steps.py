"""The smoke steps, one test each, in the order they run (`--only` selects among them; the report
plugin keeps this order): nodes, allreduce, trainers, proxyjump. Each fills `details`, which the
report keeps; a failure's message is the step's error (pytest.fail), a skip's its reason."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from smoke_suite.lib import (
    TRAINERS,
    Context,
    check_node_proxyjump,
    fail,
    job_error,
    job_payload,
    log,
    node_problems,
    proxyjump_skip_reason,
    trainer_args,
)


def test_nodes(ctx: Context, details: dict):
    """Every node joined with the CPUs and GPUs the cluster record lists, its dashboard agent
    registered, and a task pinned to it runs."""
    payload, run = job_payload(ctx, details, "nodes", ["python", "ray/smoke_checks.py", "nodes"],
                               "the nodes job")
    expected = ctx.desc["nodes"]
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


def test_trainers(ctx: Context, details: dict):
    """The three jobs, one tiny epoch with one worker per node; each must succeed and leave an
    ONNX model that a check job on the cluster loads, runs and checks against its manifest."""
    ctx.need_workers()
    results: dict[str, dict] = {}
    details.update({"jobs": results, "workers": ctx.workers, "left_out": ctx.left_out})
    models = []
    for job in TRAINERS:
        name = f"smoke-{job.replace('_', '-')}-{ctx.stamp}"
        argv = ["python", f"jobs/{job}.py", *trainer_args(job, ctx.workers, ctx.use_gpu), "--name", name]
        if ctx.args.storage_path:
            argv += ["--storage-path", ctx.args.storage_path]
        if ctx.args.models_dir:
            argv += ["--output", str(Path(ctx.args.models_dir) / name)]
        if time.monotonic() >= ctx.deadline:
            results[job] = {"name": name, "ok": False, "error": f"{job}: no time left in the step"}
            continue
        run = ctx.jobs.run(job, argv, ctx.deadline)
        results[job] = {"name": name, **run.summary()}
        if not run.ok:
            results[job].update(ok=False, error=job_error(job, run), log_tail=run.tail())
            log(f"{job}: {run.status} after {run.seconds:.0f} s; the job's last {len(run.tail())} lines:")
            for line in run.tail():
                print(f"    {line}", flush=True)
        else:
            log(f"{job}: succeeded in {run.seconds:.0f} s")
            # the check job finds the model through the run's record (published.json)
            models.append({"job": job, "name": name, "storage_path": ctx.args.storage_path})
    if models:
        argv = ["python", "ray/smoke_checks.py", "models", "--world-size", str(ctx.workers),
                "--runs", json.dumps(models)]
        if ctx.args.clean:
            argv.append("--clean")
        run = ctx.jobs.run("models", argv, max(ctx.deadline, time.monotonic() + 300))
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
    reason = proxyjump_skip_reason(ctx.desc)
    if reason:
        pytest.skip(reason)
    cfg, bastion = ctx.desc["ssh_config"], ctx.desc["bastion"]
    if not Path(cfg).is_file():
        fail(details, f"the ssh config {cfg} does not exist on this machine")
    nodes = [n for n in ctx.desc["nodes"] if n.get("ip")]
    with ThreadPoolExecutor(max_workers=min(8, len(nodes))) as pool:
        checked = list(pool.map(lambda n: check_node_proxyjump(n, cfg, bastion), nodes))
    details.update({"bastion": bastion, "ssh_config": cfg, "nodes": checked,
                    "not_checked": [n["name"] for n in ctx.desc["nodes"] if not n.get("ip")]})
    problems = [f"{c['name']}: {p}" for c in checked for p in c["problems"]]
    if problems:
        fail(details, "; ".join(problems))
