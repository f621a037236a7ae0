"""Range and valid-value validation of every config group (issue 15 item 4).

The bulk runs in-process through `compose_for_train`, the function `epo train` and `epo config show`
use to compose and validate; a few cases go through the real CLI. Every bad value must give one
ConfigError (exit code 2) that names the key (and, for a range, the value and the allowed range).
"""

from __future__ import annotations

import math
import re
import typing
import warnings
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from epo_cli.config import RunConfig, section_schema
from epo_cli.errors import EXIT_CONFIG, ConfigError
from epo_cli.launch.setup import compose_for_train

from conftest import run_epo

# (overrides, key the message must name, further text it must contain)
BAD_VALUES = [
    # algo
    (["algo.lr=0"], "algo.lr", "allowed: 0 < value"),
    (["algo.policy_clip.clip_low=1.5"], "algo.policy_clip.clip_low", "allowed: 0 <= value <= 1"),
    (["algo.policy_clip.dual_clip=0.5"], "algo.policy_clip.dual_clip", "allowed: 1 < value"),
    (["algo=epo", "algo.entropy_smoothing.alpha=-0.1"], "algo.entropy_smoothing.alpha", "-0.1"),
    (["algo=epo", "algo.entropy_smoothing.kappa_low=2.0", "algo.entropy_smoothing.kappa_high=1.0"],
     "kappa_low < kappa_high", "got 2 and 1"),
    (["algo=ppo", "algo.gae.gamma=1.5"], "algo.gae.gamma", "allowed: 0 <= value <= 1"),
    (["algo.monitor.decay=1.0"], "algo.monitor.decay", "allowed: 0 <= value < 1"),
    (["algo.warmup_ratio=2"], "algo.warmup_ratio", "2.0 is out of range"),
    (["algo.ppo_epochs=0"], "algo.ppo_epochs", "allowed: 1 <= value"),
    (["algo=grpo", "algo.group_size=1"], "algo.group_size", ">= 2"),
    (["algo=grpo", "algo.loss_terms=[policy_clip,value]"], "algo.loss_terms", "trains no critic"),
    (["algo.mini_batch_size=10", "algo.micro_batch_size=4"], "algo.mini_batch_size", "divisible"),
    (["algo.entropy.mode=nested"], "algo.entropy.mode", "Valid values"),
    (["algo.kl.estimator=k9"], "algo.kl.estimator", "low_var_kl"),
    (["algo.lr=nan"], "algo.lr", "nan is not a finite number"),
    # env
    (["env.max_turns=0"], "env.max_turns", "allowed: 1 <= value"),
    (["env.history_length=-1"], "env.history_length", "-1 is out of range"),
    (["env.step_timeout_s=0"], "env.step_timeout_s", "allowed: 0 < value"),
    (["env.level=huge"], "env.level", "tiny_open_pick_place"),
    (["env=scienceworld", "env.reward=shaped"], "env.reward", "sparse, dense"),
    (["env=textworld", "env.num_games=0"], "env.num_games", "allowed: 1 <= value"),
    (["env.prompt_template=nope"], "env.prompt_template", "Valid names"),
    # model
    (["model.hidden_size=0"], "model.hidden_size", "allowed: 1 <= value"),
    (["model.hidden_size=65"], "model.hidden_size", "divisible by model.num_attention_heads"),
    (["model.lora.dropout=1.0"], "model.lora.dropout", "allowed: 0 <= value < 1"),
    (["model.dtype=fp16"], "model.dtype", "auto, fp32, bf16"),
    (["model.vocab_size=100"], "model.vocab_size", "allowed: 259 <= value"),
    (["model.padded_vocab_size=512"], "model.padded_vocab_size", "below model.vocab_size"),
    # entropy
    (["entropy.coef=-1"], "entropy.coef", "-1.0 is out of range"),
    (["entropy.decay_rate=0"], "entropy.decay_rate", "allowed: 0 < value <= 1"),
    (["entropy.min_coef=0.1", "entropy.max_coef=0.01"], "entropy.min_coef", "entropy.max_coef"),
    (["entropy.schedule=sawtooth"], "entropy.schedule", "Valid values"),
    # curriculum
    (["curriculum.promote_at=1.5"], "curriculum.promote_at", "allowed: 0 <= value <= 1"),
    (["curriculum.demote_at=0.8"], "curriculum.demote_at", "below curriculum.promote_at"),
    (["curriculum.horizon=true", "curriculum.start_turns=100"], "curriculum.start_turns", "env.max_turns"),
    (["curriculum.adaptive_signal=luck"], "curriculum.adaptive_signal", "progress, closeness"),
    # deepspeed
    (["deepspeed.zero_stage=4"], "deepspeed.zero_stage", "0, 1, 2, 3"),
    (["deepspeed.offload_param=true"], "deepspeed.offload_param", "zero_stage=3"),
    (["deepspeed.offload_optimizer=true"], "deepspeed.offload_optimizer", "zero_stage >= 1"),
    (["deepspeed.precision=fp8"], "deepspeed.precision", "auto, fp32, bf16"),
    # launcher
    (["launcher.master_port=70000"], "launcher.master_port", "allowed: 0 <= value <= 65535"),
    (["launcher.num_nodes=0"], "launcher.num_nodes", "allowed: 1 <= value"),
    (["launcher.timeout_s=-5"], "launcher.timeout_s", "allowed: 0 < value"),
    (["launcher.num_procs=0"], "launcher.num_procs", "allowed: 1 <= value"),
    # logger
    (["logger.wandb.mode=cloud"], "logger.wandb.mode", "online, offline, disabled"),
    # trainer
    (["trainer.total_steps=0"], "trainer.total_steps", "allowed: 1 <= value"),
    (["trainer.save_every=-1"], "trainer.save_every", "allowed: 0 <= value"),
    (["trainer.keep_checkpoints=-1"], "trainer.keep_checkpoints", "-1 is out of range"),
    (["trainer.device=tpu"], "trainer.device", "auto, cpu, cuda"),
    (["trainer.stop_after=0"], "trainer.stop_after", "allowed: 1 <= value"),
    (["trainer.num_threads=0"], "trainer.num_threads", "allowed: 1 <= value"),
    # rollout
    (["rollout.temperature=0"], "rollout.temperature", "allowed: 0.01 <= value"),
    (["rollout.top_p=0"], "rollout.top_p", "allowed: 0 < value <= 1"),
    (["rollout.top_k=-1"], "rollout.top_k", "allowed: 0 <= value"),
    (["rollout.eval_temperature=-0.1"], "rollout.eval_temperature", "allowed: 0 <= value"),
    (["rollout.max_new_tokens=0"], "rollout.max_new_tokens", "allowed: 1 <= value"),
    # top level
    (["seed=-1"], "seed", "allowed: 0 <= value"),
]


