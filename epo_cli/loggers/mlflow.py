"""`logger=mlflow`: log to MLflow (a local SQLite store, <run>/mlflow.db, unless tracking_uri is set)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epo_cli.errors import UserError


def start_mlflow(mc: Any, run: Path, config: Any, run_ids: dict[str, str]) -> Any:
    """Start (or, with run_ids["mlflow"] from a checkpoint, resume) the MLflow run of `run`; records its id
    and returns the mlflow module (its log_metrics logs to the active run)."""
    try:
        import mlflow  # optional (epo[loggers]) and slow to import
    except ImportError:
        raise UserError("logger=mlflow needs mlflow: pip install 'epo[loggers]'.") from None
    # default: a local SQLite store in the run directory (MLflow 3 retired the plain file store)
    uri = mc.tracking_uri or f"sqlite:///{(run / 'mlflow.db').resolve()}"
    try:
        return _start(mlflow, mc, uri, run, config, run_ids)
    except Exception as err:  # noqa: BLE001 - MLflow refusing the URI (unknown scheme, no server, bad path)
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        raise UserError(f"MLflow cannot log to {uri} (logger.mlflow.tracking_uri): {type(err).__name__}: {first}. "
                        "Fix the URI (e.g. http://host:5000, sqlite:////path/mlflow.db), or leave it null for a "
                        "store in the run directory.") from None


def _start(mlflow: Any, mc: Any, uri: str, run: Path, config: Any, run_ids: dict[str, str]) -> Any:
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(mc.experiment) is None:
        mlflow.create_experiment(mc.experiment, artifact_location=(run / "mlartifacts").resolve().as_uri())
    mlflow.set_experiment(mc.experiment)
    resumed = "mlflow" in run_ids
    active = mlflow.start_run(run_id=run_ids.get("mlflow"), run_name=run.name)
    run_ids["mlflow"] = active.info.run_id
    if not resumed:  # params are immutable in MLflow: log them once
        flat = _flatten(config)
        mlflow.log_params({k: str(v)[:250] for k, v in list(flat.items())[:200]})
    return mlflow


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix.rstrip(".")] = d
    return out
