"""Live curves: what train and eval measure, where a user watches a run as it goes.

TensorBoard event files under ``{output_dir}/curves/{run}/{train,eval}`` (``tracking.tensorboard``,
on by default: local files only; ``tensorboard --logdir results/curves``). W&B
(``tracking.wandb.project``; its local files in ``{output_dir}/curves/{run}/wandb``) and MLflow
(``tracking.mlflow.tracking_uri``) only when configured: a configured one that is not installed
stops the job at its start, not after hours. Nothing is sent anywhere unless configured.

The event files are a view of ``train_log.jsonl`` and the eval JSON, which the run keeps (and its
storage holds): ``storage.safe_to_destroy`` does not count them, and a job re-run replaces its own
points (a resumed training from its resume point's step on).
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

CURVES_DIR = "curves"  # under the run's output_dir


def curves_dir(output_dir: str | Path, run: str, stage: str) -> Path:
    return Path(output_dir) / CURVES_DIR / run / stage


def curve_spec(config: dict, run: str, stage: str) -> dict:
    """What a job of ``stage`` (train, eval) needs to open its curves: JSON, so torchrun's ranks get
    it on their command line."""
    tracking = config["tracking"]
    wandb, mlflow = tracking["wandb"], tracking["mlflow"]
    folder = curves_dir(config["output_dir"], run, stage)
    spec = {"name": f"{run}-{stage}", "stage": stage, "folder": str(folder),
            "tensorboard": tracking["tensorboard"],
            "wandb": wandb if wandb["project"] else None,
            "mlflow": mlflow if mlflow["tracking_uri"] else None}
    for service, package in (("wandb", "wandb"), ("mlflow", "mlflow")):
        if spec[service] and importlib.util.find_spec(package) is None:
            raise RuntimeError(f"tracking.{service} is configured but {package} is not installed here: "
                               f"`pip install {package}` in this job's environment, or unset tracking.{service}")
    return spec


class Curves:
    """The writers a job's curves go to (none for ``spec`` None: a job outside the pipeline)."""

    def __init__(self, spec: dict | None, start_step: int = 0, params: dict | None = None):
        """``start_step``: the steps already done and logged (a resumed training's)."""
        self.tensorboard = self.wandb = self.mlflow = None
        spec = spec or {}
        if spec.get("tensorboard"):
            from tensorboardX import SummaryWriter  # optional: its tracker only

            # purge_step: TensorBoard drops this folder's earlier points from that step on. A training
            # resumed after step n redoes the steps after it (its log has the lines up to n); a fresh
            # one (n = 0) replaces every point of an earlier run
            # the suffix: two writers within a second (a quick re-run) would share one file name, and
            # the second would truncate the first's file
            self.tensorboard = SummaryWriter(spec["folder"], purge_step=start_step + 1, flush_secs=30,
                                             filename_suffix=f".{time.time_ns()}")
        if spec.get("wandb"):
            import wandb  # optional: its tracker only

            w, folder = spec["wandb"], Path(spec["folder"]).parent
            folder.mkdir(parents=True, exist_ok=True)
            self.wandb = wandb.init(project=w["project"], entity=w["entity"], mode=w["mode"], name=spec["name"],
                                    group=folder.name, job_type=spec["stage"], config=params, dir=folder,
                                    reinit="create_new")
        if spec.get("mlflow"):
            import mlflow  # optional: its tracker only

            m = spec["mlflow"]
            mlflow.set_tracking_uri(m["tracking_uri"])
            mlflow.set_experiment(m["experiment"] or Path(spec["folder"]).parent.name)
            self.mlflow = mlflow.start_run(run_name=spec["name"])
            if params:
                mlflow.log_params({k: str(v)[:500] for k, v in _flat(params).items()})

    def log(self, step: int, scalars: dict[str, float | None]) -> None:
        scalars = {k: float(v) for k, v in scalars.items() if v is not None}
        if self.tensorboard:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, step)
        if self.wandb:
            self.wandb.log(scalars, step=step)
        if self.mlflow:
            import mlflow  # optional: its tracker only

            mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish()
        if self.mlflow:
            import mlflow  # optional: its tracker only

            mlflow.end_run()

    def __enter__(self) -> Curves:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _flat(params: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def train_scalars(record: dict) -> dict:
    """A ``train_log.jsonl`` line as curves: loss, lr, grad norm, tokens/s, the block's accuracy per
    position and the acceptance it implies."""
    scalars = {f"train/{k}": record.get(k) for k in ("loss", "lr", "grad_norm", "tokens_per_s", "acc",
                                                      "expected_acceptance")}
    scalars.update({f"train/position_acc/{k}": acc for k, acc in enumerate(record["position_acc"], 1)})
    return scalars


def eval_scalars(result: dict) -> dict:
    """The eval JSON as curves at one step: acceptance length per category (tokens per target forward
    and per verify step), trained, untrained and with thinking off, and the acceptance rate per draft
    position overall."""
    scalars = {}
    for prefix, part in (("eval", result), ("eval/untrained", result.get("untrained")),
                         ("eval/thinking_off", result.get("thinking_off"))):
        if not part:
            continue
        for category, e in [("overall", part.get("overall")), *part.get("per_category", {}).items()]:
            if e:
                scalars[f"{prefix}/acceptance_length/{category}"] = e.get("acceptance_length")
                scalars[f"{prefix}/acceptance_length_per_step/{category}"] = e.get("acceptance_length_per_step")
    rates = (result.get("overall") or {}).get("acceptance_rate_per_position") or []
    scalars.update({f"eval/acceptance_rate/position_{k}": r for k, r in enumerate(rates, 1)})
    return scalars


def log_eval(config: dict, run: str, result: dict) -> None:
    """The eval's figures as curves, at the step the drafter was trained to (``train.steps``)."""
    steps = config["train"]["steps"]
    with Curves(curve_spec(config, run, "eval"), steps - 1) as curves:  # an earlier eval's point at steps goes
        curves.log(steps, eval_scalars(result))
