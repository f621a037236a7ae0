"""Typed schemas for every config group, and composition + validation of a run's config.

`compose(overrides)` runs Hydra's compose API over conf/, then merges the result into the dataclass
schemas below. Any unknown key, unknown group option or wrong type fails here, before any work starts,
with one `ConfigError` that names the key and the valid choices.

Groups (conf/<group>/<option>.yaml) and their schemas:
    algo        AlgoConfig        sft | ppo | grpo | epo | epo_ppo
    env         EnvConfig+        household | alfworld | scienceworld | textworld (schema per env)
    model       ModelConfig       tiny | qwen2.5-0.5b | ... (hub ids or local paths)
    entropy     EntropyConfig     the entropy coefficient (lambda) schedule
    curriculum  CurriculumConfig  none | staged | adaptive | horizon | subgoal_rewards
    deepspeed   DeepSpeedConfig   zero0 | zero1 | zero2 | zero3 | zero3_offload
    launcher    LauncherConfig    local | deepspeed | slurm
    logger      LoggerConfig      default | wandb | mlflow | none
    trainer     TrainerConfig     default
    rollout     RolloutConfig     default
    experiment  (global presets)
"""

from __future__ import annotations

import difflib
import re
import warnings
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from epo_cli.errors import ConfigError

# ----------------------------------------------------------------------------------------------------
# Schemas
# ----------------------------------------------------------------------------------------------------


@dataclass
class EnvConfig:
    """Settings every environment shares. Each env extends this with its own dataclass."""

    name: str = "household"
    max_turns: int = 50
    #: observation/action pairs of the past shown in each prompt (verl-agent default 2)
    history_length: int = 2
    #: worker processes for the env pool; 0 = step envs in the training process; null = CPU count
    num_workers: int | None = 0
    #: seconds a worker may take for one step before it is restarted and its episode truncated
    step_timeout_s: float = 60.0
    #: prompt template (see epo_cli/rollout/prompts.py for the placeholders)
    prompt_template: str = "alfworld"
    #: split names used for training and for evaluation during training
    train_split: str = "train"
    eval_splits: list[str] = field(default_factory=lambda: ["eval_in_distribution"])


@dataclass
class PolicyClipConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    #: dual-clip constant c for negative advantages (Ye et al. 2020); null disables it
    dual_clip: float | None = 3.0
    aggregation: str = "token-mean"


@dataclass
class ValueConfig:
    coef: float = 0.5
    clip: float = 0.5
    lr: float | None = None  # critic learning rate; null = algo.lr


@dataclass
class EntropyTermConfig:
    #: token_mean (verl-style) | trajectory (EPO Eq. 2, nested mean) | turn_decay (gamma^t weights)
    mode: str = "token_mean"
    decay: float = 0.9


@dataclass
class SmoothingConfig:
    """EPO entropy smoothing (arXiv 2509.22576 Sec. 3): hinge band around the historical entropy."""

    alpha: float = 0.1
    kappa_low: float = 0.0
    kappa_high: float = 2.0
    #: global | per_turn (one reference per true turn index)
    reference: str = "global"
    #: cumulative (paper) | window | ema
    history: str = "cumulative"
    window: int = 10
    ema_decay: float = 0.9
    aggregation: str = "trajectory"


@dataclass
class PhaseConfig:
    """Phase weight beta_k multiplying the smoothing term."""

    #: paper (1 + exp(-gamma k / floor(K/2))) | constant | two_phase
    schedule: str = "paper"
    gamma: float = 3.0
    value: float = 1.0
    #: two_phase: share of training in the exploration phase, and the beta/KL values at its ends
    exploration_share: float = 0.3
    beta_start: float = 0.1
    beta_peak: float = 0.5
    beta_end: float = 0.2
    kl_start: float = 0.2
    kl_end: float = 0.8


@dataclass
class KLConfig:
    coef: float = 0.01
    #: k1 | k2 | k3 (= low_var_kl, clamped)
    estimator: str = "low_var_kl"
    aggregation: str = "token-mean"
    #: constant, or two_phase (weight taken from algo.phase's KL ramp)
    schedule: str = "constant"


