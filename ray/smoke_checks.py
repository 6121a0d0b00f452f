"""The cluster side of `make smoke`: small Ray jobs that dlcluster/smoke/run.py submits and reads back.

    python ray/smoke_checks.py nodes
    python ray/smoke_checks.py allreduce --num-workers N --sizes 1048576,4194304 [--use-gpu]
    python ray/smoke_checks.py models --world-size N --models '[{"job": J, "model": M, "manifest": F}]'
    python ray/smoke_checks.py perf [--steps 20] [--storage-mib 64]

Each prints exactly one machine-readable line, `SMOKE_JSON {...}`, that the controller parses
from the job's logs (everything else in the logs is for people). They run as the job's driver
(the head node), with the repository as the working dir, on the cluster's own Python; at the top
they import only the standard library and what both sides share (trainkit/smoke_protocol.py, the
working dir's harness); nothing here imports the operator's package (dlcluster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import time
from pathlib import Path

from trainkit.smoke_protocol import MARKER, MIB, bandwidth, iterations  # the working dir's


def emit(payload: dict) -> None:
    """The one line the controller reads (printed last, flushed)."""
    print(MARKER + json.dumps(payload, sort_keys=True, default=str), flush=True)


# ------------------------------------------------------------------ nodes
def harness() -> dict:
    """Where this process imported the harness from, and the job's working dir (its upload): a
    node that also has a copy installed (the image's) must still run the uploaded one."""
    import trainkit

    return {"harness": str(Path(trainkit.__file__).resolve().parent),
            "working_dir": str(Path.cwd().resolve())}


def check_nodes(probe_timeout: float) -> dict:
    """Every node Ray knows: address, hostname, CPUs, GPUs, head or not, whether its dashboard
    agent registered (a node without one cannot take jobs), whether a task pinned to it runs, and
    which harness that task (and the driver) imported."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import ray

    ray.init(logging_level="ERROR", log_to_driver=False)
    try:
        from ray._private.ray_constants import KV_NAMESPACE_DASHBOARD
        from ray.dashboard.consts import DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX
        from ray.experimental.internal_kv import _internal_kv_get

        def agent(node_id: str) -> bool:
            key = DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX + node_id
            return bool(_internal_kv_get(key, namespace=KV_NAMESPACE_DASHBOARD))

        everything = ray.nodes()
        alive = [n for n in everything if n.get("Alive")]

        @ray.remote(num_cpus=0)
        def probe() -> dict:
            import ray as r

            return {"hostname": socket.gethostname(), "python": platform.python_version(),
                    "ray": r.__version__, "node_id": r.get_runtime_context().get_node_id(), **harness()}

        refs = {n["NodeID"]: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote() for n in alive}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=probe_timeout)
        done = set(ready)
        nodes = []
        for n in alive:
            res = n.get("Resources", {})
            ref = refs[n["NodeID"]]
            task = None
            if ref in done:
                try:
                    task = ray.get(ref)
                except Exception as e:  # the task itself failed on that node
                    task = {"error": f"{type(e).__name__}: {e}"[:300]}
            nodes.append({
                "node_id": n["NodeID"], "ip": n.get("NodeManagerAddress"),
                "hostname": n.get("NodeManagerHostname"),
                "cpus": int(round(res.get("CPU", 0))), "gpus": int(round(res.get("GPU", 0))),
                "head": "node:__internal_head__" in res, "agent": agent(n["NodeID"]),
                "task": task,
            })
        return {"nodes": nodes, "dead": len(everything) - len(alive),
                "driver": {"python": platform.python_version(), "ray": ray.__version__,
                           "hostname": socket.gethostname(), **harness()},
                "probe_timeout_s": probe_timeout}
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ allreduce
def allreduce_worker(config: dict) -> None:
    """On every Ray Train worker: per size, warm up, time in-place all-reduces (sum, float32), then
    refill with rank+1 and check every element against n(n+1)/2. Rank 0 sends the table on."""
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist

    import ray

    ctx = ray.train.get_context()
    rank, n = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    where = [None] * n
    dist.all_gather_object(where, {"rank": rank, "node_id": ray.get_runtime_context().get_node_id(),
                                   "hostname": socket.gethostname(), "device": str(device)})
    expected = n * (n + 1) / 2
    rows = []
    for nbytes in config["sizes"]:
        count = nbytes // 4
        warmup, iters = iterations(nbytes)
        buf = torch.full((count,), float(rank + 1), dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(buf)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        per_op = (time.perf_counter() - t0) / iters
        buf.fill_(float(rank + 1))
        dist.all_reduce(buf)
        sync()
        wrong = int((buf != expected).sum().item())
        # nccl-tests' default (-a 1): the time per op averaged over the ranks; #wrong summed.
        stats = torch.tensor([per_op, per_op, wrong], dtype=torch.float64, device=device)
        dist.all_reduce(stats)
        slowest = torch.tensor([per_op], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = stats[0].item() / n
        algbw, busbw = bandwidth(count * 4, seconds, n)
        rows.append({"bytes": count * 4, "count": count, "type": "float", "redop": "sum",
                     "warmup": warmup, "iters": iters, "time_us": seconds * 1e6,
                     "max_time_us": slowest.item() * 1e6, "algbw_gbs": algbw, "busbw_gbs": busbw,
                     "wrong": int(stats[2].item())})
        del buf
        if rank == 0:
            r = rows[-1]
            print(f"[smoke] allreduce {r['bytes']:>11} B x{iters}: {r['time_us']:.0f} us, algbw "
                  f"{algbw:.3f} GB/s, busbw {busbw:.3f} GB/s, #wrong {r['wrong']}",
                  file=sys.__stdout__, flush=True)
    if rank == 0:
        ray.get(config["collector"].put.remote({"rows": rows, "ranks": where,
                                                "backend": dist.get_backend(), "world_size": n}))


def run_allreduce(a: argparse.Namespace) -> dict:
    # Train V2 explicitly (the default in Ray 2.60, but a node environment may have turned it off).
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    import ray

    ray.init(logging_level="ERROR")
    need = {"CPU": 1, **({"GPU": 1} if a.use_gpu else {})}
    fit = [n for n in ray.nodes() if n.get("Alive")
           and all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items())]
    if len(fit) < a.num_workers:
        # STRICT_SPREAD would wait for ever for nodes that are not there: say so instead.
        return {"error": f"{a.num_workers} workers need {a.num_workers} nodes with {need} each, "
                         f"the cluster has {len(fit)}"}

    class Collector:
        def __init__(self):
            self.value = None

        def put(self, value):
            self.value = value

        def get(self):
            return self.value

    collector = ray.remote(num_cpus=0)(Collector).remote()
    storage = a.storage_path
    if storage is None:
        from trainkit.flags import default_storage

        storage = default_storage()
    backend = "nccl" if a.use_gpu else "gloo"
    trainer = TorchTrainer(
        allreduce_worker,
        train_loop_config={"sizes": a.sizes, "collector": collector},
        torch_config=TorchConfig(backend=backend),
        scaling_config=ScalingConfig(num_workers=a.num_workers, use_gpu=a.use_gpu,
                                     resources_per_worker={"CPU": 1},
                                     placement_strategy="STRICT_SPREAD"),
        run_config=RunConfig(name=a.name, storage_path=storage),
    )
    t0 = time.perf_counter()
    trainer.fit()
    result = ray.get(collector.get.remote())
    if result is None:
        return {"error": "the trainer finished but rank 0 reported nothing"}
    run_dir = Path(storage) / a.name
    if "://" not in storage and run_dir.is_dir():
        shutil.rmtree(run_dir, ignore_errors=True)  # Train's bookkeeping for this run only
    return {**result, "fit_s": time.perf_counter() - t0, "placement_strategy": "STRICT_SPREAD",
            "nodes_used": len({r["node_id"] for r in result["ranks"]})}


# ------------------------------------------------------------------ models
def check_run(job: str, name: str, storage_path: str | None, world_size: int, clean: bool) -> dict:
    """The model a trainer's run published, found through its record in the run's folder."""
    from trainkit.errors import UserError
    from trainkit.flags import default_storage
    from trainkit.onnx_export import published

    run_dir = Path(storage_path or default_storage()) / name
    try:
        p = published(run_dir)
    except UserError as e:
        return {"job": job, "run": name, "ok": False, "problems": [str(e)]}
    return check_model(job, p.model, p.manifest_path, world_size, clean)


def check_model(job: str, model: Path, manifest_path: Path, world_size: int, clean: bool) -> dict:
    """Load model.onnx in onnxruntime, run it on zeros of the manifest's input shape (batch 1 for
    a named axis), and check the manifest: its model, job, I/O against the file's, the parity
    figure within its tolerance, the world size."""
    import numpy as np
    import onnxruntime as ort

    problems: list[str] = []
    out: dict = {"job": job, "model": str(model), "manifest": str(manifest_path)}
    if not model.is_file():
        return {**out, "ok": False, "problems": [f"{model} does not exist on the head node"]}
    if not manifest_path.is_file():
        return {**out, "ok": False, "problems": [f"{manifest_path} does not exist on the head node"]}
    m = json.loads(manifest_path.read_text())
    parity = m.get("parity") or {}
    out.update(bytes=model.stat().st_size, parity=parity, world_size=m.get("world_size"),
               run=(m.get("run") or {}).get("name"), git_commit=m.get("git_commit"))
    if m.get("model") != model.name or manifest_path.parent != model.parent:
        problems.append(f"manifest names {m.get('model')!r}, not {model.name} beside it")
    if m.get("job") != job:
        problems.append(f"manifest job {m.get('job')!r} is not {job}")
    from trainkit.onnx_export import sha256

    if m.get("model_sha256") != sha256(model):
        problems.append(f"{model.name}'s sha256 is not the manifest's model_sha256")
    diff, tol = parity.get("max_abs_diff"), parity.get("tolerance")
    if not isinstance(diff, int | float) or not isinstance(tol, int | float) or not diff <= tol:
        problems.append(f"parity max_abs_diff {diff} is not within tolerance {tol}")
    if not parity.get("samples"):
        problems.append("parity was checked on no samples")
    if m.get("world_size") != world_size:
        problems.append(f"manifest world_size {m.get('world_size')} is not {world_size}")
    try:
        sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        ins, outs = sess.get_inputs(), sess.get_outputs()
        if [i.name for i in ins] != [i["name"] for i in m.get("inputs", [])]:
            problems.append(f"model inputs {[i.name for i in ins]} differ from the manifest's")
        spec = m["inputs"][0]
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in spec["shape"]]
        x = np.zeros(shape, dtype=np.dtype(spec.get("dtype", "float32")))
        y = sess.run(None, {ins[0].name: x})[0]
        want = [d if isinstance(d, int) and d > 0 else 1 for d in m["outputs"][0]["shape"]]
        out.update(input_shape=shape, output_shape=list(y.shape), outputs=[o.name for o in outs],
                   onnxruntime=ort.__version__)
        if list(y.shape) != want:
            problems.append(f"output shape {list(y.shape)} is not the manifest's {want}")
        if not np.all(np.isfinite(y)):
            problems.append("the model's output on zeros is not finite")
    except Exception as e:
        problems.append(f"onnxruntime could not run the model: {type(e).__name__}: {e}"[:400])
    out.update(ok=not problems, problems=problems)
    if clean and not problems:
        # the model sits in <output>/publications/<stamp>/: the run's model folder is <output>
        output = model.parent.parent.parent if model.parent.parent.name == "publications" else model.parent
        out["removed"] = remove_run(m, output)
    return out


def remove_run(manifest: dict, model_dir: Path) -> list[str]:
    """--clean: a smoke run's model folder and its Ray Train run folder (named smoke-*), nothing else."""
    run = manifest.get("run") or {}
    name, storage = run.get("name", ""), run.get("storage_path") or ""
    removed = []
    targets = [model_dir] + ([Path(storage) / name] if storage and "://" not in storage else [])
    for d in targets:
        if name.startswith("smoke-") and d.name == name and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    return removed


