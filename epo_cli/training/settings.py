"""The one place in training/ where the composed run config becomes settings.

`cut_settings(cfg, dist)` reads the config once and returns every part's frozen settings (`RunSettings`);
each settings class lives beside the part that reads it (PolicyUpdateSettings in update.py, ...), and no part
of training/ besides this module and the Trainer's constructor receives the config. A test or a benchmark
builds a part from its settings alone (`dataclasses.replace` changes one field before the part is built).

    settings = cut_settings(cfg, dist)
    update = PolicyUpdate(settings.update, dist, models, loss_stack, value_term)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from epo_cli.algos.entropy import EntropyHistory, FluctuationMonitor
from epo_cli.algos.schedules import build_entropy_schedule
from epo_cli.config import RolloutConfig, is_sft
from epo_cli.runtime.deepspeed_config import deepspeed_config
from epo_cli.training.collapse import CollapseSettings
from epo_cli.training.engine import DistInfo, EngineSettings
from epo_cli.training.entropy_control import EntropyControl
from epo_cli.training.evaluate import TrainingEvalSettings
from epo_cli.training.finite import LikelyCauses
from epo_cli.training.group_sampler import GroupSamplerSettings
from epo_cli.training.models import ModelSettings
from epo_cli.training.sft import DemoSettings
from epo_cli.training.update import PolicyUpdateSettings


@dataclass(frozen=True)
class LoopSettings:
    """What the Trainer's own loop reads after construction (trainer.*, and the run's identity)."""

    seed: int  # the run's seed: this process's RNGs
    algo: str  # algo.name: a checkpoint records it, a resume checks it
    sft: bool  # behaviour cloning (sft_step) instead of rl_step
    total_steps: int  # trainer.total_steps
    stop_after: int | None  # trainer.stop_after: stop (with a checkpoint) after this many steps
    save_every: int  # trainer.save_every (0: only the last step and stops)
    keep_checkpoints: int  # trainer.keep_checkpoints
    best_metric: str | None  # trainer.best_metric: the checkpoint kept as best
    max_nonfinite_skips: int  # trainer.max_nonfinite_skips: skipped updates in a row before the run stops
    num_threads: int  # trainer.num_threads
    deterministic: bool  # trainer.deterministic
    max_turns: int  # env.max_turns: the entropy statistics' turn slots (a curriculum may allow more)
    clamp_scale: float  # algo.monitor.clamp_scale: the entropy terms' scale while the monitor clamps


@dataclass(frozen=True)
class RunSettings:
    """Every part's settings for one run, cut once (`cut_settings`)."""

    loop: LoopSettings
    models: ModelSettings
    update: PolicyUpdateSettings
    sampler: GroupSamplerSettings
    evaluation: TrainingEvalSettings
    collapse: CollapseSettings
    likely_causes: LikelyCauses
    demos: DemoSettings | None  # behaviour cloning only


def cut_settings(cfg: DictConfig, dist: DistInfo) -> RunSettings:
    """Every part's settings from run config `cfg` on this process's world `dist` (ConfigError: the batch
    sizes do not fit the world size)."""
    sft = is_sft(cfg.algo)
    return RunSettings(loop_settings(cfg), model_settings(cfg, dist), update_settings(cfg), sampler_settings(cfg),
                       evaluation_settings(cfg), collapse_settings(cfg), likely_causes(cfg),
                       demo_settings(cfg) if sft else None)


def loop_settings(cfg: Any) -> LoopSettings:
    trainer = cfg.trainer
    return LoopSettings(
        seed=cfg.seed, algo=cfg.algo.name, sft=is_sft(cfg.algo), total_steps=trainer.total_steps,
        stop_after=trainer.stop_after, save_every=trainer.save_every, keep_checkpoints=trainer.keep_checkpoints,
        best_metric=trainer.best_metric, max_nonfinite_skips=trainer.max_nonfinite_skips,
        num_threads=trainer.num_threads, deterministic=bool(trainer.deterministic), max_turns=cfg.env.max_turns,
        clamp_scale=cfg.algo.monitor.clamp_scale)


def engine_settings(cfg: Any, dist: DistInfo) -> EngineSettings:
    return EngineSettings(deepspeed_config(cfg, dist.world_size, dist.device.type), cfg.deepspeed.zero_stage,
                          cfg.deepspeed.activation_checkpointing, cfg.algo.grad_clip)


