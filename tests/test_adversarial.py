"""What an adversarial user tries (issue 21): nothing a user owns is deleted, nothing is dropped
uncounted, and every bad input ends in one line naming the problem."""

from __future__ import annotations

import ast
import fcntl
import json
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import REPO, compose_config, run_cli, write_jsonl
from pipeline import data, distill, export
from pipeline import eval as evaluation
from pipeline.errors import PipelineError
from pipeline.export import load_bundle
from pipeline.models import load_target


def error_line(proc) -> str:
    """The one `error:` line of a failed command (and no traceback)."""
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def base(target_dir, runs_dir, run="x"):
    return ["target=hf", f"target.name_or_path={target_dir}", f"runs_dir={runs_dir}", f"run={run}"]


def generate_args(prompts, *extra):
    return ["data=file", f"data.path={prompts}", "generate.max_new_tokens=6", *extra]


def distill_args(*extra):
    return ["draft.num_layers=1", "draft.init_layers=[0]", "draft.draft_vocab_size=48", "distill.batch_size=2",
            "distill.max_steps=2", *extra]


def eval_args(prompts):
    return ["data=file", f"data.path={prompts}", "eval.max_new_tokens=4", "eval.num_draft_tokens=1",
            "eval.ngram=false"]


@pytest.fixture(scope="module")
def finished(tiny_target_dir, tmp_path_factory):
    """A run x with generate, distill, eval and export finished, copied by the tests that change it."""
    root = tmp_path_factory.mktemp("adversarial")
    prompts = write_jsonl(root / "p.jsonl", [{"id": f"p{i}", "prompt": f"tell me about {i}"} for i in range(6)])
    args = base(tiny_target_dir, root / "runs")
    data.run(compose_config(*args, *generate_args(prompts)))
    distill.run(compose_config(*args, *distill_args(), stage="distill"))
    evaluation.run(compose_config(*args, *eval_args(prompts), stage="eval"))
    export.run(compose_config(*args, stage="export"))
    return root / "runs", prompts


