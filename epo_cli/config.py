"""Typed schemas for every config group, and the field rules they declare. Schemas only: this module
imports nothing of epo_cli but errors, so components (algos, envs, curricula) can import their settings
classes and field rules from it, and `import epo_cli.config` stays free of torch.

Each numeric field declares its range next to it (`num(default, ge=0, le=1)`) and each enum field its
values (`one_of(default, (...))`, or `one_of(default, registry=...)`: the names of a component registry,
which the caller passes in); `check_field_rules` walks a schema and checks them all. A section that holds a
switch lists the settings it turns on in `switches` (`Switch`: compose warns when one is set while it is
off), and the rules that span its keys in `rules` (`Rule`: functions of the run config, defined just above the
section; compose runs them). Composing conf/ with Hydra and merging into these schemas live one layer up, in
epo_cli/compose/, with the rules that need more than the schemas (curricula, prompt templates, memory).

Groups (conf/<group>/<option>.yaml) and their schemas:
    algo        AlgoConfig        sft | ppo | grpo | gigpo | epo | epo_ppo
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
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from epo_cli.errors import ConfigError

# ----------------------------------------------------------------------------------------------------
# Field rules: bounds and valid values next to each field, checked by `check_field_rules`
# ----------------------------------------------------------------------------------------------------


def num(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
        lt: float | None = None) -> Any:
    """A numeric field with its allowed range (null stays allowed where the type is optional)."""
    return field(default=default, metadata={"range": (ge, gt, le, lt)})


def one_of(default: Any = None, valid: tuple[Any, ...] = (), *, registry: str | None = None,
           extra: tuple[Any, ...] = (), default_factory: Any = None) -> Any:
    """A field whose value (each item, for a list) is one of `valid`, or a name in the component registry
    `registry` (a key of epo_cli.algos.REGISTRIES, or "curricula") plus `extra`. Config validation also
    reads these fields to find the components a config names (their checks, the keys they read)."""
    meta = {"choices": tuple(valid) + tuple(extra), "registry": registry}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def _range_text(rule: tuple[Any, Any, Any, Any]) -> str:
    ge, gt, le, lt = rule
    low = f"{ge:g} <= " if ge is not None else (f"{gt:g} < " if gt is not None else "")
    high = f" <= {le:g}" if le is not None else (f" < {lt:g}" if lt is not None else "")
    return f"{low}value{high}"


def _in_range(value: Any, rule: tuple[Any, Any, Any, Any]) -> bool:
    ge, gt, le, lt = rule
    if number_problem(value):  # nan, +-inf or an int too large for the libraries: never in range
        return False
    return not ((ge is not None and value < ge) or (gt is not None and value <= gt) or
                (le is not None and value > le) or (lt is not None and value >= lt))


#: the largest int a setting may hold: torch, numpy and the C libraries below them take 64-bit ints
MAX_INT = 2**63 - 1


def number_problem(value: Any) -> str | None:
    """Why a number is never a usable setting, or None: nan and +-inf (1e999 parses as inf) reach the
    optimizer or a timer as such and fail far from the setting; an int beyond 64 bits overflows the first
    C library it reaches. No field allows them."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "is not a finite number"
    if isinstance(value, int) and abs(value) > MAX_INT:
        return f"is too large (at most {MAX_INT} = 2**63 - 1)"
    return None


