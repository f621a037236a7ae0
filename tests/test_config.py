"""Config composition: every shipped config composes and validates; bad input fails with one message."""

from __future__ import annotations

import warnings

import pytest

from epo_cli.compose import compose
from epo_cli.config import GROUPS, config_dir, group_options, is_sft
from epo_cli.errors import ConfigError

from conftest import REPO, run_cli, run_epo


def shipped_options() -> list[tuple[str, str]]:
    return [(g, o) for g in GROUPS if (config_dir() / g).is_dir() for o in group_options(g)]


#: what a preset leaves to the command line (`${required:...}`): improve_on_teacher and smollm2_rl continue a warm start
PRESET_NEEDS = {"improve_on_teacher": ["model.path=/a/warm/start/final"],
                "smollm2_rl": ["model.path=/a/warm/start/final"],
                # at the default micro-batch (16 rows of 1024 + 64 tokens) its backward can hold ~24 GiB: refused
                # on a machine of 24 GiB (analysis/memory.py), so the option is composed with 4 rows
                "qwen2.5-0.5b-random": ["algo.micro_batch_size=4"]}


#: env options that are a preset of another environment (their env.name is that environment's)
ENV_PRESETS = {"coin_collector": "textworld"}


@pytest.mark.parametrize(("group", "option"), shipped_options())
def test_every_shipped_option_composes(group: str, option: str) -> None:
    cfg = compose([f"{group}={option}", *PRESET_NEEDS.get(option, [])])
    if group in ("algo", "env", "model", "curriculum", "deepspeed", "launcher", "logger"):
        assert cfg[group].name == (ENV_PRESETS.get(option, option) if group == "env" else option)
    if group == "entropy":
        assert cfg.entropy.schedule == option


def test_every_algo_env_pair_composes() -> None:
    for algo in group_options("algo"):
        for env in group_options("env"):
            cfg = compose([f"algo={algo}", f"env={env}"])
            assert cfg.algo.name == algo and cfg.env.name == ENV_PRESETS.get(env, env)
            assert cfg.algo.estimator != "auto"  # resolved at config time, so the saved config says what ran


def test_overrides_reach_typed_fields() -> None:
    cfg = compose(["trainer.total_steps=20", "seed=3", "model.hidden_size=128", "algo=grpo",
                   "algo.entropy_smoothing.alpha=0.05"])
    assert cfg.trainer.total_steps == 20 and cfg.seed == 3 and cfg.model.hidden_size == 128
    # a key grpo.yaml does not spell out is still overridable, because the schema has it
    assert cfg.algo.entropy_smoothing.alpha == 0.05


def test_epo_states_every_setting_and_base_switch() -> None:
    grpo_epo = compose(["algo=epo"])
    assert grpo_epo.algo.estimator == "grpo"
    assert grpo_epo.algo.loss_terms == ["policy_clip", "kl", "entropy", "entropy_smoothing"]
    assert grpo_epo.algo.entropy.mode == "trajectory" and grpo_epo.algo.phase.schedule == "paper"
    assert (grpo_epo.algo.entropy_smoothing.kappa_low, grpo_epo.algo.entropy_smoothing.kappa_high) == (0.0, 2.0)
    ppo_epo = compose(["algo=epo", "algo.base=ppo"])
    assert ppo_epo.algo.estimator == "gae" and "entropy_smoothing" in ppo_epo.algo.loss_terms
    assert compose(["algo=epo_ppo"]).algo.estimator == "gae"