@pytest.fixture
def runs(finished, tmp_path):
    """A copy of the finished runs folder of its own."""
    src, _ = finished
    shutil.copytree(src, tmp_path / "runs")
    return tmp_path / "runs"


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@contextmanager
def read_only(path: Path):
    """`path` unwritable for this user: chmod for a user, the immutable flag for root (whom
    permission bits do not stop)."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("running as root on a file system without chattr +i: cannot make a folder read-only")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


# 1. export.dir deleted whatever folder it named.

def test_export_dir_never_replaces_a_folder_that_is_not_a_bundle(runs, finished, tiny_target_dir, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.txt").write_text("years of work")
    proc = run_cli("stage=export", *base(tiny_target_dir, runs), f"export.dir={notes}", cwd=tmp_path)
    line = error_line(proc)
    assert f"{notes} was not made by specdraft" in line and "export.dir=" in line
    assert (notes / "thesis.txt").read_text() == "years of work"

    before = tree(runs / "x")
    for inside in (runs / "x", runs, runs / "x" / "distill", runs / "x" / "generate" / "dataset"):
        with pytest.raises(PipelineError, match="inside or above the run folder"):
            export.run(compose_config(*base(tiny_target_dir, runs), f"export.dir={inside}", stage="export"))
    other_stage = tmp_path / "elsewhere"  # a stage folder of specdraft outside the run: not a bundle
    shutil.copytree(runs / "x" / "distill", other_stage)
    with pytest.raises(PipelineError, match="is a distill folder of specdraft, not a bundle"):
        export.run(compose_config(*base(tiny_target_dir, runs), f"export.dir={other_stage}", stage="export"))
    assert tree(runs / "x") == before

    bundle = tmp_path / "bundle"  # a bundle of ours is replaced by the new one
    for _ in range(2):
        export.run(compose_config(*base(tiny_target_dir, runs), f"export.dir={bundle}", stage="export"))
    target = load_target(str(tiny_target_dir), device="cpu")
    assert load_bundle(bundle, target).method == "draft_model"


# 2. run= escaped runs/, and generate wiped a folder without plan.json.

def test_run_is_a_name_and_generate_leaves_a_foreign_folder_alone(finished, tiny_target_dir, tmp_path):
    _, prompts = finished
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    for run in ("../../escaped", str(tmp_path / "absolute")):
        proc = run_cli("stage=generate", *base(tiny_target_dir, "runs", run), *generate_args(prompts), cwd=work)
        assert proc.returncode == 2
        assert "is not a run name" in error_line(proc)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "absolute").exists()

    foreign = tmp_path / "projects" / "mine" / "generate"
    foreign.mkdir(parents=True)
    (foreign / "important.txt").write_text("keep me")
    with pytest.raises(PipelineError, match="was not made by specdraft.*choose another run="):
        data.run(compose_config(*base(tiny_target_dir, tmp_path / "projects", "mine"), *generate_args(prompts)))
    with pytest.raises(PipelineError, match="was not made by specdraft"):
        data.run(compose_config(*base(tiny_target_dir, tmp_path / "projects", "mine"),
                                *generate_args(prompts, "generate.overwrite=true")))
    assert (foreign / "important.txt").read_text() == "keep me"


# 3. Re-running a finished distill destroyed it.

def test_a_finished_distill_is_left_as_it_is_and_replaced_only_when_the_new_one_is_complete(
        runs, tiny_target_dir, monkeypatch, capsys):
    args = base(tiny_target_dir, runs)
    folder = runs / "x" / "distill"
    before = tree(folder)
    distill.run(compose_config(*args, *distill_args(), stage="distill"))
    assert "already complete with this config" in capsys.readouterr().out
    assert tree(folder) == before

    with pytest.raises(PipelineError, match=r"another config or data.*distill\.overwrite=true"):
        distill.run(compose_config(*args, *distill_args("distill.max_steps=3"), stage="distill"))
    assert tree(folder) == before

    real, calls = distill.stage.distill_loss, {"n": 0}

    def killed_in_step_two(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # as if the overwriting run were killed
        return real(*a, **kw)

    monkeypatch.setattr(distill.stage, "distill_loss", killed_in_step_two)
    changed = compose_config(*args, *distill_args("distill.max_steps=3", "distill.overwrite=true"), stage="distill")
    with pytest.raises(KeyboardInterrupt):
        distill.run(changed)
    assert tree(folder) == before  # the finished draft is untouched and still finished
    export.run(compose_config(*args, stage="export"))

    monkeypatch.setattr(distill.stage, "distill_loss", real)
    distill.run(changed)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["config"]["distill"]["max_steps"] == 3 and not (runs / "x" / ".next-distill").exists()


# 4. A bundle's provenance went stale.

def test_a_stage_whose_input_was_run_again_is_refused_downstream(runs, finished, tiny_target_dir, tmp_path):
    runs_dir, prompts = finished
    args = base(tiny_target_dir, runs)
    data.run(compose_config(*args, *generate_args(prompts, "generate.max_new_tokens=5", "generate.overwrite=true")))
    stale = r"distill was made from .*generate, which changed since; run `python -m pipeline stage=distill run=x"
    with pytest.raises(PipelineError, match=stale):
        export.run(compose_config(*args, stage="export"))
    with pytest.raises(PipelineError, match=stale):
        evaluation.run(compose_config(*args, *eval_args(prompts), stage="eval"))

    retrained = shutil.copytree(runs_dir, tmp_path / "retrained")  # the draft trained again, not measured again
    args = base(tiny_target_dir, retrained)
    distill.run(compose_config(*args, *distill_args("distill.max_steps=3", "distill.overwrite=true"), stage="distill"))
    with pytest.raises(PipelineError, match=r"eval was made from .*distill, which changed since; run `python -m "
                                            r"pipeline stage=eval run=x`"):
        export.run(compose_config(*args, stage="export"))


# 5. Conversations vanished uncounted.

def test_every_conversation_max_length_drops_is_counted(tiny_target_dir, tmp_path):
    records = [{"id": "long", "prompt": "a very long question " * 20},
               {"id": "two", "messages": [{"role": "user", "content": "short"},
                                          {"role": "user", "content": "then a long follow-up " * 10}]},
               *({"id": f"p{i}", "prompt": f"q {i}"} for i in range(3))]
    prompts = write_jsonl(tmp_path / "p.jsonl", records)
    args = [*base(tiny_target_dir, tmp_path / "runs"), *generate_args(prompts, "generate.max_length=120")]
    out = data.run(compose_config(*args))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_conversations"] == 4
    assert manifest["skipped_records"] == {"too_long_for_max_length": 1}
    assert manifest["cut_turns"] == {"turns_cut_by_max_length": 1}

    proc = run_cli("stage=generate", *base(tiny_target_dir, tmp_path / "runs", "none_fit"),
                   *generate_args(prompts, "generate.max_length=1"), cwd=tmp_path)
    line = error_line(proc)
    assert "no usable records among 5 read (5 too_long_for_max_length)" in line and "generate.max_length" in line


# 6. Tracebacks where one line is promised.

def test_bad_values_end_in_one_line(finished, tiny_target_dir, tmp_path):
    _, prompts = finished
    args = [*base(tiny_target_dir, tmp_path / "runs"), *generate_args(prompts)]
    cases = [
        (["generate.temperature=nan"], "generate.temperature must be a finite number, got nan"),
        (["distill.lr=inf"], "distill.lr must be a finite number, got inf"),
        (["target.device=cuda:9"], "target.device=cuda:9 but"),
        (["target.device=gpu"], "target.device='gpu' is not a device"),
        ([f"data.path={tmp_path}"], f"data file {tmp_path} is a folder"),
    ]
    for extra, want in cases:
        line = error_line(run_cli("stage=generate", *args, *extra, cwd=tmp_path))
        assert want in line, (extra, line)


def test_unwritable_folders_end_in_one_line_and_a_read_only_cache_still_works(finished, tiny_target_dir, tmp_path):
    _, prompts = finished
    locked_runs = tmp_path / "locked_runs"
    locked_runs.mkdir()
    with read_only(locked_runs):
        line = error_line(run_cli("stage=generate", *base(tiny_target_dir, locked_runs), *generate_args(prompts),
                                  cwd=tmp_path))
    assert f"cannot write the run folder {locked_runs / 'x'}" in line and "runs_dir=" in line

    run_folder = tmp_path / "runs" / "ro"
    run_folder.mkdir(parents=True)
    with read_only(run_folder):
        line = error_line(run_cli("stage=generate", *base(tiny_target_dir, tmp_path / "runs", "ro"),
                                  *generate_args(prompts), cwd=tmp_path))
    assert f"cannot write the run folder {run_folder}" in line

    # A cache that is already populated and read-only: the fingerprint of a new target folder
    # cannot be cached there, which costs a re-hash and nothing else.
    cache = tmp_path / "cache"
    load_target(str(tiny_target_dir), device="cpu", cache_dir=str(cache)).fingerprint()
    assert (cache / "fingerprints.json").is_file()
    new_target = shutil.copytree(tiny_target_dir, tmp_path / "target_copy")
    with read_only(cache):
        proc = run_cli("stage=generate", *base(new_target, tmp_path / "runs", "cached"), *generate_args(prompts),
                       cwd=tmp_path, env={"SPECDRAFT_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_cache_that_make_setup_server_made_first_is_ours(tiny_target_dir, tmp_path):
    """`make setup-server` caches llama.cpp's build under the cache folder before any stage ran:
    the pipeline adopts that folder; one holding anything else stays someone else's."""
    from pipeline.errors import PipelineError

    cache = tmp_path / "cache"
    (cache / "llama.cpp" / "0123").mkdir(parents=True)
    load_target(str(tiny_target_dir), device="cpu", cache_dir=str(cache)).fingerprint()
    assert (cache / "fingerprints.json").is_file() and (cache / ".specdraft").is_file()
    from pipeline.models import own_cache

    other = tmp_path / "other"
    (other / "photos").mkdir(parents=True)
    with pytest.raises(PipelineError, match="was not made by specdraft"):
        own_cache(other)


