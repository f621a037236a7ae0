"""A run builds its env suite once: `epo train` hands the one suite down to the run directory (package
versions), the trainer, the curriculum and the env pool, which tells each env whether its expert is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from epo_cli.envs.household import HouseholdSuite

from conftest import SmallConfig, run_epo


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["sft", "grpo"])
def test_a_training_run_builds_one_env_suite(algo: str, tmp_path: Path, epo_cache: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[object] = []
    original = HouseholdSuite.__init__

    def counting(self: HouseholdSuite, cfg: object) -> None:
        built.append(cfg)
        original(self, cfg)

    monkeypatch.setattr(HouseholdSuite, "__init__", counting)
    small = SmallConfig()
    args = small.sft() if algo == "sft" else small.rl("algo=grpo", "trainer.total_steps=1", "algo.group_size=2",
                                                       "algo.tasks_per_step=1", "env.max_turns=2",
                                                       "curriculum=staged")  # the curriculum asks the suite too
    run_epo(["train", *args, f"output_dir={tmp_path}"], cwd=tmp_path)
    assert len(built) == 1  # (env workers unpickle the suite: no second construction)