def test_behaviour_cloning_is_an_algorithm_without_an_rl_base() -> None:
    """One rule (config.is_sft) for every place that asks: algo.base=none, whatever the algorithm's name."""
    assert is_sft(compose(["algo=sft"]).algo) and is_sft(compose(["algo=sft", "algo.name=bc"]).algo)
    assert not any(is_sft(compose([f"algo={a}"]).algo) for a in group_options("algo") if a != "sft")
    with pytest.raises(ConfigError, match="algo.base=none trains by behaviour cloning .* algo.estimator=grpo"):
        compose(["algo=grpo", "algo.base=none"])
    with pytest.raises(ConfigError, match="'policy_clip' but algo.estimator=none computes no advantages"):
        compose(["algo=epo", "algo.base=none"])  # its estimator is auto: none without an RL base
    # terms that read what only an RL step computes (the update would fail on the first demonstration)
    for term, what in (("kl", "reference log-probs"), ("entropy_smoothing", "entropy history")):
        with pytest.raises(ConfigError, match=f"'{term}' but algo.base=none .* computes no {what}"):
            compose(["algo=sft", f"algo.loss_terms=[nll,{term}]"])


@pytest.mark.parametrize(("overrides", "needle"), [
    (["trainer.foo=1"], "Unknown config key 'trainer.foo'"),
    (["algo=foo"], "Unknown option 'foo' for config group 'algo'"),
    (["trainer.total_steps=abc"], "Wrong type for config key 'trainer.total_steps'"),
    # OmegaConf alone would read these as true
    (["env=alfworld", "env.cache_pddl=3"], "Wrong type for config key 'env.cache_pddl': 3 is not a bool"),
    (["env=alfworld", "env.expert=yes"], "Wrong type for config key 'env.expert': 'yes' is not a bool"),
    (["rollout.shared_prefill=1"], "Wrong type for config key 'rollout.shared_prefill'"),
    (["algo.loss_terms=[policy_clip,bogus]"], "Valid values: entropy"),
    (["algo.estimator=gea"], "Did you mean 'gae'"),
    (["algo=grpo", "algo.group_size=1"], "needs algo.group_size >= 2"),
    (["entropy.schedule=sine"], "Valid values"),
    # a key renamed to its schedule argument's name: the new name, not the closest old one (kl_start)
    (["algo.phase.beta_start=0.2"], "Unknown config key 'algo.phase.beta_start': it was renamed to algo.phase.start"),
    # renamed for what they are: the turn-decay aggregation's discount, the KL weight's ramp over algo.phase
    (["algo.entropy.decay=0.5"], "Unknown config key 'algo.entropy.decay': it was renamed to algo.turn_decay"),
    (["algo.kl.schedule=two_phase"], "algo.kl.schedule=two_phase was renamed to phase_kl_ramp (a run saved with "
                                     "the old name still loads). Use algo.kl.schedule=phase_kl_ramp."),
])
def test_bad_config_is_one_clear_error(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert needle in str(err.value)
    assert err.value.exit_code == 2


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as err:
        compose(["algo.kl.estimatr=k1"])
    assert "Did you mean 'algo.kl.estimator'" in str(err.value)
    assert "Valid keys in 'algo.kl': coef, estimator" in str(err.value)


@pytest.mark.parametrize("args", [["train", "trainer.foo=1"], ["train", "algo=foo"],
                                  ["train", "trainer.total_steps=abc"], ["config", "show", "env=nowhere"]])
def test_cli_bad_config_exit_2_without_traceback(args: list[str], tmp_path) -> None:
    proc = run_epo(args, cwd=tmp_path, expect=2)
    assert "error:" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "outputs").exists()  # failed before any work started


def test_cli_missing_model_path(tmp_path) -> None:
    proc = run_epo(["train", "model.path=/nonexistent/model", "trainer.total_steps=1"], cwd=tmp_path, expect=1)
    assert "does not exist" in proc.stderr and "model.path" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_help_lists_groups(tmp_path) -> None:
    proc = run_epo(["train", "--help"], cwd=tmp_path)
    for group in ("algo", "env", "model", "entropy", "curriculum", "deepspeed", "launcher", "logger"):
        assert group in proc.stdout
    assert "epo_ppo" in proc.stdout and "household" in proc.stdout


