"""Logger integrations (W&B offline, MLflow file store) and the non-finite update guard."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from epo_cli.training.engine import GuardedAdamW

from conftest import SmallConfig, metrics_rows, only_run_dir, run_epo

SHORT_SFT = ["train", *SmallConfig().sft("algo.demo_episodes=4")]


def test_guarded_adamw_refuses_a_non_finite_gradient() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = GuardedAdamW([p], lr=0.1, clip_norm=1.0, weight_decay=0.0)
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    opt.step()
    assert opt.last_skipped and torch.equal(p.data, torch.ones(3))  # weights untouched
    p.grad = torch.tensor([3.0, 4.0, 0.0])  # norm 5 -> clipped to 1, then a normal Adam step
    opt.step()
    assert not opt.last_skipped and opt.last_grad_norm == pytest.approx(5.0)
    assert p.data[0] < 1.0 and p.data[2] == 1.0


@pytest.mark.slow
def test_non_finite_updates_stop_the_run_with_a_message(tmp_path: Path, epo_cache: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Force NaN log-probs in the training forward: every update is skipped, the weights never change,
    and after trainer.max_nonfinite_skips consecutive skips the run stops with one clear message."""
    import epo_cli.training.update as update

    real = update.policy_forward

    def poisoned(model, mb, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = real(model, mb, *args, **kwargs)
        if torch.is_grad_enabled():  # the update's forward, not the scoring one
            out.logprobs = out.logprobs * float("nan")
        return out

    monkeypatch.setattr(update, "policy_forward", poisoned)
    proc = run_epo(["train", "algo=grpo", "env.level=tiny_open_pick_place", "env.prompt_template=compact",
                    "env.max_turns=3", "algo.tasks_per_step=1", "algo.group_size=2", "trainer.total_steps=5",
                    "trainer.max_nonfinite_skips=2", "env.eval_splits=[]", "trainer.save_every=1",
                    f"output_dir={tmp_path}"], cwd=tmp_path, expect=1)
    assert "2 consecutive updates had a non-finite loss or gradient" in proc.stderr
    assert "Traceback" not in proc.stderr
    run = only_run_dir(tmp_path)
    rows = metrics_rows(run)
    assert len(rows) == 1 and rows[0]["perf/skipped_updates"] == 1.0  # logged, then stopped in step 2
    # the checkpoint after step 1 holds the initial weights: the skipped update changed nothing
    state = torch.load(run / "checkpoints" / "step_1" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    from transformers import AutoModelForCausalLM

    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.models.tiny import build_tiny

    cfg = compose([])
    initial = AutoModelForCausalLM.from_pretrained(build_tiny(cfg.model, make_suite(cfg.env))).state_dict()
    assert all(torch.equal(state[k], initial[k]) for k in initial if k in state)


@pytest.mark.slow
def test_wandb_offline_and_mlflow_local_store(tmp_path: Path, epo_cache: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # wandb keeps folders in the temp directory for the life of the process (media, artifacts, its
    # service's socket): in this test's own tmp_path, not the session's temp directory
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    run_epo([*SHORT_SFT, "logger=wandb", f"output_dir={tmp_path / 'w'}"], cwd=tmp_path)
    run = only_run_dir(tmp_path / "w")
    offline = list((run / "wandb").glob("offline-run-*"))
    assert offline and any(offline[0].rglob("*.wandb"))
    run_epo([*SHORT_SFT, "logger=mlflow", f"output_dir={tmp_path / 'm'}"], cwd=tmp_path)
    run = only_run_dir(tmp_path / "m")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("epo").experiment_id])
    assert len(runs) == 1 and len(client.get_metric_history(runs[0].info.run_id, "loss.nll")) == 2
