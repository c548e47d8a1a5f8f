"""The StageContext a stage gets when it runs inside a pipeline: store staging, MLflow, checkpoints."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flows.run.checkpoint_evals import CheckpointEvals
from flows.store.artifacts import ArtifactStore
from flows.track.tracking import Tracker
from stages.base import Output, check_finite_losses


class FlowContext:
    def __init__(self, *, store: ArtifactStore, tracker: Tracker, run_id: str, cache_key: str, seed: int,
                 device: str, log: logging.Logger | logging.LoggerAdapter, checkpoint_evals: CheckpointEvals | None = None):
        self.store = store
        self.tracker = tracker
        self.run_id = run_id
        self.seed = seed
        self.device = device
        self.cache_dir = store.home / "cache-models"
        self.checkpoint_dir = store.checkpoint_dir(cache_key)
        self.log = log
        self.staging = store.new_staging_dir()
        self.last_metrics: dict[str, float] = {}
        self.checkpoint_evals = checkpoint_evals

    def output_dir(self, name: str) -> Path:
        path = self.staging / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def log_params(self, params: dict[str, Any]) -> None:
        self.tracker.log_params(self.run_id, params)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        check_finite_losses(metrics, step)
        self.last_metrics.update(metrics)
        self.tracker.log_metrics(self.run_id, metrics, step)

    def log_file(self, path: Path, subdir: str = "") -> None:
        self.tracker.log_file(self.run_id, path, subdir)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tracker.set_tags(self.run_id, tags)

    def publish_checkpoint(self, step: int, output: Output) -> None:
        """The model after `step`, published and evaluated beside the training (flows/run/checkpoint_evals.py)."""
        if self.checkpoint_evals is not None:
            self.checkpoint_evals.submit(step, output)
