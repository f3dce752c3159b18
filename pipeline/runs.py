"""The run folder: stage directories, atomic writes and manifests.

Stages hand off only through `runs/<run>/<stage>/`. A stage writes `manifest.json` last
and atomically; a folder without one is an unfinished stage, which the next stage refuses
and the stage itself resumes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator, Optional

from pipeline.errors import PipelineError

MANIFEST = "manifest.json"
TRACKED_PACKAGES = (
    "specdraft", "torch", "transformers", "datasets", "accelerate", "deepspeed",
    "peft", "hydra-core", "safetensors",
)


def stage_dir(runs_dir: str | Path, run: str, stage: str) -> Path:
    return Path(runs_dir) / run / stage


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp folder beside `final`; it becomes `final` only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temp_dirs(folder: Path) -> int:
    """Delete the leftovers of `atomic_dir` blocks whose process was killed."""
    stale = list(folder.glob(".tmp-*")) if folder.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return len(stale)


def sha256_file(path: Path, chunk_size: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


def hash_tree(folder: Path) -> dict[str, str]:
    """sha256 of every file below `folder`, keyed by its path relative to `folder`."""
    return {
        str(p.relative_to(folder)): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def package_versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0]}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def write_manifest(
    folder: Path,
    *,
    stage: str,
    config: dict[str, Any],
    target_fingerprint: str,
    outputs: dict[str, str],
    wall_time_s: float,
    inputs: Optional[dict[str, dict[str, Any]]] = None,
    **extra: Any,
) -> Path:
    """Write `folder/manifest.json` last and atomically: it marks the stage as complete."""
    manifest = {
        "stage": stage,
        "status": "complete",
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config,
        "target_fingerprint": target_fingerprint,
        "inputs": inputs or {},
        "outputs": outputs,
        "wall_time_s": round(wall_time_s, 3),
        "package_versions": package_versions(),
        **extra,
    }
    path = folder / MANIFEST
    atomic_write_json(path, manifest)
    return path


def read_manifest(folder: Path, stage: str, run: Optional[str] = None, extra: str = "") -> dict[str, Any]:
    """The manifest of a finished stage, or a PipelineError that says how to finish it
    (`extra`: more of that command, e.g. heads=eagle)."""
    path = folder / MANIFEST
    if not path.is_file():
        how = f"python -m pipeline stage={stage}" + (f" {extra}" if extra else "") + (f" run={run}" if run else "")
        state = "is unfinished" if folder.is_dir() else "does not exist"
        raise PipelineError(f"{folder} {state} (no {MANIFEST}); run `{how}` first")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PipelineError(f"{path} is not valid JSON: {e}") from None
    if manifest.get("stage") != stage or manifest.get("status") != "complete":
        raise PipelineError(f"{path} is not a complete {stage} manifest")
    return manifest
