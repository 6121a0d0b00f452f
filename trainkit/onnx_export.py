"""Export a trained model to ONNX, check it in onnxruntime against the framework, write a manifest.

Every job ends here: `export_torch` / `export_keras` stage the model (one file, dynamic batch
axis), then `verify_and_publish` runs the held-out batch through onnxruntime, fails above the
tolerance, and only then publishes the model and its manifest as one pair (atomically: see there).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from .errors import UserError

TOLERANCE = 1e-4
MODEL_FILE = "model.onnx"
MANIFEST_FILE = "manifest.json"
RECORD_FILE = "published.json"  # in the run's folder: where its model was published
PUBLICATIONS = "publications"  # <output>/publications/<seq>-<stamp>/{model.onnx,manifest.json}
CURRENT = "current"  # <output>/current -> publications/<seq>-<stamp>: switched by one rename
KEEP_PUBLICATIONS = 3
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Published:
    """A published model: where its files are and what its manifest says."""

    model: Path
    manifest_path: Path
    manifest: dict

    def record(self) -> dict:
        return {"model": str(self.model), "manifest": str(self.manifest_path),
                "job": self.manifest["job"], "created": self.manifest["created"]}


def published(run_dir: Path) -> Published:
    """The model a run published last, from the record in its folder (no log to read)."""
    path = run_dir / RECORD_FILE
    try:
        record = json.loads(path.read_text())
        manifest_path = Path(record["manifest"])
        return Published(Path(record["model"]), manifest_path, json.loads(manifest_path.read_text()))
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"no published model recorded in {path} ({e}); did the run finish?") from None


class ParityError(RuntimeError):
    """onnxruntime disagrees with the framework beyond the tolerance."""


def staging_path(output: Path) -> Path:
    """Where a new model is written before it is verified (the published one stays until then):
    a name of this process's own, so two runs publishing into one folder never share a file."""
    output.mkdir(parents=True, exist_ok=True)
    return output / f".{MODEL_FILE}.{socket.gethostname()}.{os.getpid()}.new"


def sequence(name: str) -> int:
    """A publication folder's number (0 for the older layout's bare time stamps)."""
    head = name.split("-", 1)[0]
    return int(head) if len(head) == 6 and head.isdigit() else 0


def _new_publication(output: Path, now: _dt.datetime) -> Path:
    """The next publication folder: one number past every folder there, whatever the clock says
    (a clock stepped back cannot make a new publication sort older); mkdir decides a race."""
    root = output / PUBLICATIONS
    root.mkdir(parents=True, exist_ok=True)
    n = max((sequence(p.name) for p in root.iterdir()), default=0)
    while True:
        n += 1
        folder = root / f"{n:06d}-{now:%Y%m%d-%H%M%S}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue


def _prune(output: Path, keep: int) -> None:
    """All but the newest `keep` publications, by number; never the one `current` names."""
    root = output / PUBLICATIONS
    live = (output / CURRENT).resolve()
    for old in sorted(root.iterdir(), key=lambda p: (sequence(p.name), p.name))[:-keep]:
        if old.resolve() != live:
            shutil.rmtree(old, ignore_errors=True)


def _remove(path: Path) -> None:
    """A staged file or folder that will not be published."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    """A file's data, or a folder's entries, on disk before anything points at them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_torch(model, example, output: Path, input_name: str = "input",
                 output_name: str = "output", sequence: tuple[int, int] | None = None) -> Path:
    """torch.nn.Module -> ONNX (dynamo exporter, single file, dynamic batch axis; with `sequence`,
    (least, most), axis 1 is dynamic too: a language model's tokens)."""
    import torch

    path = staging_path(output)
    model = model.eval().cpu()
    example = example.cpu()
    if example.shape[0] < 2:  # torch.export fixes an axis it sees at size 1: trace on two rows
        example = torch.cat([example] * 2)
    axes = {0: torch.export.Dim("batch", min=1, max=1 << 16)}
    if sequence is not None:
        axes[1] = torch.export.Dim("sequence", min=sequence[0], max=sequence[1])
    torch.onnx.export(
        model, (example,), str(path), dynamo=True, external_data=False,
        input_names=[input_name], output_names=[output_name],
        dynamic_shapes=(axes,), verbose=False,
    )
    return path