def shown_number(value: Any) -> str:
    """A number as an error message shows it: a 400-digit int as its first digits and its length."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:12]}...{text[-4:]} ({len(text.lstrip('-'))} digits)"


def check_number_sizes(node: Any, prefix: str = "") -> None:
    """Ints too large for 64 bits anywhere in a raw (not yet merged) config: one ConfigError naming the key.
    Merging one into a float field would raise OverflowError without a key, so this runs before the merge;
    nan and inf are refused by `check_field_rules` after it."""
    items = node.items() if isinstance(node, Mapping) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        where = f"{prefix}{key}" if isinstance(node, Mapping) else f"{prefix.rstrip('.')}[{key}]"
        if isinstance(value, (Mapping, list)):
            check_number_sizes(value, where + ".")
        elif isinstance(value, int) and number_problem(value):
            raise ConfigError(f"Invalid value for '{where}': {shown_number(value)} {number_problem(value)}. "
                              f"Fix: {where}=<a smaller value>.")


@dataclass(frozen=True)
class Switch:
    """Settings (`keys`, dotted; a section names every key under it) that are read only while a switch is on:
    `on(cfg)`; `why(cfg)` says why they are not read when it is off. A section's `switches` lists the rules
    of the switches it holds; compose warns about such a setting changed while its switch is off."""

    keys: tuple[str, ...]
    on: Callable[[Any], bool]
    why: Callable[[Any], str]


#: a rule that spans keys: a function of the whole run config that raises ConfigError (or warns). A section lists
#: its own in `rules`, each defined just above it; compose runs them after every field's own range
Rule = Callable[[Any], None]


#: keys renamed since runs were saved with them: old -> new (a saved config.yaml is read with the new names,
#: and an override that gives an old one is told the new one)
RENAMED_KEYS = {"algo.phase.value": "algo.phase.coef", "algo.phase.beta_start": "algo.phase.start",
                "algo.phase.beta_peak": "algo.phase.peak", "algo.phase.beta_end": "algo.phase.end",
                "algo.entropy.decay": "algo.turn_decay"}

#: values renamed since runs were saved with them: key -> {old value: new value} (likewise read and told)
RENAMED_VALUES = {"algo.kl.schedule": {"two_phase": "phase_kl_ramp"}}


#: how a true/false setting is written, wherever it is given (Hydra reads these words in any case)
BOOL_WORDS = {"true": True, "false": False}


def parse_bool(key: str, value: Any, optional: bool = False) -> bool | None:
    """The one rule for a true/false setting: a config key (compose) or an `epo eval` option (greedy=).
    A bool, or the word true or false in any case; null only where the setting allows it. Anything else
    (yes, no, on, off, 1, 0, 3) is refused with one message rather than read: OmegaConf would turn
    `env.cache_pddl=yes` or `=3` into true without a word, and a value silently changed is a bug."""
    if isinstance(value, bool) or (value is None and optional):
        return value
    if isinstance(value, str) and value.lower() in BOOL_WORDS:
        return BOOL_WORDS[value.lower()]
    shown = "null" if value is None else repr(value)
    raise ConfigError(f"Wrong type for config key '{key}': {shown} is not a bool. "
                      f"Expected true or false{' (or null)' if optional else ''}.")


# ----------------------------------------------------------------------------------------------------
# Schemas
# ----------------------------------------------------------------------------------------------------


@dataclass
class EnvConfig:
    """Settings every environment shares. Each env extends this with its own dataclass."""

    name: str = "household"
    max_turns: int = num(50, ge=1)
    #: observation/action pairs of the past shown in each prompt (verl-agent default 2)
    history_length: int = num(2, ge=0)
    #: worker processes for the env pool; 0 = step envs in the training process; null = CPU count
    num_workers: int | None = num(0, ge=0, le=1024)
    #: seconds a worker may take for one step before it is restarted and its episode truncated (a reset gets
    #: 5x as long; at most a day: the pool's wait takes milliseconds in a C int)
    step_timeout_s: float = num(60.0, gt=0, le=86400)
    #: prompt template (see epo_cli/rollout/prompts.py for the placeholders)
    prompt_template: str = "alfworld"
    #: the chat's system turn before each prompt (null: none; a model's chat template may then add its own
    #: default, as SmolLM2's does); a real instruct model follows the action format far better when told it here
    system_prompt: str | None = None
    #: split names used for training and for evaluation during training
    train_split: str = "train"
    eval_splits: list[str] = field(default_factory=lambda: ["eval_in_distribution"])

    switches: ClassVar[tuple[Switch, ...]] = (
        Switch(("rollout.overlap", "env.step_timeout_s"), lambda cfg: cfg.env.num_workers != 0,
               lambda cfg: "env.num_workers=0 steps the envs in the training process, so no worker runs meanwhile"),
    )


@dataclass
class PolicyClipConfig:
    clip_low: float = num(0.2, ge=0, le=1)
    clip_high: float = num(0.2, ge=0)
    #: dual-clip constant c for negative advantages (Ye et al. 2020); null disables it
    dual_clip: float | None = num(3.0, gt=1)
    aggregation: str = one_of("token-mean", registry="aggregations")
    #: algo.policy_loss=clip_cov (Cui et al. 2025, arXiv 2505.22617; verl's names and defaults): detach the
    #: gradient of this share of tokens, drawn among those with clip_cov_lb < covariance < clip_cov_ub
    clip_cov_ratio: float = num(2.0e-4, gt=0, le=1)
    clip_cov_lb: float = num(1.0)
    clip_cov_ub: float = num(5.0)
    #: algo.policy_loss=kl_cov: KL penalty ppo_kl_coef * |log ratio| on this top share of tokens by covariance
    kl_cov_ratio: float = num(2.0e-3, gt=0, le=1)
    ppo_kl_coef: float = num(1.0, ge=0)


@dataclass
class ValueConfig:
    coef: float = num(0.5, ge=0)
    clip: float = num(0.5, gt=0)
    lr: float | None = num(None, gt=0, le=1)  # critic learning rate; null = algo.lr


@dataclass
class EntropyTermConfig:
    #: token_mean (verl-style) | trajectory (EPO Eq. 2, nested mean) | turn_decay (gamma^t weights)
    mode: str = one_of("token_mean", registry="entropy_modes")


@dataclass
class SmoothingConfig:
    """EPO entropy smoothing (arXiv 2509.22576 Sec. 3): hinge band around the historical entropy."""

    alpha: float = num(0.1, ge=0)
    kappa_low: float = num(0.0, ge=0)
    kappa_high: float = num(2.0, gt=0)
    #: global | per_turn (one reference per true turn index)
    reference: str = one_of("global", ("global", "per_turn"))
    #: cumulative (paper) | window | ema
    history: str = one_of("cumulative", ("cumulative", "window", "ema"))
    window: int = num(10, ge=1)
    ema_decay: float = num(0.9, ge=0, lt=1)
    aggregation: str = one_of("trajectory", registry="aggregations")


@dataclass
class PhaseConfig:
    """Phase weight beta_k multiplying the smoothing term."""

    #: a schedule of epo_cli/algos/schedules.py whose parameters this section has (under the schedule's own
    #: names): paper (1 + exp(-gamma k / floor(K/2))) | constant (coef) | two_phase (start, peak, end) | ...
    schedule: str = one_of("paper", registry="schedules")
    gamma: float = num(3.0, ge=0)
    coef: float = num(1.0, ge=0)
    #: two_phase: share of training in the exploration phase, and the beta values at its ends
    exploration_share: float = num(0.3, ge=0, le=1)
    start: float = num(0.1, ge=0)
    peak: float = num(0.5, ge=0)
    end: float = num(0.2, ge=0)
    #: algo.kl.schedule=phase_kl_ramp: the KL weight, 0 while exploring, then kl_start -> kl_end
    kl_start: float = num(0.2, ge=0)
    kl_end: float = num(0.8, ge=0)


@dataclass
class KLConfig:
    coef: float = num(0.01, ge=0)
    #: k1 | k2 | k3 (= low_var_kl, clamped)
    estimator: str = one_of("low_var_kl", registry="kl_estimators")
    aggregation: str = one_of("token-mean", registry="aggregations")
    #: constant (coef), or phase_kl_ramp (weight taken from algo.phase's KL ramp: 0, then kl_start -> kl_end)
    schedule: str = one_of("constant", registry="kl_schedules")


@dataclass
class GAEConfig:
    gamma: float = num(1.0, ge=0, le=1)
    lam: float = num(1.0, ge=0, le=1)
    whiten: bool = True


@dataclass
class GRPOConfig:
    norm_by_std: bool = True
    #: turns: mean/std over all turn-samples of the group (verl-agent); trajectories: one score per episode
    mean_over: str = one_of("turns", ("turns", "trajectories"))
    eps: float = num(1e-6, gt=0)


@dataclass
class GiGPOConfig:
    """GiGPO (arXiv 2505.10978): episode-level + step-level (anchor state) group advantages."""

    #: discount of the step-level returns (verl-agent ALFWorld: 0.95)
    gamma: float = num(0.95, ge=0, le=1)
    #: omega: A = A_episode + step_weight * A_step
    step_weight: float = num(1.0, ge=0)
    #: mean_std_norm: (x - mean) / (std + eps) (verl-agent ALFWorld) | mean_norm: x - mean
    mode: str = one_of("mean_std_norm", ("mean_std_norm", "mean_norm"))
    #: anchor match: 1.0 = identical observation text; in (0, 1): normalised edit similarity threshold
    similarity: float = num(1.0, gt=0, le=1)
    #: observation (the paper) | observation_admissible (also the prompt's admissible actions)
    anchor: str = one_of("observation", ("observation", "observation_admissible"))
    eps: float = num(1e-6, gt=0)


def _intrinsic_pays_less_than_success(cfg: Any) -> None:
    algo = cfg.algo
    if algo.intrinsic.coef > algo.reward_scale:
        raise ConfigError(f"algo.intrinsic.coef={algo.intrinsic.coef:g} is above algo.reward_scale="
                          f"{algo.reward_scale:g}, the reward of a success: a single new observation would pay "
                          "more than solving the task, which teaches wandering. Use a value <= algo.reward_scale "
                          "(the default bonus is 0.1).")


@dataclass
class IntrinsicConfig:
    """Intrinsic reward (epo_cli/algos/intrinsic.py): an episodic count-based novelty bonus per turn,
    r_int = coef * decay^k / sqrt(N_group(observation after the turn's action)), k = RL iteration."""

    #: none | count
    kind: str = one_of("none", ("none", "count"))
    #: bonus for an observation the group has not seen before, at iteration 0
    coef: float = num(0.1, ge=0)
    #: per-iteration factor of the bonus (1 = constant)
    decay: float = num(1.0, ge=0, le=1)

    switches: ClassVar[tuple[Switch, ...]] = (
        Switch(("algo.intrinsic.coef", "algo.intrinsic.decay"),
               lambda cfg: not is_sft(cfg.algo) and cfg.algo.intrinsic.kind != "none",
               lambda cfg: _no_rollouts(cfg) if is_sft(cfg.algo) else "algo.intrinsic.kind=none adds no bonus"),
    )

    rules: ClassVar[tuple[Rule, ...]] = (_intrinsic_pays_less_than_success,)


@dataclass
class MonitorConfig:
    """Entropy fluctuation monitor: sigma <- a*sigma + (1-a)*|H_t - mean(H over the last k steps, incl. H_t)|."""

    decay: float = num(0.9, ge=0, lt=1)
    window: int = num(5, ge=2)
    #: alert when sigma / mean entropy exceeds this (relative fluctuation)
    threshold: float = num(0.2, gt=0)
    #: warn (log + console) | clamp (also scale the entropy terms' gradient by clamp_scale)
    action: str = one_of("warn", ("warn", "clamp"))
    clamp_scale: float = num(0.1, ge=0, le=1)

    switches: ClassVar[tuple[Switch, ...]] = (
        Switch(("algo.monitor.clamp_scale",), lambda cfg: cfg.algo.monitor.action == "clamp",
               lambda cfg: f"algo.monitor.action={cfg.algo.monitor.action}"),
    )


def _entropy_alert_band_ordered(cfg: Any) -> None:
    diag = cfg.algo.diagnostics
    if diag.alert_entropy_low is not None and diag.alert_entropy_high is not None \
            and diag.alert_entropy_low >= diag.alert_entropy_high:
        raise ConfigError(f"algo.diagnostics.alert_entropy_low={diag.alert_entropy_low:g} must be below "
                          f"alert_entropy_high={diag.alert_entropy_high:g} (the alert band around the reference).")


@dataclass
class DiagnosticsConfig:
    """Collapse diagnostics (epo_cli/algos/diagnostics.py, epo_cli/training/collapse.py): collapse/* metrics
    and one `collapse` alert (console warning, status.json, `epo report`)."""

    #: the per-iteration signals: group return std, advantage signal share, corridor hits, state diversity,
    #: and the alert
    enabled: bool = True
    #: collapse/mi every this many iterations (0 = never: each measurement scores mi_samples^2 pairs)
    mi_every: int = num(0, ge=0)
    #: turn-samples in MI's seeded subsample (all ranks together)
    mi_samples: int = num(16, ge=2, le=4096)  # each measurement scores mi_samples^2 pairs
    #: alert when policy/entropy < alert_entropy_low x its reference (the mean of the past steps' entropies)
    #: or > alert_entropy_high x it; null = that check is off
    alert_entropy_low: float | None = num(0.5, ge=0)
    alert_entropy_high: float | None = num(2.0, gt=0)
    #: alert when collapse/mi (nats/token) < this; null = off
    alert_mi: float | None = num(0.01, ge=0)
    #: alert when collapse/state_diversity < this; null = off (a converged policy takes one action per state)
    alert_diversity: float | None = num(None, ge=0, le=1)

    switches: ClassVar[tuple[Switch, ...]] = (
        Switch(tuple(f"algo.diagnostics.{k}" for k in ("mi_every", "alert_entropy_low", "alert_entropy_high",
                                                        "alert_diversity")),
               lambda cfg: cfg.algo.diagnostics.enabled, lambda cfg: "algo.diagnostics.enabled=false"),
        Switch(("algo.diagnostics.mi_samples", "algo.diagnostics.alert_mi"),
               lambda cfg: cfg.algo.diagnostics.enabled and cfg.algo.diagnostics.mi_every > 0,
               lambda cfg: "algo.diagnostics.mi_every=0 never measures MI" if cfg.algo.diagnostics.enabled
               else "algo.diagnostics.enabled=false"),
    )

    rules: ClassVar[tuple[Rule, ...]] = (_entropy_alert_band_ordered,)


def _demos_given(cfg: Any) -> None:
    if not str(cfg.algo.demos).strip():
        raise ConfigError("algo.demos is empty. Give algo.demos=expert (demonstrations played by the env's expert) "
                          "or the path of a JSONL file of trajectories.")


def _estimator_fits_the_base(cfg: Any) -> None:
    algo = cfg.algo
    if not is_sft(algo) and algo.estimator == "none":
        raise ConfigError(f"algo={algo.name} needs an advantage estimator; set algo.estimator.")
    if is_sft(algo) and algo.estimator != "none":
        raise ConfigError(f"algo.base=none trains by behaviour cloning on demonstrations, which have no rollouts "
                          f"to estimate advantages from, so algo.estimator={algo.estimator} cannot be used: give "
                          "the algorithm an RL base (algo.base=ppo|grpo|gigpo), or train algo=sft.")


def _whole_micro_batches(cfg: Any) -> None:
    algo = cfg.algo
    if algo.mini_batch_size % algo.micro_batch_size:
        raise ConfigError(
            f"algo.mini_batch_size={algo.mini_batch_size} must be divisible by algo.micro_batch_size="
            f"{algo.micro_batch_size} (each optimizer step is a whole number of micro-batches on every rank); "
            f"e.g. algo.mini_batch_size={-(-algo.mini_batch_size // algo.micro_batch_size) * algo.micro_batch_size}.")


def _dynamic_sampling_needs_groups(cfg: Any) -> None:
    algo = cfg.algo
    if algo.dynamic_sampling and algo.group_size < 2:
        raise ConfigError("algo.dynamic_sampling=true filters groups of rollouts of the same task and needs "
                          f"algo.group_size >= 2 (got {algo.group_size}); use it with grpo, rloo or gigpo.")


def _packing_keeps_samples_apart(cfg: Any) -> None:
    algo = cfg.algo
    if algo.pack_tokens and cfg.model.attn_implementation not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        raise ConfigError(f"algo.pack_tokens={algo.pack_tokens} needs an attention that keeps packed samples apart "
                          f"(model.attn_implementation=sdpa | flash_attention_2 | flash_attention_3, got "
                          f"'{cfg.model.attn_implementation}'); or set algo.pack_tokens=0 for padded micro-batches.")


@dataclass
class AlgoConfig:
    name: str = "sft"
    #: the RL base of the algorithm: none (sft) | ppo | grpo | gigpo
    base: str = one_of("none", ("none", "ppo", "grpo", "gigpo"))
    #: advantage estimator: gae | grpo | rloo | gigpo | none; `auto` picks gae for base=ppo, grpo for
    #: base=grpo, gigpo for base=gigpo
    estimator: str = one_of("auto", registry="estimators", extra=("auto", "none"))
    #: policy loss terms, summed in this order; see epo_cli/algos/losses.py
    loss_terms: list[str] = one_of(registry="loss_terms", default_factory=lambda: ["nll"])
    #: the module in the policy_clip slot: clip (PPO) | clip_cov | kl_cov (arXiv 2505.22617)
    policy_loss: str = one_of("clip", registry="policy_losses")
    # optimisation
    #: at most 1: Adam moves each weight by about lr per step, so above that a model only diverges (and
    #: beyond float32's range the optimizer's own arithmetic overflows)
    lr: float = num(1e-3, gt=0, le=1)
    weight_decay: float = num(0.0, ge=0)
    warmup_ratio: float = num(0.1, ge=0, le=1)
    min_lr_ratio: float = num(0.2, ge=0, le=1)
    #: max gradient norm (0 = no clipping)
    grad_clip: float = num(1.0, ge=0)
    #: passes over each iteration's samples (PPO uses 1-10; at most 100: docs/reliability.md, "Range rules")
    ppo_epochs: int = num(1, ge=1, le=100)
    #: turn-samples per optimizer step, over all ranks
    mini_batch_size: int = num(64, ge=1)
    #: turn-samples per forward/backward on one rank (padded micro-batches)
    micro_batch_size: int = num(16, ge=1)
    #: packed micro-batches: token budget of one pass whose samples are laid end to end in one row (no
    #: padding; attention kept per sample). null = on when the model's attention supports it (sdpa,
    #: flash_attention_2/3), with a budget of micro_batch_size x the longest sample; 0 = off (padded)
    pack_tokens: int | None = num(None, ge=0)
    #: the update's first forward (first mini-batch, first epoch: the rollout's weights) provides its samples'
    #: old log-probs and entropies instead of a separate scoring pass over them; off anyway when the policy has
    #: dropout or algo.monitor.action=clamp (training/update.py: PolicyUpdate.reuses_scoring)
    reuse_scoring_forward: bool = True
    # rollout batch
    tasks_per_step: int = num(4, ge=1)
    group_size: int = num(1, ge=1)
    #: DAPO dynamic sampling: replace the groups algo.group_filter drops by fresh rounds of tasks_per_step groups
    dynamic_sampling: bool = False
    #: extra rounds at most per iteration (then the batch is topped up with groups that did not pass)
    dynamic_sampling_max_rounds: int = num(3, ge=0, le=100)
    #: the groups dynamic sampling keeps (epo_cli/algos/group_filter.py): signal (the estimator gives the group
    #: a non-zero advantage) | top_variance (RAGEN-2: the top group_filter_keep share of each round by return
    #: variance) | none
    group_filter: str = one_of("signal", registry="group_filters")
    #: top_variance: share of each round's groups that passes (ceil(keep x groups))
    group_filter_keep: float = num(0.5, gt=0, le=1)
    # reward shaping (verl-agent conventions)
    reward_scale: float = num(10.0, gt=0)
    invalid_action_penalty: float = num(0.1, ge=0)
    # sft
    #: expert (demonstrations from the env's expert) or the path of a JSONL file of trajectories
    demos: str = "expert"
    demo_episodes: int = num(200, ge=1)
    demo_level: str | None = None
    #: chance per turn that the demonstrator takes another admissible command than the expert's (keeping the
    #: expert's thought): a noisy teacher, whose clone RL can improve on (docs/learning.md)
    demo_slip: float = num(0.0, ge=0, lt=1)
    #: the turn-decay aggregation (algo.entropy.mode=turn_decay, any `turn-decay` aggregation): turn t of an
    #: episode weighs turn_decay ** t
    turn_decay: float = num(0.9, gt=0, le=1)
    # term settings
    policy_clip: PolicyClipConfig = field(default_factory=PolicyClipConfig)
    value: ValueConfig = field(default_factory=ValueConfig)
    entropy: EntropyTermConfig = field(default_factory=EntropyTermConfig)
    entropy_smoothing: SmoothingConfig = field(default_factory=SmoothingConfig)
    phase: PhaseConfig = field(default_factory=PhaseConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    gae: GAEConfig = field(default_factory=GAEConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    gigpo: GiGPOConfig = field(default_factory=GiGPOConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    intrinsic: IntrinsicConfig = field(default_factory=IntrinsicConfig)
    nll_aggregation: str = one_of("token-mean", registry="aggregations")
    #: settings of components the sections above do not cover (a loss term or estimator registered outside
    #: the built-ins): algo.components.<name>.<key>, checked at compose time against the component's own
    #: settings dataclass (its registry entry's `config`) with the same field rules; a loss term's
    #: coefficient is its `coef`
    components: dict[str, Any] = field(default_factory=dict)

    switches: ClassVar[tuple[Switch, ...]] = (
        Switch(("algo.demos",), lambda cfg: is_sft(cfg.algo), lambda cfg: _not_cloning(cfg)),
        Switch(("algo.demo_episodes", "algo.demo_level", "algo.demo_slip"),
               lambda cfg: is_sft(cfg.algo) and cfg.algo.demos == "expert",
               lambda cfg: "algo.demos is a file: its trajectories are the data" if is_sft(cfg.algo)
               else _not_cloning(cfg)),
        Switch(("algo.dynamic_sampling_max_rounds", "algo.group_filter"), lambda cfg: cfg.algo.dynamic_sampling,
               lambda cfg: "algo.dynamic_sampling=false"),
        Switch(("algo.intrinsic.kind",), lambda cfg: not is_sft(cfg.algo), lambda cfg: _no_rollouts(cfg)),
    )

    rules: ClassVar[tuple[Rule, ...]] = (_demos_given, _estimator_fits_the_base, _whole_micro_batches,
                                         _dynamic_sampling_needs_groups, _packing_keeps_samples_apart)


def is_sft(algo: Any) -> bool:
    """The one rule for behaviour cloning: an algorithm without an RL base (algo.base=none, as algo=sft)
    trains on demonstrations (no rollouts, advantages or epochs)."""
    return algo.base == "none"


def _not_cloning(cfg: Any) -> str:
    return f"algo={cfg.algo.name} does not behaviour-clone"


def _no_rollouts(cfg: Any) -> str:
    return f"algo={cfg.algo.name} plays no rollouts to reward"


def _lora_adapts_some_layer(cfg: Any) -> None:
    if cfg.model.lora.rank > 0 and not cfg.model.lora.target_modules:
        raise ConfigError(f"model.lora.target_modules is empty while model.lora.rank={cfg.model.lora.rank}: LoRA "
                          "would adapt no layer. Name the modules (default [q_proj,k_proj,v_proj,o_proj]), or set "
                          "model.lora.rank=0 for full fine-tuning.")


@dataclass
class LoraConfig:
    rank: int = num(0, ge=0)  # 0 = full fine-tuning
    alpha: int = num(16, gt=0)
    dropout: float = num(0.0, ge=0, lt=1)
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    switches: ClassVar[tuple[Switch, ...]] = (
        Switch(("model.lora.alpha", "model.lora.dropout", "model.lora.target_modules"),
               lambda cfg: cfg.model.lora.rank > 0, lambda cfg: "model.lora.rank=0 fine-tunes all weights"),
    )

    rules: ClassVar[tuple[Rule, ...]] = (_lora_adapts_some_layer,)


def _heads_divide(cfg: Any) -> None:
    model = cfg.model
    if model.hidden_size % model.num_attention_heads or model.num_attention_heads % model.num_key_value_heads:
        raise ConfigError(f"model.hidden_size={model.hidden_size} must be divisible by model.num_attention_heads="
                          f"{model.num_attention_heads}, and that by model.num_key_value_heads="
                          f"{model.num_key_value_heads}.")


def _positions_fit_a_turn(cfg: Any) -> None:
    model = cfg.model
    context = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
    if not model.path and model.max_position_embeddings < context:
        raise ConfigError(f"model.max_position_embeddings={model.max_position_embeddings} is below "
                          f"rollout.max_prompt_tokens + rollout.max_new_tokens = {context}: a prompt and its "
                          f"response would not fit the tiny model's positions. Raise it (e.g. "
                          f"model.max_position_embeddings={max(2048, context)}) or lower the token limits.")


def _padded_vocab_covers_the_vocab(cfg: Any) -> None:
    model = cfg.model
    if model.padded_vocab_size is not None and model.padded_vocab_size < model.vocab_size:
        raise ConfigError(f"model.padded_vocab_size={model.padded_vocab_size} is below model.vocab_size="
                          f"{model.vocab_size}: the embedding needs a row per token. Raise it or set null.")


def _autocast_needs_fp32_weights(cfg: Any) -> None:
    if cfg.model.autocast != "none" and cfg.model.dtype == "bf16":
        raise ConfigError(f"model.autocast={cfg.model.autocast} runs fp32 weights' forward passes in bf16, but "
                          "model.dtype=bf16 makes the weights bf16 already (autocast would change nothing). Fix: "
                          "model.dtype=fp32 (mixed precision) or model.autocast=none (bf16 weights).")


def _tiny_sizes_unused_with_a_path(cfg: Any) -> None:
    model = cfg.model
    if model.path:
        changed = [f.name for f in fields(ModelConfig) if f.name in TINY_SIZE_KEYS and model[f.name] != f.default]
        if changed:
            warnings.warn(f"model.path is set, so the tiny-model sizes {', '.join('model.' + k for k in changed)} "
                          "are ignored (the model's own config.json defines its shape).", stacklevel=4)


@dataclass
class ModelConfig:
    name: str = "tiny"
    #: hub id or local directory; null builds the tiny model below from its sizes
    path: str | None = None
    trust_remote_code: bool = False
    #: which copy of a real model loads: hub (`path`, a hub id or folder) | package (the GGUF file `package_file`
    #: inside the installed PyPI package `package`, built once into a folder, epo_cli/models/packaged.py) |
    #: auto (hub when the hub answers, else package; decided once per run and saved in its config.yaml)
    source: str = one_of("hub", ("auto", "hub", "package"))
    package: str | None = None
    package_file: str | None = None
    #: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    dtype: str = one_of("auto", ("auto", "fp32", "bf16"))
    #: mixed precision for fp32 weights: none | bf16 = the forward passes (the hf engine's generation,
    #: scoring, the update's forward, the critic) run under torch.autocast in bfloat16 while the weights,
    #: gradients and Adam stay fp32 (the CPU counterpart of DeepSpeed's bf16 on GPU; vLLM, which has no
    #: autocast, holds its copy in bf16). Every forward of a run uses it: the ratio's log-probs share a precision.
    autocast: str = one_of("none", ("none", "bf16"))
    attn_implementation: str = one_of("sdpa", ("sdpa", "eager", "flash_attention_2", "flash_attention_3",
                                      "flex_attention"))
    gradient_checkpointing: bool = False
    # tiny model (Qwen2 architecture) sizes; ignored when `path` is set
    hidden_size: int = num(64, ge=1)
    intermediate_size: int = num(256, ge=1)
    num_hidden_layers: int = num(2, ge=1)
    num_attention_heads: int = num(4, ge=1)
    num_key_value_heads: int = num(2, ge=1)
    max_position_embeddings: int = num(2048, ge=1)
    #: target size of the locally trained tokenizer
    vocab_size: int = num(1024, ge=259)  # 256 byte tokens + 3 special tokens at least
    #: embedding rows of the model (null = the tokenizer's size); e.g. 151936 to match Qwen2.5's shapes
    padded_vocab_size: int | None = num(None, ge=1)
    tie_word_embeddings: bool = True
    #: where the locally trained tokenizer and built model are cached; null = ~/.cache/epo
    cache_dir: str | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)

    rules: ClassVar[tuple[Rule, ...]] = (_heads_divide, _positions_fit_a_turn, _padded_vocab_covers_the_vocab,
                                         _autocast_needs_fp32_weights, _tiny_sizes_unused_with_a_path)


def _coef_bounds_ordered(cfg: Any) -> None:
    if cfg.entropy.min_coef > cfg.entropy.max_coef:
        raise ConfigError(f"entropy.min_coef={cfg.entropy.min_coef:g} must be <= entropy.max_coef="
                          f"{cfg.entropy.max_coef:g}.")


@dataclass
class EntropyConfig:
    """The entropy coefficient lambda over training (multiplies L_H and, with beta_k, L_smooth)."""

    #: a schedule of epo_cli/algos/schedules.py whose parameters this section has: constant (coef) | linear |
    #: cosine | exp_anneal | two_phase | adaptive_target | ...
    schedule: str = one_of("constant", registry="schedules")
    coef: float = num(0.001, ge=0)
    start: float = num(0.001, ge=0)
    end: float = num(0.0, ge=0)
    #: two_phase (source article): rise start -> peak over `exploration_share` of training, then fall to end
    peak: float = num(0.005, ge=0)
    exploration_share: float = num(0.3, ge=0, le=1)
    #: exp_anneal: coef = start * decay_rate ** (step / total_steps), floored at `end`
    decay_rate: float = num(0.1, gt=0, le=1)
    #: adaptive_target: move coef towards keeping the entropy at `target`
    target: float = num(0.5, ge=0)
    adapt_lr: float = num(0.1, gt=0)
    min_coef: float = num(0.0, ge=0)
    max_coef: float = num(0.05, ge=0)

    rules: ClassVar[tuple[Rule, ...]] = (_coef_bounds_ordered,)


@dataclass
class CurriculumConfig:
    #: a curriculum registered in epo_cli/algos/curriculum.py: none | staged | adaptive | horizon | subgoal_rewards
    name: str = one_of("none", registry="curricula")
    #: staged / adaptive: ordered levels (household levels, ALFWorld task types, ScienceWorld task lists)
    levels: list[str] = field(default_factory=list)
    window: int = num(3, ge=1)
    promote_at: float = num(0.7, ge=0, le=1)
    demote_at: float | None = num(None, ge=0, le=1)
    #: share of each staged batch replaying earlier levels (below 1: the current level must be trained too)
    replay_share: float = num(0.2, ge=0, lt=1)
    #: adaptive: progress (change in success) | closeness (to 0.5)
    adaptive_signal: str = one_of("progress", ("progress", "closeness"))
    exploration_floor: float = num(0.1, ge=0, le=1)
    #: horizon: max turns grow from start_turns to env.max_turns over `horizon_share` of training (0: the full
    #: env.max_turns from the start); can be combined with any curriculum
    horizon: bool = False
    start_turns: int = num(10, ge=1)
    horizon_share: float = num(0.5, ge=0, le=1)
    #: intermediate rewards from progress events (can be combined with any curriculum)
    subgoal_rewards: bool = False
    subgoal_coef: float = num(1.0, ge=0)
    #: the subgoal coefficient decays linearly to 0 by this share of training (null = never)
    subgoal_decay_share: float | None = num(0.8, gt=0, le=1)

    switches: ClassVar[tuple[Switch, ...]] = (
        Switch(("curriculum.start_turns", "curriculum.horizon_share"),
               lambda cfg: cfg.curriculum.horizon or cfg.curriculum.name == "horizon",
               lambda cfg: "curriculum.horizon=false"),
        Switch(("curriculum.subgoal_coef", "curriculum.subgoal_decay_share"),
               lambda cfg: cfg.curriculum.subgoal_rewards or cfg.curriculum.name == "subgoal_rewards",
               lambda cfg: "curriculum.subgoal_rewards=false"),
    )


def _offload_needs_its_zero_stage(cfg: Any) -> None:
    ds = cfg.deepspeed
    if ds.offload_param and ds.zero_stage != 3:
        raise ConfigError(f"deepspeed.offload_param=true needs deepspeed.zero_stage=3 (got {ds.zero_stage}): "
                          "only ZeRO-3 partitions the parameters it would offload.")
    if ds.offload_optimizer and ds.zero_stage == 0:
        raise ConfigError("deepspeed.offload_optimizer=true needs deepspeed.zero_stage >= 1 (ZeRO-0 keeps the "
                          "optimizer on the device).")


@dataclass
class DeepSpeedConfig:
    name: str = "zero0"
    zero_stage: int = one_of(0, (0, 1, 2, 3))
    offload_optimizer: bool = False
    offload_param: bool = False
    #: auto: bf16 on GPU, fp32 on CPU
    precision: str = one_of("auto", ("auto", "fp32", "bf16"))
    activation_checkpointing: bool = False

    rules: ClassVar[tuple[Rule, ...]] = (_offload_needs_its_zero_stage,)


@dataclass
class LauncherConfig:
    name: str = one_of("local", ("local", "deepspeed", "slurm"))
    #: GPUs per node (deepspeed launcher); on a machine without GPUs use num_procs for CPU ranks
    num_gpus: int = num(0, ge=0, le=1024)
    num_nodes: int = num(1, ge=1, le=100_000)
    num_procs: int = num(1, ge=1, le=1024)
    hostfile: str | None = None
    master_addr: str = "127.0.0.1"
    #: 0 = a free port (single node)
    master_port: int = num(29500, ge=0, le=65535)
    #: seconds a collective may wait before a hung or dead rank ends the job (at most a week)
    timeout_s: float = num(600.0, gt=0, le=7 * 86400)
    # slurm (submitit)
    partition: str | None = None
    time_min: int = num(60 * 24, ge=1)
    cpus_per_task: int = num(8, ge=1, le=1024)
    account: str | None = None

    switches: ClassVar[tuple[Switch, ...]] = (
        Switch(("launcher.num_gpus", "launcher.num_nodes", "launcher.num_procs", "launcher.hostfile"),
               lambda cfg: cfg.launcher.name != "local",
               lambda cfg: "launcher=local runs one process; start ranks with launcher=deepspeed or launcher=slurm"),
        Switch(("launcher.partition", "launcher.time_min", "launcher.cpus_per_task", "launcher.account"),
               lambda cfg: cfg.launcher.name == "slurm", lambda cfg: "these configure launcher=slurm"),
    )


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "epo"
    entity: str | None = None
    #: online | offline | disabled (WANDB_MODE)
    mode: str = one_of("offline", ("online", "offline", "disabled"))


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


def _stop_after_before_the_end(cfg: Any) -> None:
    tr = cfg.trainer
    if tr.stop_after is not None and tr.stop_after >= tr.total_steps:
        warnings.warn(f"trainer.stop_after={tr.stop_after} >= trainer.total_steps={tr.total_steps}: the run "
                      "ends at total_steps first, so stop_after has no effect.", stacklevel=4)


@dataclass
class TrainerConfig:
    #: RL iterations (rollout + update), or optimizer steps for sft
    total_steps: int = num(100, ge=1, le=10_000_000)
    #: 0 = only at the end
    save_every: int = num(50, ge=0)
    #: 0 = never
    eval_every: int = num(50, ge=0)
    eval_episodes: int = num(32, ge=1)
    #: keep a `best` checkpoint by this metric (null = none)
    best_metric: str | None = "eval/success"
    #: null | auto | <run dir or checkpoint dir>
    resume: str | None = None
    #: end this process (with a checkpoint) after this many steps, to continue later with trainer.resume;
    #: schedules still span total_steps (for time-limited jobs)
    stop_after: int | None = num(None, ge=1)
    #: stop after this many consecutive updates skipped for a non-finite loss or gradient
    max_nonfinite_skips: int = num(3, ge=1)
    #: auto | cpu | cuda
    device: str = one_of("auto", ("auto", "cpu", "cuda"))
    deterministic: bool = True
    #: 0 = keep all
    keep_checkpoints: int = num(2, ge=0)
    #: torch intra-op threads per process (1 is fastest on small CPU machines; torch takes a C int)
    num_threads: int = num(1, ge=1, le=1024)

    rules: ClassVar[tuple[Rule, ...]] = (_stop_after_before_the_end,)


@dataclass
class VLLMRolloutConfig:
    """rollout.engine=vllm's memory settings (epo_cli/rollout/engines/vllm_engine.py)."""

    #: CPU: GiB of KV cache, a whole number (VLLM_CPU_KVCACHE_SPACE; unset, vLLM would reserve 90% of RAM)
    kv_cache_gib: int = num(1, ge=1)
    #: GPU: share of the device's memory vLLM may take (weights + KV cache), beside the trainer's
    gpu_memory_utilization: float = num(0.3, gt=0, le=1)
    #: GPU: free vLLM's weights and KV cache while the update runs (vLLM sleep mode; no-op on CPU)
    sleep_during_update: bool = True
    #: most sequences vLLM schedules in one step
    max_num_seqs: int = num(256, ge=1)
    #: let vLLM download a hub id (else the policy must be a local folder, as this offline setup needs)
    allow_hub: bool = False


@dataclass
class RolloutCorrectionConfig:
    """The bounds of the rollout/training mismatch corrections (epo_cli/algos/rollout_correction.py): token
    weights min(pi_trainer / pi_engine, token_cap) (Yao et al. 2025's truncated importance sampling) and a
    sequence mask dropping rows whose geometric-mean ratio leaves [1/seq_bound, seq_bound]. The mismatch
    metrics count the tokens and rows past them (rollout/tis_truncated_share, rollout/seq_masked_share)."""

    #: what the policy loss applies: none (the metrics only) | tis (token weights min(ratio, token_cap)) | mask
    #: (rows outside seq_bound dropped) | tis_and_mask; any but none keeps the engine's log-probs
    mode: str = one_of("none", ("none", "tis", "mask", "tis_and_mask"))
    #: token-level cap on the importance weight (verl's rollout_is_threshold default: 2.0)
    token_cap: float = num(2.0, gt=1)
    #: sequence mask bound on the per-token geometric-mean ratio (verl's geometric mask: [1/bound, bound])
    seq_bound: float = num(2.0, gt=1)


#: the lowest sampling temperature (below it, logits / temperature overflow float32); 0 means greedy where allowed
MIN_TEMPERATURE = 0.01


def _eval_temperature_greedy_or_sampled(cfg: Any) -> None:
    t = cfg.rollout.eval_temperature
    if 0 < t < MIN_TEMPERATURE:
        raise ConfigError(f"rollout.eval_temperature={t:g} is out of range; allowed: 0 (greedy) or "
                          f"{MIN_TEMPERATURE:g} <= value (below it, logits / temperature overflow float32).")


@dataclass
class RolloutConfig:
    #: what generates the rollouts: hf (rollout/generation.py) | vllm | a plugin's "package.module:Class"
    engine: str = one_of("hf", registry="rollout_engines")
    vllm: VLLMRolloutConfig = field(default_factory=VLLMRolloutConfig)
    #: log rollout/logp_diff_* (engine vs trainer log-probs of the sampled tokens) every step; null: on for
    #: every engine but hf, whose log-probs come from the module the trainer scores with (their difference
    #: is rounding that depends on how rows were batched: it would make the metrics batch-dependent)
    mismatch_metrics: bool | None = None
    correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    max_new_tokens: int = num(64, ge=1)
    max_prompt_tokens: int = num(1024, ge=1)
    #: sampling temperature of the training rollouts (> 0: the policy gradient needs a sampling policy; at
    #: least 0.01: below, logits / temperature overflow float32 and the sampled tokens' log-probs are not finite)
    temperature: float = num(1.0, ge=MIN_TEMPERATURE)
    top_p: float = num(1.0, gt=0, le=1)
    #: 0 = no top-k filter
    top_k: int = num(0, ge=0)
    #: evaluation during training; 0 = greedy
    eval_temperature: float = num(0.4, ge=0)  # 0 or >= MIN_TEMPERATURE (its rule below)
    #: generation stops at this string (or EOS)
    stop: str = "</action>"
    #: envs generated for in one batched `generate` call (0 = all active envs)
    generation_batch_size: int = num(0, ge=0)
    #: generate for the envs that have answered while env workers step the others (same episodes as
    #: lock-step; only with env.num_workers > 0, in-process envs cannot step meanwhile). Off by default:
    #: not faster on a 2-core machine, where envs and generation share the CPU (docs/performance.md)
    overlap: bool = False
    #: prefill each distinct prompt once per generate call, sharing its KV cache with the rows that have
    #: the same prompt (a GRPO group's first turn); same tokens as without
    shared_prefill: bool = True
    #: decoded trajectories written to samples/ per evaluation
    num_samples_to_save: int = num(4, ge=0)

    rules: ClassVar[tuple[Rule, ...]] = (_eval_temperature_greedy_or_sampled,)


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = num(0, ge=0)
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
# Groups and field-rule checks (composition lives in epo_cli/compose/)
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


def group_options(group: str, nested: bool = False) -> list[str]:
    """Options of a config group, from the yaml files in conf/<group>/; nested=True also those in its subfolders,
    as `sub/name` (e.g. experiment=paper/epo_alfworld_grpo_3b)."""
    folder = config_dir() / group
    options = sorted(p.stem for p in folder.glob("*.yaml"))
    if nested:
        options += sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.glob("*/**/*.yaml"))
    return options


def _choice(key: str, value: Any, valid: list[Any] | tuple[Any, ...]) -> None:
    if value not in valid:
        close = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"Invalid value '{value}' for '{key}'.{hint} Valid values: "
                          f"{', '.join(str(v) for v in valid)}.")


def section_schema(f: Any) -> type | None:
    """The schema of a field that is a section (a dataclass made by its default_factory), else None."""
    if f.default_factory is not MISSING:
        made = f.default_factory()
        return type(made) if is_dataclass(made) else None
    return None


def schema_at(key_path: str, env_schema: type) -> type | None:
    """The schema dataclass that owns the node at `key_path` (e.g. 'trainer' or 'algo.kl'), None if it is no
    section; the env section's is `env_schema` (the schema of env.name)."""
    node: Any = RunConfig
    for part in [p for p in key_path.split(".") if p]:
        if not is_dataclass(node):
            return None
        match = {f.name: f for f in fields(node)}.get(part)
        if match is None:
            return None
        node = env_schema if (node is RunConfig and part == "env") else section_schema(match)
    return node


def check_field_rules(node: DictConfig, schema: type, prefix: str = "",
                      registries: Mapping[str, list[str]] | None = None,
                      schemas: Mapping[str, type] | None = None) -> None:
    """Walk `schema` and `node` together and check every field's declared range (`num`) and valid values
    (`one_of`): one ConfigError naming the key, the value and what is allowed.

    `registries` maps the registry names `one_of(registry=...)` refers to onto their component names (the
    caller reads them from the registries: this module imports no component); `schemas` maps a dotted key
    onto the schema checked there instead of the declared one (the env section's schema depends on env.name).
    """
    registries, schemas = registries or {}, schemas or {}
    for f in fields(schema):
        key, value = f"{prefix}{f.name}", node[f.name]
        nested = schemas.get(key) or section_schema(f)
        if nested is not None:
            check_field_rules(value, nested, key + ".", registries, schemas)
            continue
        if value is None:
            continue
        if value == "" and "None" in str(f.type) and "str" in str(f.type):  # `model.path=` is not "no path"
            raise ConfigError(f"'{key}' is empty. Give it a value, or {key}=null for none.")
        values = list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]
        for v in values:  # every number, whether or not its field declares a range
            if number_problem(v):
                allowed = f"; allowed: {_range_text(f.metadata['range'])}" if "range" in f.metadata else ""
                raise ConfigError(f"Invalid value for '{key}': {shown_number(v)} {number_problem(v)}{allowed}. "
                                  f"Fix: {key}=<a finite value{' in that range' if allowed else ''}>.")
        if "range" in f.metadata:
            for v in values:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not _in_range(v, f.metadata["range"]):
                    raise ConfigError(f"Invalid value for '{key}': {v} is out of range; allowed: "
                                      f"{_range_text(f.metadata['range'])}. Fix: {key}=<a value in that range>.")
        if "choices" in f.metadata:
            valid = list(f.metadata["choices"])
            if f.metadata.get("registry"):
                names = list(registries[f.metadata["registry"]])
                valid = names + [v for v in valid if v not in names]
            for v in values:
                _choice(key, v, valid)


#: ModelConfig keys that only shape the locally built tiny model (ignored when model.path is set)
TINY_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "max_position_embeddings", "vocab_size", "padded_vocab_size",
                  "tie_word_embeddings")


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
