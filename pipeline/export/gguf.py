"""GGUF drafts for llama.cpp, written by llama.cpp's own converter.

The converter (`convert_hf_to_gguf.py` with its `conversion/` package and `gguf-py/`) is the one
vendored in llama-cpp-python's source, the llama.cpp that `make setup-server` builds: the
drafts are converted by the code of the engine that runs them, not by a GGUF writer of ours.
`make setup-server` unpacks that source (pipeline/llama_cpp.py).

What llama.cpp runs (`llama-server --spec-type`):
- draft_model: a plain causal LM, `-md draft.gguf --spec-type draft-simple`;
- eagle: an EAGLE-3 head of one plain Llama layer over exactly three target layers,
  `-md eagle3.gguf --spec-type draft-eagle3` (converted with the target as `--target-model-dir`,
  which gives the tokenizer and the target's config);
- not: Medusa heads, early exit, token trees (it drafts chains), EAGLE heads over a target whose
  layer is not a plain Llama layer; prompt lookup needs no file (llama.cpp has its own n-gram
  drafting, `--spec-type ngram-simple`, whose matching rule is not ours).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from pipeline import llama_cpp
from pipeline.errors import PipelineError

GGUF_DIR = "gguf"
SPEC_TYPES = {"draft_model": "draft-simple", "eagle": "draft-eagle3"}
DRAFT_FILES = {"draft_model": "draft.gguf", "eagle": "eagle3.gguf"}
TARGET_FILE = "target.gguf"
SPEC_FLAGS = ("--poll", "0", "--spec-draft-poll", "0")
"""The threads of the target and of the draft sleep when idle instead of spinning on the same
cores: on 2 cores the embedded target with the demo's draft ran at 6.6 tokens/s without them,
38 with them."""


def why_not(kind: str, tree: bool, module, target_config) -> Optional[str]:
    """One line saying why llama.cpp cannot run this draft as it was measured; None if it can."""
    if kind not in SPEC_TYPES:
        return {"ngram": "prompt lookup needs no file; llama-server drafts by n-gram lookup with its own rule "
                         "(--spec-type ngram-simple)",
                "medusa": "llama.cpp has no Medusa heads",
                "early_exit": "llama.cpp has no early-exit self-drafting"}.get(kind, f"llama.cpp cannot run {kind}")
    if tree:
        return "llama.cpp drafts chains, not token trees: export the chain (export.method=" + kind + ")"
    if kind == "eagle":
        layers = list(module.feature_layers)
        if len(layers) != 3:
            return f"llama.cpp's EAGLE-3 reads exactly 3 target layers; this head reads {layers}"
        if getattr(target_config, "model_type", None) != "llama":
            return (f"llama.cpp's EAGLE-3 layer is a plain Llama layer; this head's layer is "
                    f"{getattr(target_config, 'model_type', '?')}'s")
    return None


def convert(model_dir: Path, out_file: Path, outtype: str, target_dir: Optional[Path] = None,
            source: Optional[Path] = None) -> None:
    """Convert the transformers folder `model_dir` to `out_file` with llama.cpp's converter;
    a failure raises with the converter's last line."""
    source = source or llama_cpp.source()
    if source is None:
        raise PipelineError(f"llama.cpp's converter is not installed: `make setup-server` unpacks it "
                            f"(or set {llama_cpp.SOURCE_ENV}=<a llama.cpp source folder>)")
    cmd = [sys.executable, str(source / llama_cpp.CONVERTER), str(model_dir), "--outfile", str(out_file), "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(source / "gguf-py"),
                                                                    os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out_file.is_file():
        raise PipelineError(f"llama.cpp's converter failed on {model_dir}: {llama_cpp.last_line(done.stderr + done.stdout)}")


def source_gguf(name_or_path: str, gguf_file: Optional[str]) -> Optional[Path]:
    """The GGUF file a target was loaded from (an embedded target's, or target.gguf_file), if any."""
    from pipeline.models import EMBEDDED_TARGETS, installed_package_dir

    if name_or_path in EMBEDDED_TARGETS:
        _, import_name, embedded_file = EMBEDDED_TARGETS[name_or_path]
        folder = installed_package_dir(import_name)
        return folder / (gguf_file or embedded_file) if folder is not None else None
    return Path(name_or_path).expanduser() / gguf_file if gguf_file else None


def write_gguf(kind: str, folder: Path, draft_dir: Path, target, target_gguf: Optional[Path], outtype: str,
               num_draft_tokens: int) -> dict:
    """`folder`/gguf/: the draft converted from the transformers folder `draft_dir` (the bundle's
    draft/ or eagle3/) and the target it runs with (the GGUF the target came from, copied, or
    its folder converted at `outtype`). Returns bundle.json's `llama_cpp` entry."""
    out = folder / GGUF_DIR
    out.mkdir()
    draft_file = out / DRAFT_FILES[kind]
    convert(draft_dir, draft_file, outtype, target_dir=target.folder if kind == "eagle" else None)
    if target_gguf is not None:
        shutil.copy2(target_gguf, out / TARGET_FILE)
        target_from = f"the GGUF the target was loaded from ({target_gguf.name})"
    else:
        convert(target.folder, out / TARGET_FILE, outtype)
        target_from = f"the target's folder converted at {outtype}"
    command = (f"llama-server -m {GGUF_DIR}/{TARGET_FILE} -md {GGUF_DIR}/{draft_file.name} "
               f"--spec-type {SPEC_TYPES[kind]} --spec-draft-n-max {num_draft_tokens} {' '.join(SPEC_FLAGS)}")
    return dict(folder=GGUF_DIR, draft=f"{GGUF_DIR}/{draft_file.name}", target=f"{GGUF_DIR}/{TARGET_FILE}",
                target_from=target_from, outtype=outtype, spec_type=SPEC_TYPES[kind],
                num_draft_tokens=num_draft_tokens, command=command)
