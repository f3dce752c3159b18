"""`python -m pipeline stage=<name> [overrides]`: the one entry point of every stage."""

from __future__ import annotations

import errno
import importlib
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeline.config import Config, register_configs, to_config
from pipeline.errors import PipelineError

log = logging.getLogger("pipeline")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def _stage(module: str) -> Callable[[Config], Path]:
    """A stage's run(cfg), imported when it runs: the config checks, `--cfg job` and their
    errors answer before torch, transformers and datasets are imported (seconds)."""
    def run(cfg: Config) -> Path:
        return importlib.import_module(module).run(cfg)

    run.__module__, run.__qualname__ = module, "run"  # names the stage's own run()
    return run


# Every stage, in pipeline order.
STAGES: dict[str, Callable[[Config], Path]] = {
    "generate": _stage("pipeline.data"),
    "distill": _stage("pipeline.distill"),
    "heads": _stage("pipeline.heads.stage"),
    "eval": _stage("pipeline.eval"),
    "export": _stage("pipeline.export"),
}
# What `stage=all` runs: a separate draft end to end (export.method draft_model, ngram or auto), or
# with export.method=medusa|eagle|early_exit the heads stage (heads=<that kind>) in place of distill.
ALL = ("generate", "distill", "eval", "export")


def all_stages(method: str, overrides: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """The stages `stage=all` runs for export.method `method`, and the overrides they get."""
    if method in ("draft_model", "ngram", "auto"):  # the distilled draft is trained; auto picks among all
        return ALL, overrides
    chosen = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == "heads"]
    if chosen and chosen[-1] != method:
        fail(f"stage=all exports {method} (export.method) but trains heads={chosen[-1]}; make them the same", code=2)
    extra = [] if chosen else [f"heads={method}"]
    return tuple("heads" if name == "distill" else name for name in ALL), [*overrides, *extra]

register_configs()


def fail(message: str, code: int = 1) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def run_stages(cfg: Config) -> None:
    if cfg.stage == "all":
        # Each stage gets its own defaults (conf/stage/<name>.yaml) under the user's overrides.
        from hydra import compose
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("stage=")]
        names, overrides = all_stages(cfg.export.method, overrides)
        if cfg.eval.engine:  # the run's eval measures the run; the engine checks the bundle after export
            check_engine(cfg.eval.engine, cfg.export.method, cfg.export.gguf)
            overrides = [*overrides, "eval.engine=null"]
        configs = [(name, to_config(compose("config", overrides=[f"stage={name}", *overrides]))) for name in names]
    elif cfg.stage in STAGES:
        configs = [(cfg.stage, cfg)]
    else:
        fail(f"unknown stage {cfg.stage!r}; choose one of: {', '.join([*STAGES, 'all'])}", code=2)
    with run_lock(cfg):
        for name, stage_cfg in configs:
            log.info("stage %s, run %s", name, stage_cfg.run)
            out = STAGES[name](stage_cfg)
            log.info("stage %s finished: %s", name, out)
        if cfg.stage == "all" and cfg.eval.engine:
            evaluated = dict(configs)["eval"]
            check = replace(evaluated, eval=replace(evaluated.eval, engine=cfg.eval.engine, bundle=str(out)))
            log.info("stage eval, run %s: the bundle %s in %s", check.run, out, cfg.eval.engine)
            STAGES["eval"](check)


def check_engine(engine: str, method: str, gguf: Optional[bool]) -> None:
    """stage=all with eval.engine: the engine is there and runs the method, before hours of
    generating and training."""
    from pipeline import llama_cpp
    from pipeline.export.gguf import SPEC_TYPES

    if method not in SPEC_TYPES:
        fail(f"eval.engine={engine} checks the exported draft in llama.cpp, which runs export.method="
             f"{'|'.join(SPEC_TYPES)}, not {method}", code=2)
    if gguf is False:
        fail(f"eval.engine={engine} serves the bundle's gguf/, which export.gguf=false leaves out", code=2)
    if llama_cpp.server_binary() is None or llama_cpp.source() is None:
        fail(f"eval.engine={engine} serves the exported bundle in llama.cpp's llama-server, which is not built: "
             "`make setup-server` builds it (or set eval.engine=null)")


def run_lock(cfg: Config):
    """The run folder's lock, held by the one process that narrates (rank 0) while stages write:
    a second command on the same run gets a one-line error instead of interleaved shards."""
    from contextlib import nullcontext

    from pipeline.files import locked
    from pipeline.runs import run_dir

    if int(os.environ.get("RANK", "0")) > 0:
        return nullcontext()
    return locked(run_dir(cfg.runs_dir, cfg.run), f"stage {cfg.stage}", hint="choose another run=<name>")


