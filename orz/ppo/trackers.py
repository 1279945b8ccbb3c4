"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases and MLflow.

Each logs the resolved config and a run name, takes one dict of figures per step, and is closed
once. A resumed run continues the same tracker run: the W&B run id and the MLflow run id are kept
in `output_dir/trackers.json`. wandb and mlflow-skinny are the `trackers` extra; where they send
their data is theirs to decide (WANDB_MODE, WANDB_API_KEY, MLFLOW_TRACKING_URI; without one,
MLflow writes a file store under `output_dir/mlruns`).
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

class TensorBoard:
    def __init__(self, out: Path, **_):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, out: Path, run_name: str, project: str, config: dict, run_id: str | None):
        import wandb

        self.run = wandb.init(project=project, name=run_name, id=run_id, resume="allow", dir=str(out), config=config,
                              settings=wandb.Settings(console="off", silent=True))
        self.id = self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    _BAD_KEY_CHARACTERS = re.compile(r"[^\w\-. :/]")  # what MLflow accepts in a metric or param name

    def __init__(self, out: Path, run_name: str, project: str, config: dict, run_id: str | None):
        import mlflow
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a file store: what mlflow-skinny can write without a server or SQLAlchemy
            uri = (out / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it, in maintenance mode
        self.client = mlflow.MlflowClient(uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            params = [Param(self._key(k), str(v)[:6000]) for k, v in _flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow's limit per batch
                self.client.log_batch(run_id, params=params[start:start + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.id = run_id

    def _key(self, key: str) -> str:
        return self._BAD_KEY_CHARACTERS.sub("_", key)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(self._key(k), v, now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), 1000):
            self.client.log_batch(self.id, metrics=batch[start:start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.id)


def _flatten(config: dict, prefix: str = "") -> dict:
    """{"actor": {"lr": 1e-6}} → {"actor.lr": 1e-6}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def open_trackers(names: list[str], out: Path, run_name: str, project: str, config: dict, resume: bool) -> list:
    """The trackers in `names` (besides jsonl). `resume` continues the runs whose ids
    trackers.json holds; a new run starts new ones (and a new trackers.json)."""
    ids_file = out / "trackers.json"
    ids = json.loads(ids_file.read_text()) if resume and ids_file.exists() else {}
    kinds = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow}
    trackers = {name: kinds[name](out=out, run_name=run_name, project=project, config=config, run_id=ids.get(name))
                for name in names if name != "jsonl"}
    tmp = out / "trackers.json.tmp"
    tmp.write_text(json.dumps({name: t.id for name, t in trackers.items() if hasattr(t, "id")}))
    tmp.replace(ids_file)
    return list(trackers.values())
