"""The trackers beside metrics.jsonl, offline: TensorBoard's event files, W&B's offline run files
and an MLflow file store are read back. A resumed run continues the same W&B and MLflow runs."""
import json

import pytest

from orz.config import ConfigError, load_config
from orz.run import run_rules
from orz.ppo.metrics_logger import MetricsLogger
from orz.ppo.trackers import open_trackers
from run_history import wandb_records

ALL = ["jsonl", "tensorboard", "wandb", "mlflow"]
CONFIG = {"actor": {"lr": 1e-6, "tp": 2}, "trainer": {"loggers": ALL}, "stages": []}


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the client reading it back, too


def _run(out, steps, resume):
    logger = MetricsLogger(out, open_trackers(ALL, out, "tiny-run", "orz-test", CONFIG, resume),
                           resume_from_step=steps[0] - 1 if resume else -1)
    for step in steps:
        logger.log(step, {"reward/mean": 0.1 * step, "eval/pass@1": 0.5})
    logger.close(plot=False)


def test_every_tracker_logs_config_and_figures_and_a_resume_continues_its_runs(tmp_path):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(tmp_path, [0, 1], resume=False)
    first = json.loads((tmp_path / "trackers.json").read_text())
    _run(tmp_path, [2], resume=True)
    assert json.loads((tmp_path / "trackers.json").read_text()) == first  # the same runs continued

    client = MlflowClient((tmp_path / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("orz-test")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [first["mlflow"]]
    assert runs[0].info.run_name == "tiny-run" and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["actor.lr"] == "1e-06" and runs[0].data.params["actor.tp"] == "2"
    history = client.get_metric_history(first["mlflow"], "reward/mean")
    assert [(m.step, round(m.value, 6)) for m in history] == [(0, 0.0), (1, 0.1), (2, 0.2)]
    assert client.get_metric_history(first["mlflow"], "eval/pass_1")  # '@' is not a valid MLflow name

    ids, names, config, steps = wandb_records(tmp_path)
    assert ids == {first["wandb"]} and names == {"tiny-run"}
    assert config["actor"] == {"lr": 1e-6, "tp": 2}
    assert steps == [0, 1, 2]

    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [0, 1, 2]


def test_a_new_run_starts_new_tracker_runs(tmp_path):
    _run(tmp_path, [0], resume=False)
    first = json.loads((tmp_path / "trackers.json").read_text())
    _run(tmp_path, [0], resume=False)
    second = json.loads((tmp_path / "trackers.json").read_text())
    assert first["wandb"] != second["wandb"] and first["mlflow"] != second["mlflow"]


@pytest.mark.parametrize("loggers,message", [
    ("[jsonl, tensorbord]", r"trainer.loggers: unknown 'tensorbord'; valid: jsonl, tensorboard, wandb, mlflow"),
    ("[tensorboard]", r"trainer.loggers must include 'jsonl'"),
])
def test_bad_loggers_are_refused(loggers, message):
    with pytest.raises(ConfigError, match=message):
        run_rules.check(load_config(None, ["model.path=/m", f"trainer.loggers={loggers}"]))
