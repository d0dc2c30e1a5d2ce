"""Live curves: the event files train and eval write, read back by TensorBoard's own reader."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dflash.core.config import defaults
from dflash.core.curves import curve_spec, log_eval
from dflash.train.stage import train
from tests.test_train import TRAIN_CFG, interrupted_at, shards, tiny_target_dir  # noqa: F401 (fixtures)


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def spec(tmp_path: Path, stage: str) -> dict:
    config = {"output_dir": str(tmp_path / "results"), "tracking": defaults("tracking")}
    return curve_spec(config, "r1", stage)


def logged(checkpoint: Path) -> list[dict]:
    return [json.loads(line) for line in (checkpoint / "train_log.jsonl").read_text().splitlines()]


def test_training_writes_its_log_as_tensorboard_curves(tiny_target_dir, shards, tmp_path):
    cfg = {**TRAIN_CFG, "steps": 6, "log_every": 2}
    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", cfg, curves_spec=spec(tmp_path, "train"))
    folder = tmp_path / "results" / "curves" / "r1" / "train"
    curves, lines = scalars(folder), logged(tmp_path / "out")
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "acc", "expected_acceptance"):
        assert curves[f"train/{key}"] == [(x["step"], pytest.approx(x[key], rel=1e-6)) for x in lines], key
    block = TRAIN_CFG["block_size"]
    assert {f"train/position_acc/{k}" for k in range(1, block)} <= set(curves)
    assert curves["train/position_acc/1"] == [(x["step"], pytest.approx(x["position_acc"][0], rel=1e-6)) for x in lines]
    assert all(x["grad_norm"] > 0 for x in lines)

    # a fresh run into the same folder replaces the earlier run's points, it does not interleave them
    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "again", {**cfg, "seed": 1},
          curves_spec=spec(tmp_path, "train"))
    again = logged(tmp_path / "again")
    assert scalars(folder)["train/loss"] == [(x["step"], pytest.approx(x["loss"], rel=1e-6)) for x in again]
    assert again[0]["loss"] != lines[0]["loss"]


def test_a_resumed_training_keeps_one_point_per_step(tiny_target_dir, shards, tmp_path, monkeypatch):
    cfg = {**TRAIN_CFG, "steps": 9, "log_every": 1, "save_every": 3}
    with pytest.raises(RuntimeError, match="interrupted"):  # steps 1-7 logged, the resume point after 6
        interrupted_at(7, monkeypatch, train, [shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", cfg,
                       curves_spec=spec(tmp_path, "train"))
    assert train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", cfg,
                 curves_spec=spec(tmp_path, "train"))["resumed_from_step"] == 6
    curves = scalars(tmp_path / "results" / "curves" / "r1" / "train")
    assert curves["train/loss"] == [(x["step"], pytest.approx(x["loss"], rel=1e-6))
                                    for x in logged(tmp_path / "out")]
    assert [step for step, _ in curves["train/loss"]] == list(range(1, 10))


def test_eval_writes_acceptance_per_category_at_the_trained_step(tmp_path):
    e = {"acceptance_length": 1.5, "acceptance_length_per_step": 1.8, "acceptance_rate_per_position": [0.6, 0.25]}
    result = {"overall": e, "per_category": {"chat": {**e, "acceptance_length": 1.4}},
              "untrained": {"overall": {**e, "acceptance_length": 1.0}, "per_category": {}},
              "thinking_off": {"overall": {**e, "acceptance_length": 1.2}, "per_category": {}}}
    config = {"output_dir": str(tmp_path / "results"), "tracking": defaults("tracking"), "train": {"steps": 250}}
    log_eval(config, "r1", result)
    log_eval(config, "r1", {**result, "overall": {**e, "acceptance_length": 1.6}})  # the eval re-run: one point
    curves = scalars(tmp_path / "results" / "curves" / "r1" / "eval")
    assert curves["eval/acceptance_length/overall"] == [(250, pytest.approx(1.6))]
    assert curves["eval/acceptance_length/chat"] == [(250, pytest.approx(1.4))]
    assert curves["eval/acceptance_length_per_step/overall"] == [(250, pytest.approx(1.8))]
    assert curves["eval/untrained/acceptance_length/overall"] == [(250, pytest.approx(1.0))]
    assert curves["eval/thinking_off/acceptance_length/overall"] == [(250, pytest.approx(1.2))]
    assert curves["eval/acceptance_rate/position_2"] == [(250, pytest.approx(0.25))]


def test_nothing_is_written_or_sent_unless_configured(tmp_path):
    config = {"output_dir": str(tmp_path / "results"), "tracking": {**defaults("tracking"), "tensorboard": False}}
    assert curve_spec(config, "r1", "train") == {"name": "r1-train", "stage": "train", "tensorboard": False,
                                                 "folder": str(tmp_path / "results" / "curves" / "r1" / "train"),
                                                 "wandb": None, "mlflow": None}


def wandb_history(run_file: Path) -> list[dict]:
    """The history records of an offline W&B run (its .wandb file: a 7-byte header, then LevelDB
    log records of protobuf ``Record``s; a run this small fits in the first 32 KiB block)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B" and len(data) < 32768
    pos, history = 7, []
    while pos + 7 <= len(data):
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if length == 0 and kind == 0:  # the block's zero trailer
            break
        assert kind == 1  # FULL: the whole record in one piece
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data[pos + 7:pos + 7 + length])
        if record.WhichOneof("record_type") == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        pos += 7 + length
    return history


def test_wandb_and_mlflow_get_the_same_curves_when_configured(tiny_target_dir, shards, tmp_path, monkeypatch):
    """A real offline W&B run and a real MLflow store (its local file backend), nothing sent."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store for opt-in use
    monkeypatch.setenv("WANDB_SILENT", "true")
    store = f"file://{tmp_path}/mlruns"
    tracking = {"tensorboard": False, "wandb": {"project": "dflash-test", "entity": None, "mode": "offline"},
                "mlflow": {"tracking_uri": store, "experiment": None}}
    spec = curve_spec({"output_dir": str(tmp_path / "results"), "tracking": tracking}, "r1", "train")
    train([shards[0]], [shards[1]], tiny_target_dir, tmp_path / "out", {**TRAIN_CFG, "steps": 4, "log_every": 2},
          curves_spec=spec)
    lines = logged(tmp_path / "out")

    runs = list((tmp_path / "results" / "curves" / "r1" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    history = [h for h in wandb_history(runs[0]) if "train/loss" in h]
    assert [(h["_step"], h["train/loss"]) for h in history] == [(x["step"], pytest.approx(x["loss"])) for x in lines]

    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("r1")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "r1-train" and run.data.params["lr"] == str(TRAIN_CFG["lr"])
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
        (x["step"], pytest.approx(x["loss"])) for x in lines]
    assert not (tmp_path / "results" / "curves" / "r1" / "train").exists()  # tensorboard: false


def test_a_configured_tracker_that_is_not_installed_stops_the_job_at_its_start(tmp_path, monkeypatch):
    """wandb is installed here (the test above): its absence is made by hiding it from the lookup."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    tracking = {**defaults("tracking"), "wandb": {"project": "p", "entity": None, "mode": None}}
    with pytest.raises(RuntimeError, match=r"tracking\.wandb is configured but wandb is not installed here: "
                                           r"`pip install wandb`"):
        curve_spec({"output_dir": str(tmp_path), "tracking": tracking}, "r1", "train")