def test_bundle_json_of_the_wrong_type_or_range_is_refused(finished, tiny_target_dir, tmp_path):
    from pipeline.export.bundle import write_checksums

    runs_dir, _ = finished
    target = load_target(str(tiny_target_dir), device="cpu")
    cases = [("num_draft_tokens", -5, "num_draft_tokens must be a positive integer, got -5"),
             ("num_draft_tokens", "three", "num_draft_tokens must be a positive integer, got 'three'"),
             ("num_draft_tokens", True, "num_draft_tokens must be a positive integer"),
             ("format_version", "abc", "format_version must be a positive integer, got 'abc'"),
             ("target", "me", "target must be an object"),
             ("method", ["eagle"], "cannot be loaded")]
    for i, (key, value, want) in enumerate(cases):
        bundle = shutil.copytree(runs_dir / "x" / "export", tmp_path / f"b{i}")
        meta = json.loads((bundle / "bundle.json").read_text())
        meta[key] = value
        (bundle / "bundle.json").write_text(json.dumps(meta))
        write_checksums(bundle)  # the checksums agree: only the schema can refuse it
        with pytest.raises(PipelineError) as refused:
            load_bundle(bundle, target)
        assert f"{bundle / 'bundle.json'}: " in str(refused.value) and want in str(refused.value), str(refused.value)