def test_config_show_prints_resolved_yaml(tmp_path) -> None:
    # the real console script (a smoke test of `epo config show`; the other tests here run it in-process)
    proc = run_cli(["config", "show", "algo=epo", "trainer.total_steps=7"], cwd=tmp_path)
    assert "total_steps: 7" in proc.stdout and "estimator: grpo" in proc.stdout


def test_smoothing_that_outweighs_the_bonus_is_warned(tmp_path) -> None:
    """alpha * max beta_k >= 1 turns EPO's soft band into a hard one: allowed, but said once, in one line."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compose(["algo=epo"])  # the paper's alpha = 0.1: 0.1 * 2 < 1
        compose(["algo=epo", "algo.entropy_smoothing.alpha=0.9", "algo.phase.schedule=constant"])  # 0.9 * 1
    with pytest.warns(UserWarning, match=r"alpha \* max beta_k = 0.5 \* 2 >= 1"):
        compose(["algo=epo", "algo.entropy_smoothing.alpha=0.5"])
    # the schedules algo.phase gained with the shared schedule registry are covered too
    with pytest.warns(UserWarning, match=r"alpha \* max beta_k = 0.5 \* 2 >= 1"):
        compose(["algo=epo", "algo.entropy_smoothing.alpha=0.5", "algo.phase.schedule=linear",
                 "algo.phase.start=2", "algo.phase.end=1"])
    proc = run_epo(["config", "show", "algo=epo", "algo.entropy_smoothing.alpha=0.5"], cwd=tmp_path)
    assert proc.stderr.startswith("warning: algo.entropy_smoothing.alpha") and "UserWarning" not in proc.stderr


def test_a_run_saved_with_the_old_phase_keys_still_loads(tmp_path) -> None:
    """algo.phase's value, beta_start, beta_peak and beta_end were renamed after their schedules' arguments
    (coef, start, peak, end): a run saved before is read under the new names, with its values."""
    from omegaconf import OmegaConf

    from epo_cli.compose import load_run_config

    cfg = compose(["algo=epo", "algo.phase.schedule=two_phase", "algo.phase.start=0.3", "algo.phase.coef=1.5"])
    saved = OmegaConf.to_container(cfg, resolve=True)
    phase = saved["algo"]["phase"]
    for old, new in (("value", "coef"), ("beta_start", "start"), ("beta_peak", "peak"), ("beta_end", "end")):
        phase[old] = phase.pop(new)
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    loaded = load_run_config(tmp_path)
    assert OmegaConf.to_container(loaded.algo.phase) == OmegaConf.to_container(cfg.algo.phase)
    assert loaded.algo.phase.start == 0.3 and loaded.algo.phase.coef == 1.5


def test_a_run_saved_with_the_old_kl_ramp_and_turn_decay_names_still_loads(tmp_path) -> None:
    """algo.entropy.decay became algo.turn_decay (another section) and algo.kl.schedule=two_phase became
    phase_kl_ramp: a run saved before is read under the new names, with its values."""
    from omegaconf import OmegaConf

    from epo_cli.compose import load_run_config

    cfg = compose(["algo=epo", "algo.kl.schedule=phase_kl_ramp", "algo.entropy.mode=turn_decay",
                   "algo.turn_decay=0.7"])
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved["algo"]["entropy"]["decay"] = saved["algo"].pop("turn_decay")
    saved["algo"]["kl"]["schedule"] = "two_phase"
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    loaded = load_run_config(tmp_path)
    assert OmegaConf.to_container(loaded.algo) == OmegaConf.to_container(cfg.algo)
    assert loaded.algo.turn_decay == 0.7 and loaded.algo.kl.schedule == "phase_kl_ramp"


def test_conf_ships_in_the_wheel(tmp_path) -> None:
    """An installed wheel must find conf/ without the repository."""
    import subprocess
    import sys
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("epo-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "epo_cli/conf/config.yaml" in names
    assert "epo_cli/conf/algo/epo.yaml" in names and "epo_cli/conf/env/household.yaml" in names