# What an OSError means for the user, where it names a path: one line instead of a traceback.
WRITE_ERRORS = {
    errno.EACCES: "make it writable or choose another folder (runs_dir=, SPECDRAFT_CACHE)",
    errno.EPERM: "make it writable or choose another folder (runs_dir=, SPECDRAFT_CACHE)",
    errno.EROFS: "choose a folder on a writable file system (runs_dir=, SPECDRAFT_CACHE)",
    errno.ENOSPC: "free some space or choose another folder (runs_dir=, SPECDRAFT_CACHE)",
    errno.EDQUOT: "free some space or choose another folder (runs_dir=, SPECDRAFT_CACHE)",
}


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(dict_cfg: DictConfig) -> None:
    if OmegaConf.is_missing(dict_cfg, "stage"):
        fail(f"choose a stage: python -m pipeline stage=<{'|'.join([*STAGES, 'all'])}> [overrides]", code=2)
    if int(os.environ.get("RANK", "0")) > 0:
        logging.getLogger().setLevel(logging.WARNING)  # one process narrates; the others only warn
    try:
        cfg = to_config(dict_cfg)
    except Exception as e:  # a __post_init__ check or a missing mandatory value
        fail(f"bad config: {' '.join(str(e).split())}", code=2)
    quiet_library_progress_bars()
    try:
        run_stages(cfg)
    except PipelineError as e:
        fail(str(e))
    except OSError as e:
        if e.errno not in WRITE_ERRORS or not e.filename:
            raise
        fail(f"cannot write {e.filename}: {e.strerror}; {WRITE_ERRORS[e.errno]}")
    _quiet_exit_if_distributed()  # only after success: a crash must keep its traceback and exit code


def _quiet_exit_if_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        # gloo sometimes aborts in its destructor after a clean finish; skip interpreter teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def check_overrides(argv: list[str]) -> None:
    """Compose the config once before Hydra does, to report a bad override in one line.

    Hydra's own report spans several lines; this check covers plain `key=value` overrides
    and leaves anything with Hydra flags (--cfg, --multirun, ...) to Hydra. It also checks,
    before Hydra writes its log into `<runs_dir>/<run>/logs/`, that the run is a name and its
    folder can be written.
    """
    if any(a.startswith("-") for a in argv):
        return
    composed = compose_overrides(argv)
    if composed is None or OmegaConf.is_missing(composed, "stage"):
        return  # main says which stage to choose
    try:
        cfg = to_config(composed)
    except Exception as e:  # a __post_init__ check
        fail(f"bad config: {' '.join(str(e).split())}", code=2)
    check_writable(Path(cfg.runs_dir) / cfg.run)


def check_writable(folder: Path) -> None:
    """The run folder can be created and written (a probe file, created and deleted)."""
    from pipeline.files import remove, temp_file

    try:
        folder.mkdir(parents=True, exist_ok=True)
        remove(temp_file(folder, ".write-check-"))
    except OSError as e:
        fail(f"cannot write the run folder {folder}: {e.strerror or e}; choose a writable runs_dir=<folder>")


def compose_overrides(argv: list[str]) -> Optional[DictConfig]:
    """The config these overrides compose, or a one-line error (exit 2) saying what is wrong."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    overrides = [a for a in argv if not a.startswith("hydra.")]
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
        key = getattr(cause, "full_key", None)
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and key:
            fail(f"unknown config key {key!r} (`python -m pipeline --cfg job` lists every key)", code=2)
        if isinstance(e, MissingConfigException) and e.options is not None:
            group, _, name = (e.missing_cfg_file or "").rpartition("/")
            choices = ", ".join(o for o in e.options if not o.startswith("base_"))
            if group == "stage":
                fail(f"unknown stage {name!r}; choose one of: {choices}", code=2)
            fail(f"no {group} config named {name!r}; choose one of: {choices}", code=2)
        if key:
            fail(f"bad value for {key}: {str(getattr(cause, 'msg', None) or cause).splitlines()[0]}", code=2)
        fail(str(e).splitlines()[0], code=2)
    return None


def quiet_library_progress_bars() -> None:
    """Our own bars report progress; the libraries' per-call bars only bury them."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("httpx").setLevel(logging.WARNING)


def cli() -> None:
    check_overrides(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
