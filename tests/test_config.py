"""Every YAML in conf/ composes against its schema; bad values fail at start."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from pipeline.__main__ import CONF_DIR, STAGES
from conftest import compose_config
from pipeline.config import Config, to_config

GROUPS = ["target", "data", "draft", "heads", "logger", "stage", "experiment"]
# Options whose mandatory value (???) the user must give on the command line.
REQUIRED = {
    "target=hf": ["target.name_or_path=some/model"],
    "data=file": ["data.path=some.jsonl"],
    "draft=pretrained": ["draft.path=some/model"],
}


def group_options() -> list[str]:
    options = []
    for group in GROUPS:
        for path in sorted((Path(CONF_DIR) / group).glob("*.yaml")):
            options.append(f"{group}={path.stem}")
    return options


def test_every_yaml_is_composed_here():
    on_disk = {p.relative_to(CONF_DIR).as_posix() for p in Path(CONF_DIR).rglob("*.yaml")}
    covered = {"config.yaml"} | {f"{o.replace('=', '/')}.yaml" for o in group_options()}
    assert on_disk == covered, "a config folder is missing from GROUPS"


@pytest.mark.parametrize("option", group_options())
def test_yaml_composes(option):
    cfg = compose_config(option, *REQUIRED.get(option, []))
    assert isinstance(cfg, Config)
    group, name = option.split("=")
    if group == "target" and name != "hf":
        assert cfg.target.name_or_path == name


def test_default_config():
    cfg = compose_config()
    assert (cfg.target.name_or_path, cfg.data.source, cfg.data.split, cfg.logger.kind) == (
        "smollm2_135m", "sharegpt", "train", "none")
    assert cfg.run == "default" and cfg.generate.temperature == 0.0


def test_demo_experiment_overrides():
    cfg = compose_config("experiment=demo")
    assert cfg.run == "demo" and cfg.data.limit == 32 and cfg.generate.max_new_tokens == 64
    assert cfg.distill.max_steps == 80 and cfg.eval.max_prompts == 3


@pytest.mark.parametrize("override, message", [
    ("target.dtype=float64", "target.dtype"),
    ("data.split=bogus", "data.split"),
    ("generate.top_p=0", "generate.top_p"),
    ("generate.batch_size=0", "generate.batch_size"),
    ("data.eval_fraction=1.5", "data.eval_fraction"),
    ("logger.kind=tensorboard", "logger.kind"),
    ("distill.loss=mse", "distill.loss"),
    ("distill.onpolicy_fraction=2", "distill.onpolicy_fraction"),
    ("draft.num_layers=0", "draft.num_layers"),
    ("generate.backend=remote", "generate.backend"),
    ("generate.backend=server", "needs generate.server.urls"),
    ("generate.server.urls=[ftp://x]", "is not an http"),
    ("generate.server.concurrency=0", "generate.server.concurrency"),
    ("target.max_memory={cpu:1GiB}", "needs target.device_map=auto"),
    ("target.device_map=balanced", "target.device_map"),
])
def test_invalid_values_fail_validation(override, message):
    with pytest.raises(ValueError, match=message):
        compose_config(override)


def test_max_memory_takes_gpu_indices_and_cpu():
    cfg = compose_config("target.device_map=auto", "target.max_memory={0:70GiB,1:70GiB,cpu:200GiB}")
    assert cfg.target.max_memory == {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}
    with pytest.raises(ValueError, match="not a map of devices to sizes"):
        compose_config("target.device_map=auto", "target.max_memory={gpu0:1GiB}")


def test_missing_mandatory_value_fails():
    with pytest.raises(Exception, match="name_or_path"):
        compose_config("target=hf")


def test_stages_table_is_complete():
    import pipeline

    import importlib

    for name, run in STAGES.items():
        assert callable(run), name
        assert run.__module__.startswith(pipeline.__name__ + ".")
        assert callable(importlib.import_module(run.__module__).run), name  # imported when it runs
    assert "all" not in STAGES  # `all` is the pipeline order, not a stage
    stage_yamls = {p.stem for p in (Path(CONF_DIR) / "stage").glob("*.yaml")}
    assert stage_yamls == {*STAGES, "all"}
    for name in stage_yamls:
        assert compose_config(stage=name).stage == name


def test_each_stage_has_its_own_data_default_and_overrides_win():
    assert compose_config(stage="generate").data.source == "sharegpt"
    assert compose_config(stage="eval").data.source == "mtbench"
    assert compose_config("data=sharegpt", stage="eval").data.source == "sharegpt"


def test_resolved_config_round_trips():
    cfg = compose_config("data=mtbench", "data.limit=8", "run=check")
    again = to_config(OmegaConf.structured(cfg))
    assert again == cfg


@pytest.mark.parametrize("avx512_bf16, amx, want", [(False, False, "fp32"), (True, False, "bf16"), (False, True, "bf16")])
def test_auto_precision_takes_bf16_only_where_the_cpu_has_it(monkeypatch, avx512_bf16, amx, want):
    import torch

    from pipeline.distributed import resolve_precision

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_precision("auto", "cpu") == want
    assert resolve_precision("fp32", "cpu") == "fp32" and resolve_precision("bf16", "cpu") == "bf16"  # as given
    assert compose_config("distill.precision=auto", "heads.target_bf16=null").heads.target_bf16 is None
    with pytest.raises(ValueError, match="distill.precision"):
        compose_config("distill.precision=fp16")
