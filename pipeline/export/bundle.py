"""The bundle: a draft matched to one target, with the facts that make it safe to serve.

Layout (`runs/<run>/export/` or export.dir):
  bundle.json   method (a kind: ngram, draft_model, medusa, eagle, early_exit), tree (verified
                as a token tree of num_draft_tokens nodes), num_draft_tokens, the target's name and
                fingerprint, tau and speedup
                measured by eval, the training data and run, package versions, formats, and
                provenance: the sha256 of the generate, training and eval manifests it came from
  draft/        (method draft_model) the draft as a plain HF save_pretrained folder
                (safetensors, config.json, tokenizer files): transformers' assistant_model=, a
                vLLM/SGLang draft model; draft_vocab.safetensors beside it lets our decoder
                compute only its rows
  heads/        (method medusa, eagle, early_exit) heads.safetensors + heads_config.json, the
                trained weights and draft vocabulary; the rest is rebuilt from the target
  medusa/       (method medusa) the Medusa-1 layout (heads/formats.py)
  eagle3/       (method eagle) the EAGLE-3 layout (LlamaForCausalLMEagle3; heads/formats.py)
  speculators/  (method eagle) the same head in vLLM's speculators layout
                (method ngram) no weights: bundle.json's draft holds ngram_max and ngram_min
  gguf/         (draft_model, eagle: what llama.cpp runs) the draft converted by llama.cpp's own
                converter (draft.gguf or eagle3.gguf) and the target GGUF it runs with
                (target.gguf); bundle.json's llama_cpp gives the llama-server command line
  eval/         the eval report (report.json, report.md) and plots the numbers come from
  README.md     a model card written from the above
  SHA256SUMS    sha256 of every other file, in `sha256sum -c` format

Loading checks every checksum, that no file was added, that nothing in it is a symbolic link
(a bundle holds its own files), bundle.json's keys, types and ranges, and the target's
fingerprint, and reads weights from safetensors only: nothing is unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import os
import re

import torch

from pipeline.config import METHODS
from pipeline.errors import PipelineError
from pipeline.files import atomic_write_json, atomic_write_text
from pipeline.kinds import KINDS, NgramSettings
from pipeline.models import Target
from pipeline.runs import sha256_file

BUNDLE_JSON = "bundle.json"
CHECKSUMS = "SHA256SUMS"
FORMAT_VERSION = 1


@dataclass
class Bundle:
    path: Path
    meta: dict[str, Any]
    draft: Optional[torch.nn.Module | NgramSettings]
    """The draft model (method draft_model), the head module (medusa, eagle, early_exit) or
    prompt lookup's settings (ngram)."""

    @property
    def method(self) -> str:
        return self.meta["method"]

    @property
    def tree(self) -> bool:
        return bool(self.meta.get("tree", False))

    @property
    def num_draft_tokens(self) -> int:
        return int(self.meta["num_draft_tokens"])