def _group(overrides: list[str]) -> str:
    return overrides[-1].split("=")[0].split(".")[0]


def test_the_table_covers_every_config_group() -> None:
    groups = {_group(o) for o, _, _ in BAD_VALUES}
    assert {"algo", "env", "model", "entropy", "curriculum", "deepspeed", "launcher", "logger", "trainer",
            "rollout"} <= groups
    assert len(BAD_VALUES) >= 30


@pytest.mark.parametrize(("overrides", "key", "text"), BAD_VALUES, ids=[" ".join(o) for o, _, _ in BAD_VALUES])
def test_bad_value_is_one_config_error_naming_the_key(overrides: list[str], key: str, text: str) -> None:
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compose_for_train(overrides)
    message = str(info.value)
    assert info.value.exit_code == EXIT_CONFIG
    assert key in message and text in message, message


def test_values_at_the_bounds_are_accepted() -> None:
    cfg, _ = compose_for_train(["algo=grpo", "algo.policy_clip.clip_low=1", "algo.warmup_ratio=0",
                                "launcher.master_port=0", "rollout.eval_temperature=0", "rollout.top_p=1",
                                "trainer.keep_checkpoints=0", "env.history_length=0", "model.vocab_size=259"])
    assert cfg.rollout.eval_temperature == 0.0 and cfg.launcher.master_port == 0


def _numeric(tp: object) -> bool:
    args = typing.get_args(tp) or (tp,)
    return any(a in (int, float) for a in args)


def _schemas() -> list[tuple[str, type]]:
    from epo_cli.envs import ENV_SUITES, env_config_class

    out: list[tuple[str, type]] = []

    def walk(prefix: str, schema: type) -> None:
        out.append((prefix, schema))
        for f in fields(schema):
            nested = section_schema(f)
            if nested is not None and is_dataclass(nested):
                walk(f"{prefix}{f.name}.", nested)

    walk("", RunConfig)
    for name in ENV_SUITES:
        walk(f"env({name}).", env_config_class(name))
    return out


def test_every_numeric_field_declares_its_range() -> None:
    """A new int/float key without bounds next to it fails here (bools are not numbers for this)."""
    missing = []
    for prefix, schema in _schemas():
        hints = typing.get_type_hints(schema)
        for f in fields(schema):
            if _numeric(hints[f.name]) and hints[f.name] is not bool and not (
                    "range" in f.metadata or "choices" in f.metadata):
                missing.append(prefix + f.name)
    assert not missing, f"numeric keys without a declared range: {missing}"


