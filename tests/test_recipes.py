"""The published setups in conf/experiment/paper/ (docs/recipes.md): each composes and validates as written,
and a shrunk copy of each trains one iteration on CPU.

The shrunk copy keeps the recipe's algorithm, estimator, loss terms and their settings, and replaces what
cannot run here: the hub model by model=tiny, ALFWorld/ScienceWorld by the embedded household env (the real
envs need their game files or a JVM and take seconds per reset; the recipes' env settings that household
shares, max_turns and history_length, are overridden too), 8 GPUs by one CPU process (launcher=local,
deepspeed=zero0), and the batch by 2 tasks x at most 2 rollouts of 3 turns with 16-token responses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from epo_cli.compose import compose
from epo_cli.config import config_dir
from epo_cli.errors import ConfigError
from tests.conftest import only_run_dir, run_epo

RECIPES = sorted(f"paper/{p.stem}" for p in (config_dir() / "experiment" / "paper").glob("*.yaml"))


def test_there_are_recipes_for_each_paper_row() -> None:
    names = {r.split("/", 1)[1] for r in RECIPES}
    for env, size in (("alfworld", "3b"), ("sciworld", "7b")):
        for algo in ("grpo", "grpo_epo", "ppo", "ppo_epo"):
            assert f"epo_{env}_{algo}_{size}" in names
    assert {"gigpo_alfworld_1.5b", "gigpo_alfworld_7b"} <= names


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_with_the_papers_settings(recipe: str) -> None:
    cfg = compose([f"experiment={recipe}"])
    assert cfg.model.path.startswith("Qwen/Qwen2.5-")
    assert cfg.launcher.name == "deepspeed" and cfg.launcher.num_gpus >= 2
    assert cfg.rollout.max_prompt_tokens == 2048 and cfg.rollout.max_new_tokens == 512
    # every setting the recipe writes carries a comment naming its source
    text = (config_dir() / "experiment" / f"{recipe}.yaml").read_text()
    body = text.split("\nname:", 1)[1].splitlines()[1:]
    leaves = [line for line in body if ":" in line and not line.rstrip().endswith(":")]
    unsourced = [line for line in leaves if "#" not in line and "save_every" not in line]
    assert not unsourced, f"{recipe}: settings without a source comment: {unsourced}"
    if recipe.endswith("_epo_3b") or recipe.endswith("_epo_7b"):
        assert "entropy_smoothing" in cfg.algo.loss_terms
        assert cfg.algo.entropy_smoothing.alpha == (0.1 if "alfworld" in recipe else 0.05)


def shrunk(recipe: str) -> list[str]:
    group = min(int(compose([f"experiment={recipe}"]).algo.group_size), 2)
    return [f"experiment={recipe}", "model=tiny", "env=household", "env.level=tiny_open_pick_place",
            "env.prompt_template=compact", "env.max_turns=3", "env.history_length=2", "env.eval_splits=[]",
            "launcher=local", "deepspeed=zero0", "algo.tasks_per_step=2", f"algo.group_size={group}",
            "algo.mini_batch_size=8", "algo.micro_batch_size=4", "rollout.max_prompt_tokens=512",
            "rollout.max_new_tokens=16", "trainer.total_steps=1", "trainer.eval_every=0", "trainer.save_every=1",
            "logger.tensorboard=false"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_shrunk_recipe_trains_one_iteration(recipe: str, tmp_path: Path) -> None:
    run_epo(["train", *shrunk(recipe), f"output_dir={tmp_path}"], tmp_path)
    run = only_run_dir(tmp_path)
    text = (run / "config.yaml").read_text()
    assert f"name: paper-{recipe.split('/')[1]}" in text
    assert (run / "final").is_dir()


def test_a_mistyped_recipe_names_the_right_override(tmp_path: Path) -> None:
    proc = run_epo(["config", "show", "experiment=paper/epo_alfworld_grpo_3"], tmp_path, expect=2)
    assert "Did you mean 'experiment=paper/epo_alfworld_grpo_3b'?" in proc.stderr
    assert "paper/gigpo_alfworld_7b" in proc.stderr
    assert "paper/<10 presets>" in " ".join(run_epo(["train", "--help"], tmp_path).stdout.split())  # rich wraps


def test_a_sweep_over_recipes_is_checked_against_the_nested_presets() -> None:
    from epo_cli.launch.sweep import _parse, check_first_job

    check_first_job(_parse(["experiment=paper/gigpo_alfworld_1.5b,paper/gigpo_alfworld_7b", "seed=0,1"]))
    with pytest.raises(ConfigError, match="Unknown option 'paper/gigpo_alfworld_8b'"):
        check_first_job(_parse(["experiment=paper/gigpo_alfworld_1.5b,paper/gigpo_alfworld_8b"]))