def bundle_files(folder: Path) -> list[str]:
    """Every file below `folder` but the checksum list, as sorted relative POSIX paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def write_checksums(folder: Path) -> None:
    lines = [f"{sha256_file(folder / rel)}  {rel}\n" for rel in bundle_files(folder)]
    atomic_write_text(folder / CHECKSUMS, "".join(lines))


def record_engine(folder: Path, engine: str, result: dict) -> None:
    """bundle.json's engines.<engine>: what a serving engine measured with this bundle (eval.engine);
    the checksums are written again after it."""
    meta = read_bundle_json(folder)
    meta.setdefault("engines", {})[engine] = result
    atomic_write_json(folder / BUNDLE_JSON, meta)
    write_checksums(folder)


def check_no_links(folder: Path) -> None:
    """A symbolic link in a bundle would make it depend on files outside it, which no checksum covers."""
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs + files):
            path = Path(root) / name
            if path.is_symlink():
                raise PipelineError(f"bundle {folder}: {path.relative_to(folder).as_posix()} is a symbolic link; "
                                    "a bundle holds its own files (copy them in, or export again)")


def verify_checksums(folder: Path) -> None:
    """No symbolic link, every listed file exists with its sha256, and no file is unlisted; else
    a one-line error."""
    check_no_links(folder)
    listing = folder / CHECKSUMS
    if not listing.is_file():
        raise PipelineError(f"{folder} is not a bundle: {CHECKSUMS} is missing")
    want = {}
    for number, line in enumerate(listing.read_text().splitlines(), 1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64 or not rel or rel.startswith("/") or ".." in Path(rel).parts:
            raise PipelineError(f"{listing}: line {number} is not '<sha256>  <relative path>'")
        want[rel] = digest
    missing = [rel for rel in want if not (folder / rel).is_file()]
    if missing:
        raise PipelineError(f"bundle {folder}: file {missing[0]} is missing ({len(missing)} missing in all)")
    extra = [rel for rel in bundle_files(folder) if rel not in want]
    if extra:
        raise PipelineError(f"bundle {folder}: file {extra[0]} is not in {CHECKSUMS} (added after export?)")
    for rel, digest in want.items():
        if sha256_file(folder / rel) != digest:
            raise PipelineError(f"bundle {folder}: checksum mismatch for {rel} (the file was changed after export)")


def read_bundle_json(folder: Path) -> dict[str, Any]:
    import json

    path = folder / BUNDLE_JSON
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PipelineError(f"cannot read {path}: {e}") from None
    check_bundle_meta(meta, path)
    return meta


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_bundle_meta(meta: Any, path: Path) -> None:
    """bundle.json's schema: the keys loading reads, of the right types and in range."""
    if not isinstance(meta, dict):
        raise PipelineError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    for key in ("format_version", "method", "num_draft_tokens", "target"):
        if key not in meta:
            raise PipelineError(f"{path} has no key {key!r}")
    version = meta["format_version"]
    if not _positive_int(version):
        raise PipelineError(f"{path}: format_version must be a positive integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise PipelineError(f"{path} has format_version {version}; this specdraft reads "
                            f"up to {FORMAT_VERSION}: upgrade specdraft")
    if not isinstance(meta["method"], str) or meta["method"] not in METHODS:
        raise PipelineError(f"{path}: method {meta['method']!r} cannot be loaded by this specdraft "
                            f"({', '.join(METHODS)})")
    if not isinstance(meta.get("tree", False), bool) or (meta.get("tree") and not KINDS[meta["method"]].trees):
        raise PipelineError(f"{path}: tree must be true or false (and true only for "
                            f"{', '.join(n for n, k in KINDS.items() if k.trees)}), got {meta.get('tree')!r}")
    if not _positive_int(meta["num_draft_tokens"]):
        raise PipelineError(f"{path}: num_draft_tokens must be a positive integer, got {meta['num_draft_tokens']!r}")
    target = meta["target"]
    if not isinstance(target, dict) or not isinstance(target.get("name"), str):
        raise PipelineError(f"{path}: target must be an object with a name and a fingerprint")
    if not isinstance(target.get("fingerprint"), str) or not re.fullmatch(r"[0-9a-f]{64}", target["fingerprint"]):
        raise PipelineError(f"{path}: target.fingerprint must be a sha256 (64 hex digits), "
                            f"got {target.get('fingerprint')!r}")
    if meta["method"] == "ngram":
        draft = meta.get("draft")
        lengths = [draft.get(k) for k in ("ngram_max", "ngram_min")] if isinstance(draft, dict) else [None, None]
        if not all(map(_positive_int, lengths)) or lengths[1] > lengths[0]:
            raise PipelineError(f"{path}: an ngram bundle's draft needs ngram_max >= ngram_min >= 1, got {draft!r}")


def load_bundle(path: str | Path, target: Target, fingerprint: Optional[str] = None) -> Bundle:
    """A bundle's draft, ready for our decoder, after every check passed: no symbolic link,
    checksums (no file changed, missing or added), bundle.json's schema, the target's
    fingerprint, safetensors only."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise PipelineError(f"bundle folder {folder} does not exist")
    verify_checksums(folder)
    meta = read_bundle_json(folder)
    want = meta["target"]["fingerprint"]
    have = fingerprint or target.fingerprint()
    if want != have:
        raise PipelineError(f"bundle {folder} was made for target {meta['target'].get('name')!r} (fingerprint "
                            f"{str(want)[:12]}…), not this one ({target.name!r}, {have[:12]}…)")
    kind = KINDS[meta["method"]]
    if kind.load is None:
        draft = NgramSettings(meta["draft"]["ngram_max"], meta["draft"]["ngram_min"])
    else:
        draft = kind.load(folder / kind.bundle_folder, target)
    return Bundle(path=folder, meta=meta, draft=draft)
