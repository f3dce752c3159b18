"""Files we write, replace and delete: atomically, and only our own.

specdraft deletes or replaces a path only when it made it:
  - a folder that carries our marker file (`.specdraft`, naming its kind: a stage folder, a
    bundle, a cache), written into every folder a stage creates;
  - an entry directly inside such a folder (its manifest, its checkpoint, its shards);
  - a temporary file or folder this process created.
Anything else in the way is a PipelineError naming the path and what to do instead. Every
deletion and rename in `pipeline/` goes through `remove` and `rename` here
(tests/test_adversarial.py fails on any other rmtree, unlink, rename or replace).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from pipeline.errors import PipelineError

MARKER = ".specdraft"
LOCK = ".lock"

_created: set[Path] = set()
"""Temporary files and folders this process made (mkstemp / mkdtemp): always ours to delete."""


def kind_of(folder: Path) -> Optional[str]:
    """The kind our marker gives `folder` (generate, distill, bundle, ...), or None when it has none."""
    try:
        return json.loads((folder / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def mark(folder: Path, kind: str) -> None:
    atomic_write_text(folder / MARKER, json.dumps({"kind": kind, "created_by": "specdraft"}) + "\n")


def _ours(path: Path) -> bool:
    return path in _created or kind_of(path) is not None or kind_of(path.parent) is not None


def _not_ours(path: Path, hint: str) -> PipelineError:
    return PipelineError(f"{path} was not made by specdraft (no {MARKER} marker), so it is left alone; "
                         f"move it away{' or ' + hint if hint else ''}")


def own_dir(folder: Path, kind: str, *, hint: str = "", adopt: Optional[Callable[[Path], bool]] = None) -> Path:
    """`folder`, created and marked as ours (`kind`), or checked to be ours already.

    An existing folder without a marker is adopted when it is empty (nothing to lose) or when
    `adopt` recognises it as ours from before markers existed (e.g. it holds our manifest).
    """
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise PipelineError(f"{folder} is in the way (not a folder of ours); move it away{' or ' + hint if hint else ''}")
    if not folder.exists():
        folder.mkdir(parents=True)
        mark(folder, kind)
        return folder
    have = kind_of(folder)
    if have == kind:
        return folder
    if have is not None:
        raise PipelineError(f"{folder} is a {have} folder of specdraft, not a {kind}; "
                            f"{hint or 'choose another folder'}")
    if not any(folder.iterdir()) or (adopt is not None and adopt(folder)):
        mark(folder, kind)
        return folder
    raise _not_ours(folder, hint)


def remove(path: Path, *, hint: str = "") -> None:
    """Delete a file or folder of ours (see the module docstring); anything else is refused."""
    if not path.exists() and not path.is_symlink():
        return
    if not _ours(path):
        raise _not_ours(path, hint)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()  # a symlink goes, never what it points to
    _created.discard(path)


def rename(src: Path, dst: Path, *, hint: str = "") -> None:
    """Move `src` (ours) to `dst` atomically; a `dst` already there must be ours too (it is replaced)."""
    for path in (src, dst):
        if (path.exists() or path.is_symlink()) and not _ours(path):
            raise _not_ours(path, hint)
    os.replace(src, dst)
    if src in _created:
        _created.discard(src)
        _created.add(dst)


def temp_file(folder: Path, prefix: str, suffix: str = "") -> Path:
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)
    os.close(fd)
    path = Path(name)
    _created.add(path)
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or (path.exists() and not _ours(path)):
        raise _not_ours(path, "")
    tmp = temp_file(path.parent, f".{path.name}.")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _created.discard(tmp)
    finally:
        remove(tmp)


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def replace_dir(new: Path, final: Path, *, hint: str = "") -> None:
    """Make the finished folder `new` (ours) `final`, replacing a `final` of ours.

    Two renames: `final` moves aside to `.old-<name>` first, then `new` takes its place, then
    the old one is deleted; `recover_replace` finishes the job after a kill in between.
    """
    old = final.with_name(f".old-{final.name}")
    remove(old, hint=hint)
    if final.exists() or final.is_symlink():
        if not _ours(final):
            raise _not_ours(final, hint)
        os.replace(final, old)
    os.replace(new, final)
    _created.discard(new)
    remove(old, hint=hint)


def recover_replace(final: Path, new: Path) -> None:
    """After a kill inside replace_dir(new, final): put `new` (complete) in place and drop the old."""
    old = final.with_name(f".old-{final.name}")
    if old.is_dir() and not final.exists() and new.is_dir():
        os.replace(new, final)
    if old.is_dir() and final.exists():
        remove(old)


@contextmanager
def atomic_dir(final: Path, kind: str, *, hint: str = "",
               adopt: Optional[Callable[[Path], bool]] = None) -> Iterator[Path]:
    """Yield a temp folder beside `final`, marked `kind`; it becomes `final` only if the block
    succeeds. An existing `final` is replaced only when it is ours: marked `kind`, adopted by
    `adopt`, or an unmarked entry of a folder of ours."""
    final.parent.mkdir(parents=True, exist_ok=True)
    check_replaceable(final, kind, hint=hint, adopt=adopt)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    _created.add(tmp)
    try:
        mark(tmp, kind)
        yield tmp
        replace_dir(tmp, final, hint=hint)
    finally:
        remove(tmp)


def check_replaceable(final: Path, kind: str, *, hint: str = "",
                      adopt: Optional[Callable[[Path], bool]] = None) -> None:
    """Refuse, before any work, a `final` that atomic_dir(final, kind) could not replace."""
    if not final.exists() and not final.is_symlink():
        return
    have = kind_of(final) if final.is_dir() and not final.is_symlink() else None
    if have == kind or (have is None and final.is_dir() and adopt is not None and adopt(final)):
        return
    if have is not None:
        raise PipelineError(f"{final} is a {have} folder of specdraft, not a {kind}; "
                            f"{hint or 'choose another folder'}")
    if final.is_dir() and not final.is_symlink() and kind_of(final.parent) is not None:
        return  # an entry of a folder of ours from before markers existed
    raise _not_ours(final, hint)


def remove_stale_temp_dirs(folder: Path) -> int:
    """Delete the leftovers of `atomic_dir` blocks whose process was killed (ours only)."""
    stale = [p for p in folder.glob(".tmp-*") if _ours(p)] if folder.is_dir() else []
    for path in stale:
        remove(path)
    return len(stale)


@contextmanager
def locked(folder: Path, what: str, *, hint: str) -> Iterator[None]:
    """Hold `folder`'s lock file while the block runs: a second process gets a one-line error.

    flock is released by the kernel when the process dies, so a killed run leaves no stale lock.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
            raise PipelineError(f"{folder} is in use by {holder}; wait for it to finish or {hint}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({what}, since {time.strftime('%H:%M:%S')})".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock
