import time

from conftest import compose_config
from pipeline.data import generate
from pipeline.tracking import Tracker, start_tracker


def test_none_logger_logs_nothing(tmp_path):
    tracker = start_tracker("none", run_name="r", stage="s", config={}, log_dir=tmp_path)
    assert type(tracker) is Tracker
    tracker.log({"x": 1})
    tracker.finish()
    assert not any(tmp_path.iterdir())


def test_wandb_offline_records_the_stage_metrics(tiny_target_dir, chat_file, tmp_path):
    cfg = compose_config("target=hf", f"target.name_or_path={tiny_target_dir}", "data=file",
                         f"data.path={chat_file}", f"runs_dir={tmp_path}", "run=w", "logger=wandb",
                         "generate.max_new_tokens=4")
    generate.run(cfg)
    runs = list((tmp_path / "w" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # An offline run keeps its history in the run's .wandb log (protobuf: keys appear verbatim).
    # wandb's service process writes it asynchronously, after finish() returns: wait for it.
    keys = [k.encode() for k in ("generate/num_conversations", "generate/num_generated_tokens",
                                 "generate/tokens_per_s")]
    deadline, history = time.monotonic() + 120, b""
    while time.monotonic() < deadline:
        history = b"".join(p.read_bytes() for p in runs[0].glob("run-*.wandb"))
        if all(k in history for k in keys):
            break
        time.sleep(0.2)
    for key in keys:
        assert key in history, key