def export_keras(model, example: np.ndarray, output: Path, input_name: str = "input",
                 output_name: str = "output") -> Path:
    """tf-keras model -> ONNX with tf2onnx (dynamic batch axis)."""
    import tensorflow as tf
    import tf2onnx

    path = staging_path(output)
    spec = (tf.TensorSpec((None, *example.shape[1:]), tf.float32, name=input_name),)
    tf2onnx.convert.from_keras(model, input_signature=spec, output_path=str(path))
    return path


def onnx_io(path: Path) -> dict:
    """Opsets and input/output names, shapes (a name for a dynamic axis) and dtypes of a model."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)

    def describe(values):
        return [{
            "name": v.name,
            "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim],
            "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
        } for v in values]

    return {
        "opset": {(o.domain or "ai.onnx"): o.version for o in m.opset_import},
        "inputs": describe(m.graph.input),
        "outputs": describe(m.graph.output),
    }


def check_parity(path: Path, inputs: np.ndarray, reference: np.ndarray,
                 tolerance: float = TOLERANCE) -> dict:
    """Run `inputs` through onnxruntime and compare with the framework's `reference` output.

    Also runs a batch of one, so a batch axis frozen at export time is caught.
    """
    import onnx
    import onnxruntime as ort

    t0 = time.perf_counter()
    onnx.checker.check_model(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    if inputs.dtype.kind not in "iu":  # token ids stay integers; images and features are float32
        inputs = inputs.astype(np.float32)
    got = sess.run(None, {name: inputs})[0]
    one = sess.run(None, {name: inputs[:1]})[0]
    if got.shape != reference.shape or one.shape != reference[:1].shape:
        raise ParityError(f"onnxruntime output shape {got.shape} (batch of one: {one.shape}) "
                          f"differs from the framework's {reference.shape}")
    diff = float(max(np.max(np.abs(got - reference)), np.max(np.abs(one - reference[:1]))))
    if not diff <= tolerance:
        raise ParityError(f"onnxruntime differs from the framework by {diff:.3g} "
                          f"(tolerance {tolerance:g}) on {len(inputs)} held-out samples")
    return {"max_abs_diff": diff, "tolerance": tolerance, "samples": int(len(inputs)),
            "provider": "CPUExecutionProvider", "onnxruntime": ort.__version__,
            "seconds": time.perf_counter() - t0}


def checkout_commit(root: Path) -> str | None:
    """`git rev-parse HEAD` of the checkout at `root`, "-dirty" after it when tracked files changed;
    None where `root` is no checkout (or git is missing)."""
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None


def git_commit() -> str:
    """The commit the job's code came from, the most exact answer first:
    - `git rev-parse` where the code is a checkout ("-dirty" after it when tracked files changed);
    - DLC_SUBMIT_COMMIT, which `make submit` sets from the client's checkout (with "-dirty");
    - the refs `ray job submit --working-dir .` uploads (.rayignore keeps .git/HEAD and refs, not
      history or config): the commit, without knowing whether the tree was dirty;
    - DLC_GIT_COMMIT, baked into the image at build time; else 'unknown'."""
    if checked_out := checkout_commit(REPO_ROOT):
        return checked_out
    uploaded = uploaded_commit(REPO_ROOT / ".git")  # the working dir's root, where the harness is
    return (os.environ.get("DLC_SUBMIT_COMMIT") or uploaded or os.environ.get("DLC_GIT_COMMIT")
            or "unknown")


def uploaded_commit(git_dir: Path) -> str | None:
    """HEAD's commit from the refs alone (no git, no objects): a ref file, else packed-refs."""
    try:
        head = (git_dir / "HEAD").read_text().strip()
    except OSError:
        return None
    if not head.startswith("ref: "):
        return head if re.fullmatch(r"[0-9a-f]{40,64}", head) else None
    ref = head[5:].strip()
    try:
        return (git_dir / ref).read_text().strip() or None
    except OSError:
        pass
    try:
        for line in (git_dir / "packed-refs").read_text().splitlines():
            sha, _, name = line.partition(" ")
            if name.strip() == ref:
                return sha
    except OSError:
        pass
    return None


def working_dir_package() -> str | None:
    """The content-addressed package Ray made of the uploaded working dir (gcs://_ray_pkg_<hash>
    .zip): exactly the code the job ran, dirty or not. None outside a submitted Ray job."""
    try:
        env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
        return (env.get("runtime_env") or {}).get("working_dir")
    except (ValueError, AttributeError):
        return None


