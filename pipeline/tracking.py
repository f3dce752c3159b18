"""Metric logging: wandb (offline unless configured otherwise) or nothing."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)


class Tracker:
    """Logs nothing; the base for `logger=none` and for every non-main process."""

    def log(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        pass

    def log_images(self, images: dict[str, Path]) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbTracker(Tracker):
    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, metrics: dict[str, Any], step: Optional[int] = None) -> None:
        self.run.log(metrics, step=step)

    def log_images(self, images: dict[str, Path]) -> None:
        import wandb

        self.run.log({name: wandb.Image(str(path)) for name, path in images.items()})

    def finish(self) -> None:
        self.run.finish()


def start_tracker(
    kind: str,
    *,
    run_name: str,
    stage: str,
    config: dict[str, Any],
    log_dir: Path,
    project: str = "specdraft",
    entity: Optional[str] = None,
    mode: str = "offline",
    is_main_process: bool = True,
) -> Tracker:
    if kind == "none" or not is_main_process:
        return Tracker()
    import wandb

    log_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project, entity=entity, mode=mode, dir=str(log_dir), config=config,
        name=f"{run_name}/{stage}", group=run_name, job_type=stage, reinit="create_new",
    )
    log.info("wandb run %s (%s mode) in %s", run.name, mode, log_dir)
    return WandbTracker(run)