@dataclass
class GAEConfig:
    gamma: float = 1.0
    lam: float = 1.0
    whiten: bool = True


@dataclass
class GRPOConfig:
    norm_by_std: bool = True
    #: turns: mean/std over all turn-samples of the group (verl-agent); trajectories: one score per episode
    mean_over: str = "turns"
    eps: float = 1e-6


@dataclass
class MonitorConfig:
    """Entropy fluctuation monitor: sigma <- a*sigma + (1-a)*|H_t - mean(H over the last k steps, incl. H_t)|."""

    decay: float = 0.9
    window: int = 5
    #: alert when sigma / mean entropy exceeds this (relative fluctuation)
    threshold: float = 0.2
    #: warn (log + console) | clamp (also scale the entropy terms' gradient by clamp_scale)
    action: str = "warn"
    clamp_scale: float = 0.1


@dataclass
class AlgoConfig:
    name: str = "sft"
    #: the RL base of the algorithm: none (sft) | ppo | grpo
    base: str = "none"
    #: advantage estimator: gae | grpo | rloo | none; `auto` picks gae for base=ppo, grpo for base=grpo
    estimator: str = "auto"
    #: policy loss terms, summed in this order; see epo_cli/algos/losses.py
    loss_terms: list[str] = field(default_factory=lambda: ["nll"])
    # optimisation
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.2
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    #: turn-samples per optimizer step, over all ranks
    mini_batch_size: int = 64
    #: turn-samples per forward/backward on one rank (padded micro-batches)
    micro_batch_size: int = 16
    #: packed micro-batches: token budget of one pass whose samples are laid end to end in one row (no
    #: padding; attention kept per sample). null = on when the model's attention supports it (sdpa,
    #: flash_attention_2/3), with a budget of micro_batch_size x the longest sample; 0 = off (padded)
    pack_tokens: int | None = None
    #: the update's first forward (first mini-batch, first epoch: the rollout's weights) provides its samples'
    #: old log-probs and entropies instead of a separate scoring pass over them (see Trainer.on_policy_rows)
    reuse_scoring_forward: bool = True
    # rollout batch
    tasks_per_step: int = 4
    group_size: int = 1
    # reward shaping (verl-agent conventions)
    reward_scale: float = 10.0
    invalid_action_penalty: float = 0.1
    # sft
    #: expert (demonstrations from the env's expert) or the path of a JSONL file of trajectories
    demos: str = "expert"
    demo_episodes: int = 200
    demo_level: str | None = None
    # term settings
    policy_clip: PolicyClipConfig = field(default_factory=PolicyClipConfig)
    value: ValueConfig = field(default_factory=ValueConfig)
    entropy: EntropyTermConfig = field(default_factory=EntropyTermConfig)
    entropy_smoothing: SmoothingConfig = field(default_factory=SmoothingConfig)
    phase: PhaseConfig = field(default_factory=PhaseConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    gae: GAEConfig = field(default_factory=GAEConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    nll_aggregation: str = "token-mean"


@dataclass
class LoraConfig:
    rank: int = 0  # 0 = full fine-tuning
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class ModelConfig:
    name: str = "tiny"
    #: hub id or local directory; null builds the tiny model below from its sizes
    path: str | None = None
    trust_remote_code: bool = False
    #: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    dtype: str = "auto"
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False
    # tiny model (Qwen2 architecture) sizes; ignored when `path` is set
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    #: target size of the locally trained tokenizer
    vocab_size: int = 1024
    #: embedding rows of the model (null = the tokenizer's size); e.g. 151936 to match Qwen2.5's shapes
    padded_vocab_size: int | None = None
    tie_word_embeddings: bool = True
    #: where the locally trained tokenizer and built model are cached; null = ~/.cache/epo
    cache_dir: str | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class EntropyConfig:
    """The entropy coefficient lambda over training (multiplies L_H and, with beta_k, L_smooth)."""

    #: constant | linear | cosine | exp_anneal | two_phase | adaptive_target
    schedule: str = "constant"
    coef: float = 0.001
    start: float = 0.001
    end: float = 0.0
    #: two_phase (source article): rise start -> peak over `exploration_share` of training, then fall to end
    peak: float = 0.005
    exploration_share: float = 0.3
    #: exp_anneal: coef = start * decay_rate ** (step / total_steps), floored at `end`
    decay_rate: float = 0.1
    #: adaptive_target: move coef towards keeping the entropy at `target`
    target: float = 0.5
    adapt_lr: float = 0.1
    min_coef: float = 0.0
    max_coef: float = 0.05


@dataclass
class CurriculumConfig:
    #: none | staged | adaptive | horizon | subgoal_rewards
    name: str = "none"
    #: staged / adaptive: ordered levels (household levels, ALFWorld task types, ScienceWorld task lists)
    levels: list[str] = field(default_factory=list)
    window: int = 3
    promote_at: float = 0.7
    demote_at: float | None = None
    replay_share: float = 0.2
    #: adaptive: progress (change in success) | closeness (to 0.5)
    adaptive_signal: str = "progress"
    exploration_floor: float = 0.1
    #: horizon: max turns grow from start_turns to env.max_turns over `horizon_share` of training
    #: (can be combined with any curriculum)
    horizon: bool = False
    start_turns: int = 10
    horizon_share: float = 0.5
    #: intermediate rewards from progress events (can be combined with any curriculum)
    subgoal_rewards: bool = False
    subgoal_coef: float = 1.0
    #: the subgoal coefficient decays linearly to 0 by this share of training (null = never)
    subgoal_decay_share: float | None = 0.8


@dataclass
class DeepSpeedConfig:
    name: str = "zero0"
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    #: auto: bf16 on GPU, fp32 on CPU
    precision: str = "auto"
    activation_checkpointing: bool = False


@dataclass
class LauncherConfig:
    name: str = "local"
    #: GPUs per node (deepspeed launcher); on a machine without GPUs use num_procs for CPU ranks
    num_gpus: int = 0
    num_nodes: int = 1
    num_procs: int = 1
    hostfile: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    #: seconds a collective may wait before a hung or dead rank ends the job
    timeout_s: float = 600.0
    # slurm (submitit)
    partition: str | None = None
    time_min: int = 60 * 24
    cpus_per_task: int = 8
    account: str | None = None


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "epo"
    entity: str | None = None
    #: online | offline | disabled (WANDB_MODE)
    mode: str = "offline"


@dataclass
class MlflowConfig:
    enabled: bool = False
    #: null = a local SQLite store in the run directory (<run>/mlflow.db); or any MLflow tracking URI
    tracking_uri: str | None = None
    experiment: str = "epo"


@dataclass
class LoggerConfig:
    name: str = "default"
    console: bool = True
    jsonl: bool = True
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class TrainerConfig:
    #: RL iterations (rollout + update), or optimizer steps for sft
    total_steps: int = 100
    save_every: int = 50
    eval_every: int = 50
    eval_episodes: int = 32
    #: keep a `best` checkpoint by this metric (null = none)
    best_metric: str | None = "eval/success"
    #: null | auto | <run dir or checkpoint dir>
    resume: str | None = None
    #: end this process (with a checkpoint) after this many steps, to continue later with trainer.resume;
    #: schedules still span total_steps (for time-limited jobs)
    stop_after: int | None = None
    #: stop after this many consecutive updates skipped for a non-finite loss or gradient
    max_nonfinite_skips: int = 3
    log_every: int = 1
    #: auto | cpu | cuda
    device: str = "auto"
    deterministic: bool = True
    keep_checkpoints: int = 2
    #: torch intra-op threads per process (1 is fastest on small CPU machines)
    num_threads: int = 1


@dataclass
class RolloutConfig:
    max_new_tokens: int = 64
    max_prompt_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eval_temperature: float = 0.4
    #: generation stops at this string (or EOS)
    stop: str = "</action>"
    #: envs generated for in one batched `generate` call (0 = all active envs)
    generation_batch_size: int = 0
    #: decoded trajectories written to samples/ per evaluation
    num_samples_to_save: int = 4


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = 0
    output_dir: str = "outputs"
    #: explicit run directory (else outputs/<date>/<time>-<name>)
    run_dir: str | None = None
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


# ----------------------------------------------------------------------------------------------------
# Composition
# ----------------------------------------------------------------------------------------------------

#: config groups a user selects with `group=option`
GROUPS = ("algo", "env", "model", "entropy", "curriculum", "deepspeed", "launcher", "logger", "trainer",
          "rollout", "experiment")


def config_dir() -> Path:
    """The conf/ tree: inside the installed package (wheel), else the repository's top level."""
    packaged = Path(__file__).parent / "conf"
    if (packaged / "config.yaml").exists():
        return packaged
    repo = Path(__file__).resolve().parent.parent / "conf"
    if (repo / "config.yaml").exists():
        return repo
    raise RuntimeError(f"config tree not found next to {__file__}; the package is installed incorrectly")


def group_options(group: str) -> list[str]:
    """Options of a config group, from the yaml files in conf/<group>/."""
    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def _schema_for(cfg: DictConfig) -> DictConfig:
    """The structured schema for this composition: the env schema depends on `env.name`."""
    from epo_cli.envs import env_config_class

    schema = OmegaConf.structured(RunConfig)
    env_name = OmegaConf.select(cfg, "env.name", default="household")
    schema.env = OmegaConf.structured(env_config_class(env_name))
    return schema


def _dataclass_at(key_path: str, env_name: str) -> type | None:
    """The schema dataclass that owns the node at `key_path` (e.g. 'trainer' or 'algo.kl')."""
    from epo_cli.envs import env_config_class

    node: Any = RunConfig
    for part in [p for p in key_path.split(".") if p]:
        if not is_dataclass(node):
            return None
        if node is RunConfig and part == "env":
            node = env_config_class(env_name)
            continue
        match = {f.name: f for f in fields(node)}.get(part)
        if match is None:
            return None
        node = match.default_factory() if match.default_factory is not None else None  # type: ignore[misc]
        node = type(node) if is_dataclass(node) else None
    return node


def _unknown_key_message(full_key: str, env_name: str) -> str:
    parent, _, leaf = full_key.rpartition(".")
    owner = _dataclass_at(parent, env_name)
    valid = [f.name for f in fields(owner)] if owner is not None else []
    where = f"'{parent}'" if parent else "the top level"
    msg = f"Unknown config key '{full_key}'."
    close = difflib.get_close_matches(leaf, valid, n=1)
    if close:
        msg += f" Did you mean '{(parent + '.') if parent else ''}{close[0]}'?"
    if valid:
        msg += f"\nValid keys in {where}: {', '.join(valid)}."
    if parent in GROUPS or parent == "":
        msg += "\nFix the override, or run `epo config show` to see every key and its value."
    return msg


def _translate_hydra_error(err: Exception) -> ConfigError:
    text = str(err)
    m = re.search(r"Could not find '([\w\-/.]+)/([\w\-.]+)'", text)
    if m:
        group, option = m.group(1), m.group(2)
        options = group_options(group) if (config_dir() / group).is_dir() else []
        close = difflib.get_close_matches(option, options, n=1)
        hint = f" Did you mean '{group}={close[0]}'?" if close else ""
        return ConfigError(
            f"Unknown option '{option}' for config group '{group}'.{hint}\n"
            f"Valid options for {group}: {', '.join(options)}."
        )
    m = re.search(r"Could not override '([\w.\-]+)'", text)
    if m:
        return ConfigError(_unknown_key_message(m.group(1), "household"))
    m = re.search(r"Could not append to config\. An item is already at '([\w.\-]+)'", text)
    if m:
        return ConfigError(f"'{m.group(1)}' already exists: override it without the leading '+'.")
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return ConfigError(
        f"Invalid override: {first}\nOverrides look like `group=option` or `section.key=value`, "
        "e.g. `algo=epo trainer.total_steps=20`."
    )


def hydra_overrides(overrides: list[str] | tuple[str, ...]) -> list[str]:
    """Value overrides become `++key=value` so that every key of the typed schemas can be set, also when
    the selected yaml does not spell it out (e.g. algo.entropy_smoothing.alpha under algo=grpo); unknown
    keys are then reported by the schema merge, with the valid keys. Group selections stay as they are."""
    out = []
    for o in overrides:
        key = o.split("=", 1)[0]
        is_group = key in GROUPS or "/" in key or key.startswith("hydra")
        out.append(o if ("=" not in o or o.startswith(("+", "~")) or is_group) else f"++{o}")
    return out


def compose(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose conf/ with `overrides` and validate it against the schemas. Raises ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = hydra_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            raw = hydra_compose(config_name="config", overrides=overrides)
    except OmegaConfBaseException as err:  # e.g. interpolation errors while composing
        raise _translate_hydra_error(err) from None
    except Exception as err:  # hydra's own exceptions (missing option, bad override grammar)
        if type(err).__module__.startswith("hydra"):
            raise _translate_hydra_error(err) from None
        raise
    finally:
        GlobalHydra.instance().clear()
    return validate(raw)


def validate(raw: DictConfig) -> DictConfig:
    """Merge a composed config into the typed schemas and check cross-field consistency."""
    env_name = str(OmegaConf.select(raw, "env.name", default="household"))
    OmegaConf.set_struct(raw, False)
    raw.pop("hydra", None)
    try:
        schema = _schema_for(raw)
        cfg = OmegaConf.merge(schema, raw)
        OmegaConf.resolve(cfg)
    except ConfigError:
        raise
    except ConfigKeyError as err:
        raise ConfigError(_unknown_key_message(err.full_key, env_name)) from None
    except ValidationError as err:
        expected = _expected_type(err)
        raise ConfigError(
            f"Wrong type for config key '{err.full_key}': {str(err).splitlines()[0]}."
            + (f" Expected {expected}." if expected else "")
        ) from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"Invalid config value at '{key}': {str(err).splitlines()[0]}") from None
    _check_consistency(cfg)
    OmegaConf.set_readonly(cfg, False)
    return cfg


def _expected_type(err: ValidationError) -> str | None:
    try:
        parent, _, leaf = err.full_key.rpartition(".")
        owner = _dataclass_at(parent, "household")
        if owner is None:
            return None
        hint = {f.name: f.type for f in fields(owner)}.get(leaf)
        return str(hint) if hint else None
    except Exception:
        return None


def _check_smoothing_weight(algo: Any) -> None:
    """Warn when alpha * max(beta_k) >= 1. Above the band the objective's gradient in H is
    lambda * (1 - beta_k * alpha): below 1 the smoothing only damps the entropy bonus there (the regime EPO's
    analysis assumes); at or above 1 it outweighs the bonus and pushes entropy down."""
    phase = algo.phase
    beta_max = {"paper": 2.0, "constant": phase.value,
                "two_phase": max(phase.beta_start, phase.beta_peak, phase.beta_end)}.get(phase.schedule)
    alpha = algo.entropy_smoothing.alpha
    if beta_max is not None and alpha * beta_max >= 1.0:
        warnings.warn(f"algo.entropy_smoothing.alpha * max beta_k = {alpha} * {beta_max:g} >= 1: above the band "
                      "the smoothing penalty outweighs the entropy bonus and drives entropy down (EPO's analysis "
                      "assumes alpha * beta_max < 1; the paper uses alpha = 0.1).", stacklevel=2)


def _choice(key: str, value: Any, valid: list[str] | tuple[str, ...]) -> None:
    if value not in valid:
        close = difflib.get_close_matches(str(value), list(valid), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"Invalid value '{value}' for '{key}'.{hint} Valid values: {', '.join(valid)}.")


def _check_consistency(cfg: DictConfig) -> None:
    """Checks that span keys or need registries; registries fail here, at config time."""
    from epo_cli.algos import registry_names

    names = registry_names()
    algo = cfg.algo
    _choice("algo.base", algo.base, ("none", "ppo", "grpo"))
    if algo.estimator == "auto":
        algo.estimator = {"ppo": "gae", "grpo": "grpo", "none": "none"}[algo.base]
    _choice("algo.estimator", algo.estimator, [*names["estimators"], "none"])
    for term in algo.loss_terms:
        _choice("algo.loss_terms", term, names["loss_terms"])
    for key in ("policy_clip.aggregation", "kl.aggregation", "entropy_smoothing.aggregation", "nll_aggregation"):
        _choice(f"algo.{key}", OmegaConf.select(algo, key), names["aggregations"])
    _choice("algo.entropy.mode", algo.entropy.mode, names["entropy_modes"])
    _choice("algo.kl.estimator", algo.kl.estimator, names["kl_estimators"])
    _choice("algo.entropy_smoothing.reference", algo.entropy_smoothing.reference, ("global", "per_turn"))
    _choice("algo.entropy_smoothing.history", algo.entropy_smoothing.history, ("cumulative", "window", "ema"))
    _choice("algo.phase.schedule", algo.phase.schedule, names["phase_schedules"])
    _choice("algo.kl.schedule", algo.kl.schedule, ("constant", "two_phase"))
    _choice("algo.monitor.action", algo.monitor.action, ("warn", "clamp"))
    _choice("algo.grpo.mean_over", algo.grpo.mean_over, ("turns", "trajectories"))
    _choice("entropy.schedule", cfg.entropy.schedule, names["entropy_schedules"])
    if algo.name != "sft" and algo.estimator == "none":
        raise ConfigError(f"algo={algo.name} needs an advantage estimator; set algo.estimator.")
    if algo.estimator in ("grpo", "rloo") and algo.group_size < 2:
        raise ConfigError(
            f"algo.estimator={algo.estimator} compares rollouts of the same task and needs "
            f"algo.group_size >= 2 (got {algo.group_size})."
        )
    for key in ("mini_batch_size", "micro_batch_size", "tasks_per_step", "group_size", "ppo_epochs"):
        if algo[key] < 1:
            raise ConfigError(f"algo.{key} must be >= 1 (got {algo[key]}).")
    if algo.pack_tokens is not None and algo.pack_tokens < 0:
        raise ConfigError(f"algo.pack_tokens must be >= 0 (got {algo.pack_tokens}): a token budget per packed "
                          "micro-batch, 0 for padded micro-batches, or null for the automatic choice.")
    if algo.pack_tokens and cfg.model.attn_implementation not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        raise ConfigError(f"algo.pack_tokens={algo.pack_tokens} needs an attention that keeps packed samples apart "
                          f"(model.attn_implementation=sdpa | flash_attention_2 | flash_attention_3, got "
                          f"'{cfg.model.attn_implementation}'); or set algo.pack_tokens=0 for padded micro-batches.")
    if cfg.trainer.total_steps < 1:
        raise ConfigError(f"trainer.total_steps must be >= 1 (got {cfg.trainer.total_steps}).")
    if "entropy_smoothing" in algo.loss_terms:
        _check_smoothing_weight(algo)
    if cfg.env.history_length < 0 or cfg.env.max_turns < 1:
        raise ConfigError("env.history_length must be >= 0 and env.max_turns >= 1.")
    _choice("deepspeed.precision", cfg.deepspeed.precision, ("auto", "fp32", "bf16"))
    _choice("deepspeed.zero_stage", cfg.deepspeed.zero_stage, (0, 1, 2, 3))
    _choice("model.dtype", cfg.model.dtype, ("auto", "fp32", "bf16"))
    _choice("trainer.device", cfg.trainer.device, ("auto", "cpu", "cuda"))
    _choice("launcher.name", cfg.launcher.name, ("local", "deepspeed", "slurm"))
    _choice("curriculum.name", cfg.curriculum.name, ("none", "staged", "adaptive", "horizon", "subgoal_rewards"))
    _choice("wandb.mode", cfg.logger.wandb.mode, ("online", "offline", "disabled"))


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