def test_range_text_is_read_from_the_field() -> None:
    from epo_cli.config import RolloutConfig, _in_range, _range_text

    rule = {f.name: f for f in fields(RolloutConfig)}["top_p"].metadata["range"]
    assert _range_text(rule) == "0 < value <= 1"
    assert _in_range(1.0, rule) and not _in_range(0.0, rule) and not _in_range(math.nan, rule)


def test_ignored_settings_are_warned_in_one_line() -> None:
    with pytest.warns(UserWarning, match="stop_after has no effect"):
        compose_for_train(["trainer.total_steps=5", "trainer.stop_after=5"])
    with pytest.warns(UserWarning, match=r"model.hidden_size are ignored"):
        compose_for_train(["model.path=/somewhere/final", "model.hidden_size=128"])


# ---- the same through the real CLI -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize(("args", "key"), [
    (["train", "algo.lr=0"], "algo.lr"),
    (["train", "rollout.temperature=0"], "rollout.temperature"),
    (["config", "show", "deepspeed.zero_stage=4"], "deepspeed.zero_stage"),
    (["train", "algo=epo", "algo.entropy_smoothing.kappa_low=3"], "kappa_low"),
])
def test_cli_bad_value_exits_2_before_any_work(args: list[str], key: str, tmp_path: Path) -> None:
    proc = run_epo([*args, f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, expect=2)
    assert key in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.count("error:") == 1
    assert not (tmp_path / "out").exists()  # nothing was created


def test_a_setting_nothing_reads_is_warned() -> None:
    with pytest.warns(UserWarning, match=r"algo.entropy_smoothing.alpha=0.05: no effect in this run "
                                         r"\('entropy_smoothing' is not in algo.loss_terms\)"):
        compose_for_train(["algo=grpo", "algo.entropy_smoothing.alpha=0.05"])
    with pytest.warns(UserWarning, match=r"algo.value.coef=1.0: no effect .*read only with algo.estimator=gae"):
        compose_for_train(["algo=grpo", "algo.value.coef=1.0"])


@pytest.mark.parametrize("preset", ["algo=sft", "algo=ppo", "algo=grpo", "algo=epo", "algo=epo_ppo",
                                    "algo=gigpo", "experiment=epo_household", "experiment=gigpo_household",
                                    "experiment=entropy_stress", "experiment=warm_start"])
def test_shipped_presets_compose_without_warnings(preset: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compose_for_train([preset])


@pytest.mark.parametrize(("overrides", "text"), [
    (["launcher.num_procs=2"], "launcher.num_procs=2: no effect in this run (launcher=local runs one process"),
    (["launcher.partition=gpu"], "launcher.partition=gpu: no effect"),
    (["model.lora.dropout=0.1"], "model.lora.dropout=0.1: no effect in this run (model.lora.rank=0"),
    (["algo=grpo", "algo.demo_episodes=10"], "algo.demo_episodes=10: no effect in this run (algo=grpo"),
    (["algo=grpo", "algo.demo_slip=0.4"], "algo.demo_slip=0.4: no effect in this run (algo=grpo does not"),
    (["algo=sft", "algo.demos=/some/demos.jsonl", "algo.demo_slip=0.4"],
     "algo.demo_slip=0.4: no effect in this run (algo.demos is a file: its trajectories are the data)"),
    # grpo's loss has no entropy term: lambda (the entropy group) would be silently ignored
    (["algo=grpo", "entropy.coef=0.5"], "entropy.coef=0.5: no effect in this run (lambda weights only"),
])
def test_settings_of_unused_parts_are_warned(overrides: list[str], text: str) -> None:
    with pytest.warns(UserWarning, match=re.escape(text)):
        compose_for_train(overrides)


# ---- settings of a part this run does not use: one warning line each, through `epo config show` ------------

#: (overrides, the warning line; None: no warning at all). The keys a component reads come from its registry
#: entry (epo_cli/algos/registries.py), a coefficient's schedule from the schedule registry, the rest from
#: compose's switches: each row is one member of a class, not a special case.
UNUSED = [
    # a Clip-Cov ratio under the plain PPO clip; used under clip_cov
    (["algo=grpo", "algo.policy_clip.clip_cov_ratio=0.01"],
     "algo.policy_clip.clip_cov_ratio=0.01: no effect in this run (read only with algo.policy_loss=clip_cov)."),
    (["algo=grpo", "algo.policy_loss=clip_cov", "algo.policy_clip.clip_cov_ratio=0.01"], None),
    # GiGPO's step weight under GRPO; used under gigpo
    (["algo=grpo", "algo.gigpo.step_weight=0.5"],
     "algo.gigpo.step_weight=0.5: no effect in this run (read only with algo.estimator=gigpo)."),
    (["algo=gigpo", "algo.gigpo.step_weight=0.5"], None),
    # dynamic-sampling rounds with sampling off; used with it on
    (["algo=grpo", "algo.dynamic_sampling_max_rounds=5", "algo.group_filter=top_variance"],
     "algo.dynamic_sampling_max_rounds=5, algo.group_filter=top_variance: no effect in this run "
     "(algo.dynamic_sampling=false)."),
    (["algo=grpo", "algo.dynamic_sampling=true", "algo.dynamic_sampling_max_rounds=5"], None),
    # the phase gamma under grpo (no entropy_smoothing term for beta_k to weight); used under epo
    (["algo=grpo", "algo.phase.gamma=5"], "algo.phase.gamma=5.0: no effect in this run (beta weights only the "
                                          "'entropy_smoothing' term, and it is not in algo.loss_terms)."),
    (["algo=epo", "algo.phase.gamma=5"], None),
    # overlap with envs stepped in the training process (household); used with env workers
    (["rollout.overlap=true"], "rollout.overlap=True: no effect in this run (env.num_workers=0 steps the envs in "
                               "the training process, so no worker runs meanwhile)."),
    (["env.num_workers=1", "rollout.overlap=true"], None),
    # more of the class: another policy loss's keys, a schedule the section does not use, the KL ramp's
    # replaced coefficient, an estimator's section, turn-decay's decay, a curriculum's keys, switches
    (["algo=grpo", "algo.policy_clip.kl_cov_ratio=0.01"],
     "algo.policy_clip.kl_cov_ratio=0.01: no effect in this run (read only with algo.policy_loss=kl_cov)."),
    (["algo=epo", "algo.phase.peak=0.9"],
     "algo.phase.peak=0.9: no effect in this run (read only with algo.phase.schedule=two_phase)."),
    (["algo=epo", "algo.phase.kl_end=0.9"],
     "algo.phase.kl_end=0.9: no effect in this run (read only with algo.kl.schedule=phase_kl_ramp)."),
    (["algo=epo", "entropy.peak=0.01"], "entropy.peak=0.01: no effect in this run (read only with "
                                        "entropy.schedule=two_phase)."),
    (["algo=epo", "algo.kl.schedule=phase_kl_ramp", "algo.kl.coef=0.5"],
     "algo.kl.coef=0.5: no effect in this run (read only with algo.kl.schedule=constant)."),
    (["algo=ppo", "algo.grpo.mean_over=trajectories"],
     "algo.grpo.mean_over=trajectories: no effect in this run (read only with algo.estimator=gigpo|grpo)."),
    (["algo=epo", "algo.entropy.mode=turn_decay", "algo.turn_decay=0.5"], None),
    (["algo=epo", "algo.turn_decay=0.5"], "algo.turn_decay=0.5: no effect in this run (read only with "
     "algo.policy_clip.aggregation=turn-decay or algo.entropy.mode=turn_decay or "
     "algo.entropy_smoothing.aggregation=turn-decay or algo.kl.aggregation=turn-decay or "
     "algo.nll_aggregation=turn-decay)."),
    (["curriculum.replay_share=0.5"], "curriculum.replay_share=0.5: no effect in this run (read only with "
                                      "curriculum.name=staged)."),
    (["curriculum.start_turns=4"], "curriculum.start_turns=4: no effect in this run (curriculum.horizon=false)."),
    (["algo.monitor.clamp_scale=0.5"], "algo.monitor.clamp_scale=0.5: no effect in this run "
                                       "(algo.monitor.action=warn)."),
    (["env.step_timeout_s=5"], "env.step_timeout_s=5.0: no effect in this run (env.num_workers=0 steps the envs "
                               "in the training process, so no worker runs meanwhile)."),
]


@pytest.mark.parametrize(("overrides", "line"), UNUSED, ids=[" ".join(o) for o, _ in UNUSED])
def test_a_setting_of_a_part_this_run_does_not_use_is_one_warning_line(overrides: list[str], line: str | None,
                                                                        tmp_path: Path) -> None:
    proc = run_epo(["config", "show", *overrides], cwd=tmp_path)
    warned = [w for w in proc.stderr.splitlines() if w.startswith("warning:")]
    assert warned == ([] if line is None else [f"warning: {line}"])


def test_replay_share_of_one_fails_at_config_time() -> None:
    """The curriculum's ranges are CurriculumConfig's alone: replay_share=1.0 (the current level never trained)
    fails when composing, not when the Trainer builds the curriculum."""
    with pytest.raises(ConfigError, match=r"'curriculum.replay_share': 1.0 is out of range; allowed: 0 <= value < 1"):
        compose_for_train(["curriculum=staged", "curriculum.replay_share=1.0"])
