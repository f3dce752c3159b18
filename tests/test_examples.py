"""The example scripts' `python -m pipeline` lines compose with Hydra: a renamed or mistyped
key fails here, not in a user's cluster job."""

import re
import shlex

import pytest

from conftest import REPO, compose_config

SCRIPTS = sorted((REPO / "examples").rglob("*.sbatch"))
SHELL_VALUES = {"TARGET": "org/model", "DATA": "domain.jsonl", "RUN": "r", "GPUS": "8", "PORT": "8000",
                "HEAD": "node1", "URLS": "[http://node1:8000/v1,http://node2:8000/v1]", "SLURM_NNODES": "2",
                "SLURM_JOB_ID": "1"}


def pipeline_commands(script: str) -> list[list[str]]:
    """The Hydra overrides of each `-m pipeline` command (continued lines joined, shell values
    filled in)."""
    commands = []
    for line in script.replace("\\\n", " ").splitlines():
        if "-m pipeline" in line and not line.lstrip().startswith("#"):
            line = re.sub(r"\$\(\((.*?)\)\)", "128", line)  # shell arithmetic
            line = re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: SHELL_VALUES[m.group(1)], line)
            words = shlex.split(line)
            commands.append(words[words.index("pipeline") + 1 :])
    return commands


def test_there_is_an_example():
    assert SCRIPTS and all(pipeline_commands(p.read_text()) for p in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_pipeline_command_of_an_example_composes(script):
    stages = []
    for overrides in pipeline_commands(script.read_text()):
        cfg = compose_config(*overrides)
        stages.append(cfg.stage)
    assert stages[0] == "generate"
