"""Non-finite and huge numbers are never in range, and a run whose weights turn non-finite stops cleanly.

    every numeric key of the schemas (walked from the dataclasses, every env's too) x {inf, -inf, nan, 1e999,
    a 401-digit int} -> `epo config show KEY=VALUE` exits 2 with one message naming the key
    a run whose update makes the weights nan -> one message naming the step, status failed, the last
    complete checkpoint intact (nothing of the bad step saved), no traceback
    a model folder with nan weights -> refused when loaded (`epo eval`), not a traceback from sampling
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import fields, is_dataclass
from functools import partial
from pathlib import Path

import pytest
import torch

from epo_cli.config import MAX_INT, RunConfig, number_problem, section_schema
from epo_cli.envs import ENV_SUITES, env_config_class

from conftest import SmallConfig, run_epo

HUGE = "9" * 401


def _numeric_keys() -> list[tuple[list[str], str, type]]:
    """(group selection, dotted key, python type) of every int/float field of every schema."""
    out = []

    def walk(prefix: str, schema: type, select: list[str]) -> None:
        hints = typing.get_type_hints(schema)
        for f in fields(schema):
            nested = section_schema(f)
            if nested is not None and is_dataclass(nested):
                walk(f"{prefix}{f.name}.", nested, select)
                continue
            kinds = [a for a in (typing.get_args(hints[f.name]) or (hints[f.name],)) if a in (int, float)]
            if kinds and hints[f.name] is not bool:
                out.append((select, prefix + f.name, kinds[0]))

    walk("", RunConfig, [])
    for name in ENV_SUITES:
        if name != "household":  # household is RunConfig's env
            walk("env.", env_config_class(name), [f"env={name}"])
    unique = {(tuple(s), k): (s, k, t) for s, k, t in out}
    return sorted(unique.values(), key=lambda item: (item[0], item[1]))


NUMERIC_KEYS = _numeric_keys()


def test_the_walk_finds_the_numeric_keys() -> None:
    keys = {k for _, k, _ in NUMERIC_KEYS}
    assert {"algo.lr", "algo.reward_scale", "entropy.coef", "rollout.temperature", "env.step_timeout_s",
            "launcher.timeout_s", "seed", "trainer.total_steps", "algo.policy_clip.clip_cov_lb"} <= keys
    assert len(NUMERIC_KEYS) > 100


def test_number_problem() -> None:
    assert number_problem(math.inf) and number_problem(-math.inf) and number_problem(math.nan)
    assert number_problem(MAX_INT + 1) and number_problem(-(MAX_INT + 1))
    assert number_problem(MAX_INT) is None and number_problem(1e308) is None and number_problem(True) is None


FLOAT_VALUES = ["inf", "nan", "-inf", "1e999", HUGE]
INT_VALUES = ["inf", "nan", HUGE, f"-{HUGE}"]  # an int field refuses inf/nan as a wrong type: exit 2 as well
#: each key with one bad value, the values taken in turn, so every kind of value meets many keys (all kinds
#: on every key would be 5x the commands for the same code path: the check does not depend on the key)
CASES = [(select, key, (FLOAT_VALUES if kind is float else INT_VALUES)[i % (5 if kind is float else 4)])
         for i, (select, key, kind) in enumerate(NUMERIC_KEYS)]


@pytest.mark.parametrize(("select", "key", "value"), CASES,
                         ids=[" ".join([*s, f"{k}={v[:8]}"]) for s, k, v in CASES])
def test_every_numeric_key_refuses_nonfinite_and_huge_values(select: list[str], key: str, value: str,
                                                               tmp_path: Path) -> None:
    proc = run_epo(["config", "show", *select, f"{key}={value}"], cwd=tmp_path, expect=None)
    assert proc.returncode == 2, (key, value, proc.stdout[-300:], proc.stderr[-1000:])
    assert f"'{key}'" in proc.stderr and "Traceback" not in proc.stderr, (key, value, proc.stderr)
    assert proc.stderr.count("error:") == 1, proc.stderr


def test_every_kind_of_bad_number_on_one_float_and_one_int_key(tmp_path: Path) -> None:
    for key, values in (("algo.reward_scale", FLOAT_VALUES), ("trainer.total_steps", INT_VALUES)):
        for value in values:
            proc = run_epo(["config", "show", f"{key}={value}"], cwd=tmp_path, expect=2)
            assert f"'{key}'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_huge_value_is_shown_short_and_named() -> None:
    from epo_cli.errors import ConfigError
    from epo_cli.launch.setup import compose_for_train

    with pytest.raises(ConfigError) as err:
        compose_for_train([f"algo.lr={HUGE}"])
    assert "(401 digits)" in str(err.value) and HUGE not in str(err.value)
    with pytest.raises(ConfigError, match=r"'env.step_timeout_s': inf is not a finite number"):
        compose_for_train(["env.step_timeout_s=inf"])
    with pytest.raises(ConfigError, match=r"'launcher.timeout_s': .* out of range; allowed: 0 < value <= 604800"):
        compose_for_train(["launcher.timeout_s=1e12"])  # finite, but beyond what the timers can hold
    with pytest.raises(ConfigError, match=r"'trainer.num_threads': 1099511627776 is out of range"):
        compose_for_train([f"trainer.num_threads={2**40}"])  # torch takes a C int (an overflow traceback)
    with pytest.raises(ConfigError, match=r"'algo.lr': 1e\+39 is out of range; allowed: 0 < value <= 1"):
        compose_for_train(["algo.lr=1e39"])  # beyond float32: the optimizer's arithmetic overflowed


# ---- weights that turn non-finite -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sft", "rl"])
def test_weights_that_turn_nonfinite_stop_the_run_naming_the_step(kind: str, small_config: SmallConfig,
                                                                   tmp_path: Path, epo_cache: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the cause (here: the update of step 2 writes a nan into one weight), the run stops before
    that step is saved or sampled from: one message naming step 2, status failed, step_1 intact. Behaviour
    cloning and RL updates alike."""
    from epo_cli.training.update import PolicyUpdate

    original = PolicyUpdate.run

    def poisoned(self: PolicyUpdate, batch, coefs, step, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        result = original(self, batch, coefs, step, *args, **kwargs)
        if step == 1:  # step index 1 = the second step
            with torch.no_grad():
                next(self.models.engine.module.parameters()).view(-1)[0] = math.nan
        return result

    monkeypatch.setattr(PolicyUpdate, "run", poisoned)
    run = tmp_path / "run"
    shape = small_config.sft if kind == "sft" else partial(small_config.rl, "algo=grpo")
    proc = run_epo(["train", *shape("trainer.total_steps=4", "trainer.save_every=1"), f"run_dir={run}"],
                   cwd=tmp_path, expect=1)
    assert "Traceback" not in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr[-3000:]
    assert "Training stopped at step 2" in proc.stderr and "non-finite" in proc.stderr
    assert "algo.lr=" in proc.stderr and f"trainer.resume={run}" in proc.stderr
    assert ("algo.reward_scale=" in proc.stderr) == (kind == "rl")  # behaviour cloning has no reward
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "step 2" in status["error"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_1"
    assert (run / "checkpoints" / "step_1" / "COMPLETE").exists()
    assert not (run / "checkpoints" / "step_2").exists()
    assert not (run / "final").exists()


def test_likely_causes_name_this_runs_values() -> None:
    from epo_cli.training.finite import LikelyCauses

    assert LikelyCauses(lr=0.5, grad_clip=0.0, reward_scale=None).text() == (
        "a learning rate too large for this model (algo.lr=0.5; the algo presets suit model=tiny, 0.5B-7B models "
        "want 1e-6..1e-5); no gradient clipping (algo.grad_clip=0)")
    text = LikelyCauses(lr=1e-6, grad_clip=1.0, reward_scale=10.0).text()
    assert "algo.lr=1e-06" in text and "grad_clip" not in text and text.endswith("(algo.reward_scale=10)")


def test_a_model_folder_with_nan_weights_is_refused_when_loaded(tiny_folder: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "diverged"
    shutil.copytree(tiny_folder, folder)
    weights = folder / "model.safetensors"
    state = load_file(str(weights))
    name = sorted(state)[0]
    state[name] = torch.full_like(state[name], math.inf)
    save_file(state, str(weights), metadata={"format": "pt"})
    proc = run_epo(["eval", f"model.path={folder}", "episodes=1", f"output_dir={tmp_path / 'out'}"],
                   cwd=tmp_path, expect=1)
    assert "holds non-finite weights" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_sampling_from_nan_logits_is_one_message() -> None:
    from epo_cli.errors import UserError
    from epo_cli.rollout.generation import SamplingConfig, sample_next

    logits = torch.tensor([[0.0, 1.0], [math.nan, 0.0]])
    for params in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.0)):
        with pytest.raises(UserError, match="hold nan or inf"):
            sample_next(logits, params, None)
    masked = torch.tensor([[0.0, -math.inf]])  # what top-k leaves: still samples
    assert sample_next(masked, SamplingConfig(temperature=1.0), None).tolist() == [0]
