"""The run folder: stage directories, manifests, plans and provenance.

Stages hand off only through `runs/<run>/<stage>/`. A stage writes `manifest.json` last
and atomically; a folder without one is an unfinished stage, which the next stage refuses
and the stage itself resumes. Each manifest records the sha256 of the manifests it read
(`consumed`), so a later stage can tell when an input was run again since (`check_consumed`).
A finished stage is never rebuilt in place: `claim_stage` puts a new run beside it and
`complete_claim` swaps it in once complete. Writes and deletions go through pipeline.files.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

from pipeline.config import check_run_name
from pipeline.errors import PipelineError
from pipeline.files import MARKER, atomic_write_json, own_dir, recover_replace, remove, replace_dir

MANIFEST = "manifest.json"
TRACKED_PACKAGES = (
    "specdraft", "torch", "transformers", "datasets", "accelerate", "deepspeed",
    "peft", "hydra-core", "safetensors",
)


PLAN = "plan.json"


def stage_dir(runs_dir: str | Path, run: str, stage: str) -> Path:
    check_run_name(run)
    return Path(runs_dir) / run / stage


def run_dir(runs_dir: str | Path, run: str) -> Path:
    check_run_name(run)
    return Path(runs_dir) / run


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


def manifest_sha(folder: Path) -> Optional[str]:
    path = folder / MANIFEST
    return sha256_file(path) if path.is_file() else None


def consumed(folder: Path) -> dict[str, str]:
    """How a stage records a finished stage it read: its manifest's path and sha256."""
    return {"manifest": str(folder / MANIFEST), "sha256": manifest_sha(folder)}


def check_consumed(manifest: dict, name: str, folder: Path, *, who: Path, rerun: str) -> None:
    """Refuse when the stage `name` (now in `folder`) is not the one the stage in `who` read:
    it was run again since, so `who`'s result describes what is no longer there."""
    recorded = manifest.get("inputs", {}).get(name, {}).get("sha256")
    if recorded is None or recorded != manifest_sha(folder):
        when = "changed since" if recorded else "is not recorded as its input (made before inputs were hashed)"
        raise PipelineError(f"{who} was made from {folder}, which {when}; run `{rerun}` again")


def _legacy(stage: str):
    """A stage folder from before markers: it holds our manifest (or plan) of that stage."""
    def adopt(folder: Path) -> bool:
        try:
            return json.loads((folder / MANIFEST).read_text()).get("stage") == stage
        except (OSError, ValueError, AttributeError):
            return (folder / PLAN).is_file()
    return adopt


def own_stage_dir(out: Path, stage: str) -> Path:
    """A stage folder that the stage writes in place (eval): created and marked, or ours already."""
    return own_dir(out, stage, hint="choose another run=<name>", adopt=_legacy(stage))


def check_trained(manifest: dict, folder: Path, generate_dir: Path, run: str, extra: str = "") -> None:
    """A distill or heads stage (in `folder`) still describes the run's generate stage: it was
    trained on that generate manifest, not on one that was run again since."""
    stage = manifest.get("stage", "distill")
    check_consumed(manifest, "generate", generate_dir, who=folder,
                   rerun=f"python -m pipeline stage={stage}{' ' + extra if extra else ''} run={run} "
                         f"{stage}.overwrite=true")


def aside_dir(out: Path) -> Path:
    """Where a stage rebuilds a finished result it will replace: beside it, swapped in at the end."""
    return out.with_name(f".next-{out.name}")


@dataclass
class Claim:
    """Where a stage's run works: `folder` is `out` itself, or the folder beside it when `out`
    holds a finished result that must stay valid until the new one is complete (`aside`)."""

    out: Path
    folder: Path
    done: bool = False
    """`out` already holds the finished result of this plan: nothing to do."""

    @property
    def aside(self) -> bool:
        return self.folder != self.out


def read_plan(folder: Path) -> Any:
    try:
        return json.loads((folder / PLAN).read_text())
    except (OSError, ValueError):
        return None


def is_finished(folder: Path, stage: str) -> bool:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("stage") == stage and manifest.get("status") == "complete"


def claim_stage(out: Path, stage: str, plan: Any, *, overwrite: bool, hint: str = "",
                started: Optional[Callable[[Path], bool]] = None, restart: bool = False) -> Claim:
    """Decide where this run of `stage` (its deciding inputs: `plan`) works, and make that folder ours.

    - `out` finished under this plan: done, left as it is.
    - `out` finished under another plan: refused unless `overwrite`; the new run then works
      aside (resuming there when the aside folder holds this plan, unless `restart`) and
      replaces `out` only when complete (complete_claim), so `out` stays valid meanwhile.
    - `out` unfinished under this plan: resumed in place (`restart`: started afresh).
    - `out` unfinished under another plan: refused when `started(out)` says work was done there,
      unless `overwrite` or `restart`; otherwise started afresh in place.
    `hint` adds the stage's own way out to a refusal.
    """
    key = f"{stage}.overwrite=true"
    recover_replace(out, aside_dir(out))
    own_stage_dir(out, stage)
    finished, same = is_finished(out, stage), read_plan(out) == plan
    if finished and same:
        return Claim(out, out, done=True)
    if finished:
        if not overwrite:
            raise PipelineError(f"{out} holds a finished {stage} stage with another config or data; choose "
                                f"another run=<name> or add {key} (the finished one stays until the new one is "
                                f"complete){hint}")
        folder = aside_dir(out)
        if is_finished(folder, stage) and read_plan(folder) == plan and not restart:
            replace_dir(folder, out)  # killed between finishing aside and swapping it in
            return Claim(out, out, done=True)
        if folder.exists() and (read_plan(folder) != plan or restart):
            remove(folder)
        own_dir(folder, stage)
    else:
        folder = out
        if not same or restart:
            if not same and started is not None and started(out) and not (overwrite or restart):
                raise PipelineError(f"{out} holds an unfinished {stage} stage with another config or data; "
                                    f"choose another run=<name> or add {key} to start it over{hint}")
            for entry in out.iterdir():  # afresh: every entry of our folder but its marker
                if entry.name != MARKER:
                    remove(entry)
    atomic_write_json(folder / PLAN, plan)
    return Claim(out, folder)


def find_claim(out: Path, stage: str, plan: Any) -> Claim:
    """The claim the main process made (claim_stage), as the other processes find it after it."""
    if is_finished(out, stage) and read_plan(out) == plan:
        return Claim(out, out, done=True)
    aside = aside_dir(out)
    return Claim(out, aside if is_finished(out, stage) and read_plan(aside) == plan else out)


def complete_claim(claim: Claim) -> None:
    """Put an aside run's finished folder in place of the old result (see claim_stage)."""
    if claim.aside:
        replace_dir(claim.folder, claim.out)