def rollout_settings(cfg: Any) -> RolloutConfig:
    """The rollout section as plain data (the schema's dataclass, not the config node)."""
    return OmegaConf.to_object(cfg.rollout)


def model_settings(cfg: Any, dist: DistInfo) -> ModelSettings:
    algo = cfg.algo
    return ModelSettings(
        model=OmegaConf.to_object(cfg.model), max_prompt_tokens=cfg.rollout.max_prompt_tokens,
        max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.seed, pack_tokens=algo.pack_tokens,
        reference="kl" in algo.loss_terms, critic=algo.estimator == "gae", lr=algo.lr,
        weight_decay=algo.weight_decay, critic_lr=algo.value.lr or algo.lr, engine=engine_settings(cfg, dist),
        rollout=rollout_settings(cfg))


def update_settings(cfg: Any) -> PolicyUpdateSettings:
    algo = cfg.algo
    return PolicyUpdateSettings(
        seed=cfg.seed, temperature=cfg.rollout.temperature, sft=is_sft(algo), ppo_epochs=algo.ppo_epochs,
        mini_batch_size=algo.mini_batch_size, micro_batch_size=algo.micro_batch_size,
        pack_tokens=algo.pack_tokens, lr=algo.lr, critic_lr=algo.value.lr or algo.lr,
        value_coef=algo.value.coef,
        turn_decay=algo.turn_decay,
        # algo.monitor.action=clamp: this step's coefficients need every entropy before the update
        reuse_scoring_forward=bool(algo.reuse_scoring_forward) and algo.monitor.action != "clamp",
        correction=cfg.rollout.correction.mode, token_cap=cfg.rollout.correction.token_cap,
        seq_bound=cfg.rollout.correction.seq_bound,
    )


def sampler_settings(cfg: Any) -> GroupSamplerSettings:
    algo = cfg.algo
    return GroupSamplerSettings(
        seed=cfg.seed, tasks_per_step=algo.tasks_per_step, group_size=algo.group_size,
        reward_scale=algo.reward_scale, invalid_action_penalty=algo.invalid_action_penalty,
        intrinsic=OmegaConf.to_object(algo.intrinsic), overlap=cfg.rollout.overlap,
        dynamic_sampling=algo.dynamic_sampling, max_rounds=algo.dynamic_sampling_max_rounds,
        group_filter=algo.group_filter, group_filter_keep=algo.group_filter_keep)


def evaluation_settings(cfg: Any) -> TrainingEvalSettings:
    return TrainingEvalSettings(
        splits=tuple(cfg.env.eval_splits), every=cfg.trainer.eval_every, episodes=cfg.trainer.eval_episodes,
        samples_to_save=cfg.rollout.num_samples_to_save, max_turns=cfg.env.max_turns, seed=cfg.seed,
        overlap=cfg.rollout.overlap)


def collapse_settings(cfg: Any) -> CollapseSettings:
    algo = cfg.algo
    return CollapseSettings(
        diagnostics=OmegaConf.to_object(algo.diagnostics), reward_scale=algo.reward_scale,
        invalid_action_penalty=algo.invalid_action_penalty, max_turns=cfg.env.max_turns,
        kappa_low=algo.entropy_smoothing.kappa_low, kappa_high=algo.entropy_smoothing.kappa_high,
        seed=cfg.seed, temperature=cfg.rollout.temperature, micro_batch_size=algo.micro_batch_size)


def likely_causes(cfg: Any) -> LikelyCauses:
    algo = cfg.algo
    return LikelyCauses(lr=algo.lr, grad_clip=algo.grad_clip,
                        reward_scale=None if algo.name == "sft" else algo.reward_scale)


def demo_settings(cfg: Any) -> DemoSettings:
    algo = cfg.algo
    return DemoSettings(demos=algo.demos, episodes=algo.demo_episodes, slip=algo.demo_slip, level=algo.demo_level,
                        split=cfg.env.train_split, max_turns=cfg.env.max_turns, seed=cfg.seed)


def entropy_control(cfg: Any) -> EntropyControl:
    """The entropy state's parts as their sections set them (they are algos components, built from their own
    config sections): algo.entropy_smoothing's history (env.max_turns slots), algo.monitor, the `entropy`
    group's schedule."""
    algo = cfg.algo
    return EntropyControl(EntropyHistory(algo.entropy_smoothing, max_turns=cfg.env.max_turns),
                          FluctuationMonitor(algo.monitor), build_entropy_schedule(cfg.entropy),
                          clamps=algo.monitor.action == "clamp")