# ------------------------------------------------------------------ perf (the baseline's per-node part)
def step_seconds(device: str, threads: int, steps: int, warmup: int = 5) -> dict:
    """Seconds per training step of one fixed synthetic batch (a small CNN, forward, backward,
    SGD; seeded, so every node and every run does the same work) over `steps` timed steps: their
    lower quartile `step_s`, what the device does when nothing else disturbs it (a node slowed for
    good, by a CPU limit or throttling, is slow in every step; another process's burst slows a
    few), with the median, min and max."""
    import statistics

    import torch

    torch.manual_seed(0)
    if device == "cpu":
        torch.set_num_threads(max(1, threads))
    nn = torch.nn
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                          nn.Conv2d(32, 32, 3, stride=2, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(32 * 16 * 16, 10)).to(device)
    batch = 64 if device == "cpu" else 512
    x = torch.randn(batch, 3, 64, 64, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if device != "cpu":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return {"step_s": statistics.quantiles(times, n=4)[0], "median_s": statistics.median(times),
            "min_s": min(times), "max_s": max(times),
            "steps": steps, "batch": batch, "threads": threads if device == "cpu" else None}


def storage_throughput(folder: Path, mib: int) -> dict:
    """MB/s (1e6 bytes/s) writing `mib` MiB to a new file under `folder` (1 MiB writes, fsync
    included) and reading it back after dropping it from this machine's page cache
    (posix_fadvise DONTNEED: an NFS client asks the server again; the better of two reads). The
    file is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".dlc-perf-{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    block = os.urandom(MIB)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            t = time.perf_counter()
            for _ in range(mib):
                os.write(fd, block)
            os.fsync(fd)
            wrote = time.perf_counter() - t
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        reads = []
        for _ in range(2):  # the better of two: a read is only ever slowed by what else runs
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                t, got = time.perf_counter(), 0
                while chunk := os.read(fd, 4 * MIB):
                    got += len(chunk)
                reads.append(time.perf_counter() - t)
            finally:
                os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    size = mib * MIB
    if got != size:
        raise OSError(f"read back {got} of {size} bytes from {path}")
    return {"write_mbps": size / wrote / 1e6, "read_mbps": size / min(reads) / 1e6, "mib": mib,
            "folder": str(folder)}


def node_perf(cpus: int, gpus: int, steps: int, storage_mib: int) -> dict:
    """One node's part, run as a task holding all of the node's CPUs and GPUs (nothing else of
    Ray's runs there meanwhile): the step time on its CPUs and on each GPU, the shared storage."""
    import ray as r
    from trainkit.flags import default_storage

    out: dict = {"ip": r.util.get_node_ip_address(), "hostname": socket.gethostname()}
    out["cpu"] = step_seconds("cpu", cpus, steps)
    out["gpus"] = [step_seconds(f"cuda:{i}", 0, steps) for i in range(gpus)]
    storage = default_storage()
    if "://" in storage:
        out["storage"] = {"skipped": f"the runs' storage {storage} is not a folder on the node"}
    else:
        try:
            out["storage"] = storage_throughput(Path(storage), storage_mib)
        except OSError as e:
            out["storage"] = {"error": f"{storage}: {e}"}
    return out


def run_perf(steps: int, storage_mib: int, timeout: float, ips: set[str] | None = None) -> dict:
    """node_perf on every alive node (or those of `ips`), one node after the other (no measurement
    shares a machine or the network with another: on a cluster whose nodes share a host, as the
    emulated one, the figures stay comparable), each pinned to its node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import ray

    ray.init(logging_level="ERROR", log_to_driver=False)
    try:
        measured, problems = [], []
        alive = [n for n in ray.nodes() if n.get("Alive") and (not ips or n["NodeManagerAddress"] in ips)]
        missing = sorted((ips or set()) - {n["NodeManagerAddress"] for n in alive})
        problems += [{"ip": ip, "error": "not alive in Ray"} for ip in missing]
        for n in sorted(alive, key=lambda n: n["NodeManagerAddress"]):
            res = n.get("Resources") or {}
            cpus, gpus = int(res.get("CPU", 0)), int(res.get("GPU", 0))
            task = ray.remote(node_perf).options(
                num_cpus=cpus, num_gpus=gpus,
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
            ref = task.remote(max(1, cpus), gpus, steps, storage_mib)
            try:
                measured.append({**ray.get(ref, timeout=timeout), "cpus": cpus, "gpus_ray": gpus})
            except Exception as e:  # a node that cannot run it: the controller names it
                ray.cancel(ref, force=True)
                problems.append({"ip": n["NodeManagerAddress"],
                                 "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"})
        return {"nodes": measured, "problems": problems}
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="smoke_checks", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("nodes")
    n.add_argument("--probe-timeout", type=float, default=60)
    r = sub.add_parser("allreduce")
    r.add_argument("--num-workers", type=int, required=True)
    r.add_argument("--sizes", required=True, help="message sizes in bytes, comma-separated")
    r.add_argument("--use-gpu", action="store_true")
    r.add_argument("--name", default=time.strftime("smoke-allreduce-%Y%m%d-%H%M%S"))
    r.add_argument("--storage-path", default=None)
    mo = sub.add_parser("models")
    mo.add_argument("--world-size", type=int, required=True)
    mo.add_argument("--runs", required=True,
                    help='JSON: [{"job": ..., "name": ..., "storage_path": ... or null}]')
    mo.add_argument("--clean", action="store_true")
    pe = sub.add_parser("perf")
    pe.add_argument("--steps", type=int, default=40, help="timed steps of the fixed batch per device")
    pe.add_argument("--storage-mib", type=int, default=64, help="MiB written and read on the storage")
    pe.add_argument("--node-timeout", type=float, default=180, help="seconds per node")
    pe.add_argument("--ips", default="", help="only the nodes of these addresses (comma-separated)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    if a.cmd == "nodes":
        payload = check_nodes(a.probe_timeout)
    elif a.cmd == "allreduce":
        a.sizes = [int(s) for s in a.sizes.split(",")]
        payload = run_allreduce(a)
    elif a.cmd == "perf":
        payload = run_perf(a.steps, a.storage_mib, a.node_timeout, {i for i in a.ips.split(",") if i})
    else:
        models = [check_run(r["job"], r["name"], r.get("storage_path"), a.world_size, a.clean)
                  for r in json.loads(a.runs)]
        payload = {"models": models, "hostname": socket.gethostname()}
    payload["seconds"] = time.perf_counter() - t0
    emit(payload)


if __name__ == "__main__":
    main()
