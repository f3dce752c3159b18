"""The CLI's contract: bad input gives one clear line on stderr and a non-zero exit."""

import json
from pathlib import Path

import pytest

from conftest import run_cli


def error_line(proc) -> str:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


def test_unknown_stage(tmp_path):
    proc = run_cli("stage=distil", cwd=tmp_path)
    assert proc.returncode == 2
    line = error_line(proc)
    assert "unknown stage 'distil'" in line and "generate" in line


def test_missing_stage(tmp_path):
    proc = run_cli(cwd=tmp_path)
    assert proc.returncode == 2
    assert "stage=<" in error_line(proc)


def test_mistyped_key(tmp_path):
    proc = run_cli("stage=generate", "generate.max_new_token=32", cwd=tmp_path)
    assert proc.returncode == 2
    assert "unknown config key 'generate.max_new_token'" in error_line(proc)


def test_unknown_group_option(tmp_path):
    proc = run_cli("stage=generate", "data=mtbenchh", cwd=tmp_path)
    assert proc.returncode == 2
    line = error_line(proc)
    assert "mtbenchh" in line and "mtbench" in line


def test_bad_value_type(tmp_path):
    proc = run_cli("stage=generate", "data.limit=ten", cwd=tmp_path)
    assert proc.returncode == 2
    assert "data.limit" in error_line(proc)


def test_missing_model(tmp_path):
    proc = run_cli("stage=generate", "target=hf", "target.name_or_path=no-such-org/no-such-model",
                   cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1
    line = error_line(proc)
    assert "no-such-org/no-such-model" in line and "not found" in line


def test_missing_local_model_folder(tmp_path):
    proc = run_cli("stage=generate", "target=hf", f"target.name_or_path={tmp_path}/nope", cwd=tmp_path)
    assert proc.returncode == 1
    assert "does not exist" in error_line(proc)


def test_malformed_data_file(tmp_path, tiny_target_dir):
    data = tmp_path / "broken.jsonl"
    data.write_text("{not json\n[1, 2\n")
    proc = run_cli("stage=generate", "target=hf", f"target.name_or_path={tiny_target_dir}",
                   "data=file", f"data.path={data}", cwd=tmp_path)
    assert proc.returncode == 1
    line = error_line(proc)
    assert str(data) in line and "no usable records" in line


def test_missing_data_file(tmp_path, tiny_target_dir):
    proc = run_cli("stage=generate", "target=hf", f"target.name_or_path={tiny_target_dir}",
                   "data=file", f"data.path={tmp_path}/absent.jsonl", cwd=tmp_path)
    assert proc.returncode == 1
    assert "absent.jsonl does not exist" in error_line(proc)


def test_cfg_job_prints_resolved_config(tmp_path):
    proc = run_cli("--cfg", "job", "data=mtbench", "data.limit=8", "run=check", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "source: mtbench" in proc.stdout and "limit: 8" in proc.stdout and "run: check" in proc.stdout


def test_stage_all_runs_every_stage_with_its_own_defaults(tmp_path, tiny_target_dir):
    from conftest import write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"p{i}", "prompt": f"prompt {i}"} for i in range(3)])
    proc = run_cli("stage=all", "target=hf", f"target.name_or_path={tiny_target_dir}", "data=file",
                   f"data.path={data}", "generate.max_new_tokens=4", "eval.max_new_tokens=4",
                   "eval.num_draft_tokens=2", "distill.max_steps=2", "distill.batch_size=2", "run=a", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for stage in ("generate", "distill", "eval"):
        assert (tmp_path / "runs" / "a" / stage / "manifest.json").is_file(), stage
    bundle = tmp_path / "runs" / "a" / "export"
    assert (bundle / "bundle.json").is_file() and (bundle / "SHA256SUMS").is_file()
    assert f"export: bundle -> {Path('runs/a/export')}" in proc.stdout


def test_stage_all_with_heads_trains_the_exported_kind(tmp_path, tiny_target_dir):
    """export.method=medusa: stage=all runs generate -> heads (heads=medusa) -> eval -> export."""
    from conftest import write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": f"p{i}", "prompt": f"prompt {i}"} for i in range(3)])
    proc = run_cli("stage=all", "export.method=medusa", "target=hf", f"target.name_or_path={tiny_target_dir}",
                   "data=file", f"data.path={data}", "generate.max_new_tokens=4", "eval.max_new_tokens=4",
                   "eval.sweep=[1]", "eval.trees=false", "heads.max_steps=2", "heads.batch_size=2",
                   "heads.draft_vocab_size=32", "run=a", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = tmp_path / "runs" / "a"
    assert (runs / "heads" / "medusa" / "manifest.json").is_file() and not (runs / "distill").exists()
    assert json.loads((runs / "export" / "bundle.json").read_text())["method"] == "medusa"
    assert (runs / "export" / "medusa" / "config.json").is_file()


def test_stage_all_refuses_heads_of_another_kind_than_exported():
    from pipeline.__main__ import all_stages

    assert all_stages("draft_model", ["run=a"]) == (("generate", "distill", "eval", "export"), ["run=a"])
    assert all_stages("eagle", ["run=a"]) == (("generate", "heads", "eval", "export"), ["run=a", "heads=eagle"])
    assert all_stages("eagle", ["heads=eagle"])[1] == ["heads=eagle"]
    with pytest.raises(SystemExit):
        all_stages("eagle", ["heads=medusa"])