# 7. Bundles followed symlinks.

def test_a_bundle_with_a_symbolic_link_is_refused(finished, tiny_target_dir, tmp_path):
    runs_dir, _ = finished
    target = load_target(str(tiny_target_dir), device="cpu")
    outside = shutil.copytree(runs_dir / "x" / "export", tmp_path / "outside")

    linked_file = shutil.copytree(outside, tmp_path / "a")
    (linked_file / "draft" / "config.json").unlink()
    (linked_file / "draft" / "config.json").symlink_to(outside / "draft" / "config.json")  # same bytes
    with pytest.raises(PipelineError, match="draft/config.json is a symbolic link"):
        load_bundle(linked_file, target)

    linked_folder = shutil.copytree(outside, tmp_path / "b")
    shutil.rmtree(linked_folder / "eval")
    (linked_folder / "eval").symlink_to(outside / "eval", target_is_directory=True)
    with pytest.raises(PipelineError, match="eval is a symbolic link"):
        load_bundle(linked_folder, target)


# 8. No lock on a run folder.

def test_a_second_writer_on_a_run_gets_one_line(finished, tiny_target_dir, tmp_path):
    _, prompts = finished
    run_folder = tmp_path / "runs" / "busy"
    run_folder.mkdir(parents=True)
    with open(run_folder / ".lock", "w") as held:  # as a running stage holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 (stage generate, since 12:00:00)")
        held.flush()
        proc = run_cli("stage=generate", *base(tiny_target_dir, tmp_path / "runs", "busy"), *generate_args(prompts),
                       cwd=tmp_path)
    line = error_line(proc)
    assert f"{run_folder} is in use by pid 4242 (stage generate" in line and "choose another run=" in line
    assert not (run_folder / "generate").exists()


# How "no deletion of what we did not make" is enforced.

DELETING = {("shutil", "rmtree"), ("shutil", "move"), ("os", "remove"), ("os", "unlink"), ("os", "rmdir"),
            ("os", "removedirs"), ("os", "replace"), ("os", "rename")}
PATH_METHODS = {"unlink", "rmdir", "rename"}


def deleting_calls(source: str) -> list[str]:
    """Calls that delete or rename a path: shutil/os functions, Path methods, and Path.replace
    (one positional argument; str.replace takes two, dataclasses.replace keywords)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr, owner = node.func.attr, node.func.value
        name = owner.id if isinstance(owner, ast.Name) else None
        if (name, attr) in DELETING or (attr in PATH_METHODS and name not in ("os", "shutil")) or (
                attr == "replace" and len(node.args) == 1 and not node.keywords and name != "dataclasses"):
            found.append(f"line {node.lineno}: {ast.unparse(node.func)}")
    return found


def test_every_deletion_goes_through_pipeline_files():
    assert deleting_calls("import shutil\nshutil.rmtree(p)\np.unlink()\nq.replace(r)\n'a'.replace('b', 'c')\n") \
        == ["line 2: shutil.rmtree", "line 3: p.unlink", "line 4: q.replace"]
    offenders = {str(path.relative_to(REPO)): calls for path in sorted((REPO / "pipeline").rglob("*.py"))
                 if path.name != "files.py" and (calls := deleting_calls(path.read_text()))}
    assert offenders == {}


def test_remove_deletes_only_what_specdraft_made(tmp_path):
    from pipeline.files import atomic_dir, own_dir, remove

    foreign = tmp_path / "foreign"
    (foreign / "sub").mkdir(parents=True)
    (foreign / "sub" / "file.txt").write_text("x")
    for path in (foreign, foreign / "sub", foreign / "sub" / "file.txt"):
        with pytest.raises(PipelineError, match="was not made by specdraft"):
            remove(path)
    with pytest.raises(PipelineError, match="was not made by specdraft"):
        with atomic_dir(foreign, "bundle"):
            pass
    assert (foreign / "sub" / "file.txt").read_text() == "x"

    ours = own_dir(tmp_path / "ours", "eval")
    (ours / "report.json").write_text("{}")
    remove(ours / "report.json")  # an entry of a folder of ours
    with atomic_dir(ours / "checkpoint", "checkpoint") as tmp:
        (tmp / "w").write_text("1")
    with atomic_dir(ours / "checkpoint", "checkpoint") as tmp:  # replaced: marked as ours
        (tmp / "w").write_text("2")
    assert (ours / "checkpoint" / "w").read_text() == "2" and not list(ours.glob(".tmp-*"))
    remove(ours)
    assert not ours.exists()