def _versions(packages: list[str]) -> dict[str, str]:
    found = {"python": platform.python_version()}
    for p in packages:
        try:
            found[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            pass
    return found


def verify_and_publish(staged: Path, output: Path, *, job: str, framework: str,
                       inputs: np.ndarray, reference: np.ndarray, metrics: dict,
                       world_size: int, packages: tuple[str, ...] = (),
                       extra: dict | None = None, tolerance: float = TOLERANCE,
                       record_dir: Path | None = None, beside: dict[str, Path] | None = None) -> Published:
    """Check the staged model; on success publish it with its manifest (and, given `record_dir`,
    the run's record of where it went). `beside`: further staged files or folders (name -> staged
    path, e.g. a language model's `save_pretrained` folder) published in the same folder, reached
    as `<output>/<name>` like the model.

    Publishing is atomic: the pair is written whole into its own folder
    `<output>/publications/<seq>-<stamp>/` (the sequence one past every folder there, so never
    older than one before it, whatever the clock), file and folder synced to disk, then
    `<output>/current` is switched to it by one rename;
    `<output>/model.onnx` and `<output>/manifest.json` are links through `current`. A reader that
    resolves `current` once sees the old pair or the new one, never a mix. A failure before the
    switch (a full disk, a crash) leaves the previous publication current. The manifest records
    the model's sha256. The newest KEEP_PUBLICATIONS stay, and always the one `current` names.

    On a parity failure the staged file is kept as model.rejected.onnx for inspection, the
    published model (if any) is left as it was, and a UserError says what happened.
    """
    beside = beside or {}
    try:
        parity = check_parity(staged, inputs, reference, tolerance)
    except ParityError as e:
        for extra_staged in beside.values():
            _remove(extra_staged)
        rejected = output / "model.rejected.onnx"
        staged.replace(rejected)
        raise UserError(f"ONNX check failed: {e}; the rejected model is {rejected}, "
                        f"the earlier {output / MODEL_FILE} (if any) is untouched") from None
    now = _dt.datetime.now(_dt.UTC)
    manifest = {
        "job": job,
        "created": now.isoformat(timespec="seconds"),
        "model": MODEL_FILE,
        "model_sha256": sha256(staged),
        "framework": framework,
        "versions": _versions([framework, *packages, "onnx", "onnxruntime", "ray"]),
        **onnx_io(staged),
        "parity": parity,
        "metrics": metrics,
        "world_size": world_size,
        "git_commit": git_commit(),
        "working_dir": working_dir_package(),
        **({"beside": sorted(beside)} if beside else {}),
        **(extra or {}),
    }
    folder = None
    try:
        _fsync(staged)
        folder = _new_publication(output, now)
        staged.replace(folder / MODEL_FILE)
        for name, path in beside.items():
            path.replace(folder / name)
        _write_json(folder / MANIFEST_FILE, manifest, sync=True)
        for synced in (folder, folder.parent):
            _fsync(synced)
        _link(output / CURRENT, Path(PUBLICATIONS) / folder.name)  # the switch
        _fsync(output)
        for name in (MODEL_FILE, MANIFEST_FILE, *beside):
            if not (output / name).is_symlink():
                _link(output / name, Path(CURRENT) / name)
    except OSError as e:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        for path in (staged, *beside.values()):
            _remove(path)
        raise UserError(f"could not publish the model in {output} ({e.strerror or e}); the "
                        f"previous publication there (if any) is still current; free space "
                        "or give another --output, then rerun with the same --name") from None
    _prune(output, KEEP_PUBLICATIONS)
    result = Published(folder / MODEL_FILE, folder / MANIFEST_FILE, manifest)
    if record_dir is not None:
        _write_json(record_dir / RECORD_FILE, result.record())
    return result


def current(output: Path) -> Published:
    """The pair published last in `output`, read through one resolution of `current`."""
    folder = (output / CURRENT).resolve()
    return Published(folder / MODEL_FILE, folder / MANIFEST_FILE,
                     json.loads((folder / MANIFEST_FILE).read_text()))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _link(path: Path, target: Path) -> None:
    """Point the symlink `path` at `target` in one rename (replacing a file of an older layout)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, path)


def _write_json(path: Path, data: dict, sync: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with tmp.open("w") as f:
        f.write(json.dumps(data, indent=2, default=_jsonable) + "\n")
        if sync:
            f.flush()
            os.fsync(f.fileno())
    tmp.replace(path)


def _jsonable(v):
    if isinstance(v, np.generic):
        return v.item()
    return str(v)
