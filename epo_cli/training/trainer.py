"""The training recipe: the loop reads top to bottom in `Trainer.train_rl` (RL) and `Trainer.train_sft`.

    epo train algo=epo env=household trainer.total_steps=20

One RL iteration (`rl_step`, numbered as there):
    1 episodes   <- curriculum tasks (tasks_per_step x group_size; this rank plays whole groups), played by
                    run_episodes(policy, env pool, slots) -> one sample per turn (TurnBatch)
                    (algo.dynamic_sampling: zero-variance groups replaced by fresh rounds, DAPO)
    2 scoring    <- old log-probs, entropy (sampling temperature), reference log-probs, critic values
    3 entropy    <- per-turn statistics of the rollout's entropies (all-reduced; no extra forward pass),
                    fluctuation monitor
    4 advantages <- compute_advantages: the estimator algo.estimator names  gae | grpo | rloo | gigpo
    5 coefs      <- schedules: lambda (entropy group), beta_k (algo.phase), KL weight (and the lr)
    6 update     <- ppo_epochs x mini-batches (`_mini_batch_step`) x micro-batches:
                    loss = sum_i coef_i * term_i   (e.g. policy_clip + 0.01*kl - lambda*entropy
                                                    + lambda*beta_k*entropy_smoothing)
                    engine.backward(loss); one engine.step() per mini-batch; critic likewise (ppo)
    7 state      <- entropy history, entropy schedule, rollout copy of the weights, curriculum
    8 metrics    <- epo_cli/training/step_metrics.py
then (`_after_step`): evaluate every eval_every, log, checkpoint every save_every.
Every derived seed comes from epo_cli.seeding.derive_seed(cfg.seed, what, ...).
"""

from __future__ import annotations

import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from epo_cli.algos.advantages import compute_advantages
from epo_cli.algos.aggregation import AGGREGATIONS, normalized_weights
from epo_cli.algos.dynamic_sampling import choose_groups, concat_batches, group_has_signal, rows_of_groups
from epo_cli.algos.entropy import EntropyHistory, FluctuationMonitor, step_statistics
from epo_cli.algos.losses import (
    LossStack,
    PolicyOutputs,
    build_loss_terms,
    build_value_term,
    loss_coefficients,
    required_aggregations,
)
from epo_cli.algos.schedules import (
    build_entropy_schedule,
    build_kl_schedule,
    build_lr_schedule,
    build_phase_schedule,
)
from epo_cli.curriculum import build_curriculum
from epo_cli.envs import make_suite
from epo_cli.envs.pool import EnvPool
from epo_cli.errors import UserError
from epo_cli.evaluation import eval_tasks, evaluate_split, write_samples  # shared with `epo eval`
from epo_cli.loggers.jsonl import truncate_metrics_file
from epo_cli.loggers.logger import MetricsLogger
from epo_cli.models.loading import (
    ValueModel,
    apply_lora,
    check_context,
    frozen_copy,
    load_causal_lm,
    load_tokenizer,
    model_source,
    resolve_dtype,
)
from epo_cli.rollout.batch import MicroBatch, TurnBatch
from epo_cli.rollout.demos import episodes_to_records, read_jsonl, records_to_batch, write_jsonl
from epo_cli.rollout.generation import SamplingParams
from epo_cli.rollout.prompts import PromptBuilder, chat_encoder
from epo_cli.rollout.rollout import (
    Episode,
    EpisodeSlot,
    ExpertPolicy,
    ModelPolicy,
    PlaySettings,
    RolloutStats,
    episode_slots,
    episodes_to_batch,
    run_episodes,
)
from epo_cli.run_dir import write_status
from epo_cli.saved_state import refusing_damaged
from epo_cli.seeding import derive_seed
from epo_cli.training import checkpoint
from epo_cli.training.engine import (
    RolloutModule,
    all_gather_objects,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    build_engine,
    grad_norm,
    inference_copy,
    init_distributed,
    set_lr,
    step_was_skipped,
)
from epo_cli.training.finite import check_finite_weights
from epo_cli.training.forward import collate, plan_micro_batches, policy_forward, value_forward
from epo_cli.training.packing import default_budget, enable_packing, plan_packs
from epo_cli.training.step_metrics import (
    UpdateTally,
    batch_metrics,
    critic_metrics,
    level_results,
    perf_metrics,
    reduce_sums,
    rollout_metrics,
    rollout_sums,
)
from epo_cli.training.stop import STOP, signal_name


@dataclass
class TrainState:
    """Everything besides model/optimizer that a resume must restore."""

    step: int = 0
    consecutive_skips: int = 0
    best_value: float | None = None
    best_step: int | None = None
    logger_ids: dict[str, str] = field(default_factory=dict)


@dataclass
class _UpdateInputs:
    """What every mini-batch step of one update shares."""

    batch: TurnBatch
    coefs: dict[str, float]
    history: EntropyHistory | None  # the entropy references of entropy_smoothing (None: no smoothing term)
    on_policy: set[int]  # rows the update's first forward scores (see Trainer.on_policy_rows)
    lengths: list[int]  # prompt + response tokens of each row (micro-batch planning)
    modes: list[str]  # the aggregation modes of the loss terms, sorted (the same order on every rank)
    row_denominators: dict[str, torch.Tensor]  # each row's share of each mode's denominator


class Trainer:
    def __init__(self, cfg: DictConfig, run: Path) -> None:
        self.cfg, self.run = cfg, run
        self.dist = init_distributed(cfg)
        self._seed_process()
        self.suite = make_suite(cfg.env)
        self.suite.check()
        self.curriculum = build_curriculum(cfg)
        self._build_models()
        self._build_algorithm()
        self.state = TrainState()
        self.stop_signal: int | None = None  # a stop signal all ranks agreed on (epo_cli.training.stop)
        self.sampling_metrics: dict[str, float] = {}  # dynamic sampling's counters of the last rollout
        self._resume_and_open_outputs()

    # ------------------------------------------------------------------------------------------------------
    # set-up
    # ------------------------------------------------------------------------------------------------------
    def _seed_process(self) -> None:
        """Threads, determinism and this process's global RNGs."""
        cfg = self.cfg
        torch.set_num_threads(cfg.trainer.num_threads)
        if cfg.trainer.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        process_seed = derive_seed(cfg.seed, "process", self.dist.rank)
        torch.manual_seed(process_seed)
        random.seed(process_seed)

    def _build_models(self) -> None:
        """Tokenizer, policy (DeepSpeed engine + the copy that generates), frozen reference, critic (ppo)."""
        cfg, algo = self.cfg, self.cfg.algo
        source = model_source(cfg.model, self.suite, cfg.seed)
        self.tokenizer = load_tokenizer(source, cfg.model)
        self.vocab_limit = len(self.tokenizer)
        dtype = resolve_dtype(cfg.model, self.dist.device)
        policy = load_causal_lm(source, cfg.model, dtype).to(self.dist.device)
        check_context(policy, cfg.rollout, source)  # a prompt and its response fit the model's positions
        # packed micro-batches for scoring and update (before the copies below, which inherit the attention)
        self.packing = enable_packing(policy, algo.pack_tokens)
        self.ref_model = frozen_copy(policy) if "kl" in algo.loss_terms else None
        policy = apply_lora(policy, cfg.model.lora)
        critic = ValueModel(frozen_copy(policy if cfg.model.lora.rank <= 0 else policy.get_base_model())) \
            if algo.estimator == "gae" else None
        if critic is not None:
            for p in critic.parameters():
                p.requires_grad_(True)
        template = inference_copy(policy, cfg.deepspeed.zero_stage)  # ZeRO-3: before DeepSpeed partitions
        self.engine = build_engine(policy, cfg, self.dist, lr=algo.lr, weight_decay=algo.weight_decay)
        self.policy = RolloutModule(self.engine, template, cfg.deepspeed.zero_stage)
        self.critic_engine = None
        if critic is not None:
            critic_template = inference_copy(critic, cfg.deepspeed.zero_stage)
            self.critic_engine = build_engine(critic, cfg, self.dist, lr=algo.value.lr or algo.lr)
            self.critic = RolloutModule(self.critic_engine, critic_template, cfg.deepspeed.zero_stage)
            self.critic.refresh()  # ZeRO-3 copies take rank 0's weights, which DeepSpeed broadcast
        self.policy.refresh()

    def _build_algorithm(self) -> None:
        """Loss terms, schedules, entropy history and monitor, prompt builder."""
        cfg, algo = self.cfg, self.cfg.algo
        self.loss_stack = LossStack(build_loss_terms(algo))
        self.value_term = build_value_term(algo) if self.critic_engine is not None else None
        self.entropy_schedule = build_entropy_schedule(cfg.entropy)
        self.phase_schedule = build_phase_schedule(algo.phase)
        self.kl_schedule = build_kl_schedule(algo)
        self.lr_schedule = build_lr_schedule(algo)
        self.history = EntropyHistory(algo.entropy_smoothing, max_turns=cfg.env.max_turns)
        self.monitor = FluctuationMonitor(algo.monitor)
        self.builder = PromptBuilder(cfg.env.prompt_template, cfg.env.history_length,
                                     cfg.rollout.max_prompt_tokens, chat_encoder(self.tokenizer))

    def _resume_and_open_outputs(self) -> None:
        """Load the checkpoint to resume from (if any), then start the env pool and the loggers."""
        cfg, run = self.cfg, self.run
        resume_from = checkpoint.resolve_resume(cfg.trainer.resume, run)
        if resume_from is not None:
            self._load(resume_from)
        # the envs' expert (env.expert=null) runs only where its actions are read: SFT from the expert
        reads_expert = cfg.algo.name == "sft" and cfg.algo.demos == "expert"
        self.pool = EnvPool(make_suite(cfg.env, reads_expert=reads_expert), num_workers=self._num_workers(),
                            step_timeout_s=cfg.env.step_timeout_s)
        self.logger = MetricsLogger(cfg, run, enabled=self.dist.is_main, resume_ids=self.state.logger_ids)
        self.state.logger_ids = self.logger.run_ids
        if resume_from is not None and self.dist.is_main:
            truncate_metrics_file(run, self.state.step)  # rows after the checkpoint are re-logged
            # from an earlier step_N: newer checkpoints belong to the abandoned branch (kept, moved aside)
            for moved in checkpoint.supersede_newer(run, self.state.step):
                self.logger.warn(f"resuming from step {self.state.step}: the newer checkpoint was moved to "
                                 f"{moved} (nothing deleted)")
            self.logger.info(f"resumed from {resume_from} at step {self.state.step}")
        if resume_from is not None:
            barrier()

    # ------------------------------------------------------------------------------------------------------
    # helpers
    # ------------------------------------------------------------------------------------------------------
    def _num_workers(self) -> int:
        n = self.cfg.env.num_workers
        return (os.cpu_count() or 1) if n is None else n

    def _sampling(self, temperature: float) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(r.max_new_tokens, temperature, r.top_p, r.top_k, r.stop)

    def _model_policy(self, temperature: float) -> ModelPolicy:
        return ModelPolicy(self.policy.module, self.tokenizer, self._sampling(temperature), self.vocab_limit,
                           self.cfg.rollout.generation_batch_size, self.cfg.rollout.shared_prefill)

    def _my_share(self, items: list[Any]) -> list[Any]:
        """This rank's contiguous share of `items` (for evaluation episodes)."""
        n, w, r = len(items), self.dist.world_size, self.dist.rank
        return items[r * n // w:(r + 1) * n // w]

    # ------------------------------------------------------------------------------------------------------
    # the loops
    # ------------------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        try:
            write_status(self.run, "running") if self.dist.is_main else None
            final = self.train_sft() if self.cfg.algo.name == "sft" else self.train_rl()
        except (OSError, RuntimeError) as err:
            if not checkpoint.is_disk_error(err):
                raise
            raise UserError(checkpoint.disk_error_message(self.run, err)) from None
        finally:
            self.pool.close()
            self.logger.close()
        return final

    def train_rl(self) -> dict[str, float]:
        cfg = self.cfg
        total = cfg.trainer.total_steps
        metrics: dict[str, float] = {}
        self._agree_on_stop()  # a signal during start-up: stop before the first step
        while self.state.step < total and self.stop_signal is None:
            step = self.state.step
            self._set_learning_rates(step, total)
            metrics = self.rl_step(step, total)
            if self._after_step(step + 1, total, metrics):
                break
        self._finish()
        return metrics

    def _set_learning_rates(self, step: int, total: int) -> None:
        """algo.lr (policy) and algo.value.lr (critic) times the warm-up/decay multiplier of this step."""
        algo = self.cfg.algo
        multiplier = self.lr_schedule(step, total)
        set_lr(self.engine, algo.lr * multiplier)
        if self.critic_engine is not None:
            set_lr(self.critic_engine, (algo.value.lr or algo.lr) * multiplier)

    def rollout(self, step: int, total: int) -> tuple[list[Episode], TurnBatch, RolloutStats]:
        """Step 1 of an RL iteration: the step's tasks (this rank's whole groups), played by the current
        policy into one sample per turn (rewards as configured, no scoring yet).

        With algo.dynamic_sampling, groups without score variance are replaced by fresh rounds (see
        epo_cli/algos/dynamic_sampling.py); the episodes returned are all those played (for the rollout
        metrics: every round is an unbiased draw), the batch holds the chosen groups only."""
        algo = self.cfg.algo
        groups = algo.tasks_per_step
        if groups % self.dist.world_size:
            raise UserError(f"algo.tasks_per_step={groups} must be divisible by the number of ranks "
                            f"({self.dist.world_size}) so every GRPO group stays on one rank.")
        self.sampling_metrics = {}
        if not algo.dynamic_sampling:
            return self._play_round(step, total, 0)
        episodes, batches, stats = [], [], RolloutStats()
        played: list[tuple[int, bool]] = []  # (global group id, has signal), in play order, on every rank
        rounds = 0
        for r in range(1 + algo.dynamic_sampling_max_rounds):
            eps, batch, rstats = self._play_round(step, total, r)
            rounds += 1
            episodes += eps
            batches.append(batch)
            for name in ("rollout_s", "generate_s", "env_s", "env_steps", "generated_tokens"):
                setattr(stats, name, getattr(stats, name) + getattr(rstats, name))
            signal = sorted(group_has_signal(batch, algo.dynamic_sampling_metric).items())
            played += sorted(item for rank_items in all_gather_objects(signal) for item in rank_items)
            if sum(ok for _, ok in played) >= groups:
                break
        chosen, topped_up = choose_groups(played, groups)
        everyone = concat_batches(all_gather_objects(concat_batches(batches)))  # every rank's played rows
        w, k = self.dist.world_size, self.dist.rank
        mine = chosen[k * groups // w:(k + 1) * groups // w]  # whole groups, the same count on every rank
        batch = everyone.select(rows_of_groups(everyone, mine))
        self.sampling_metrics = {
            "rollout/groups_dropped": float(sum(not ok for _, ok in played) - topped_up),
            "rollout/groups_topped_up": float(topped_up),
            "rollout/sampling_rounds": float(rounds - 1),
        }
        return episodes, batch, stats

    def _play_round(self, step: int, total: int, round_index: int) -> tuple[list[Episode], TurnBatch, RolloutStats]:
        """One round of tasks_per_step groups; this rank plays its share of whole groups. Group and
        trajectory ids are global and include the round, so sampling seeds do not depend on the rank."""
        cfg, algo = self.cfg, self.cfg.algo
        groups = algo.tasks_per_step

        # tasks: identical draw on every rank; this rank plays whole groups
        rng = random.Random(derive_seed(cfg.seed, "tasks", step, round_index))
        tasks = self.curriculum.sample_tasks(self.suite, groups, rng, step, total)
        first = round_index * groups  # global id of this round's first group
        mine = range(self.dist.rank * groups // self.dist.world_size,
                     (self.dist.rank + 1) * groups // self.dist.world_size)
        slots = [EpisodeSlot(tasks[g], traj_id=(first + g) * algo.group_size + k, group_id=first + g)
                 for g in mine for k in range(algo.group_size)]

        # play them: one sample per turn
        policy = self._model_policy(cfg.rollout.temperature)
        settings = PlaySettings(self.builder, self.tokenizer, self.curriculum.max_turns(step, total), seed=cfg.seed,
                                step=step, overlap=cfg.rollout.overlap)
        episodes, rstats = run_episodes(policy, self.pool, slots, settings)
        batch = episodes_to_batch(episodes, algo.reward_scale, algo.invalid_action_penalty,
                                  self.curriculum.subgoal_coef(step, total))
        return episodes, batch, rstats

    def rl_step(self, step: int, total: int) -> dict[str, float]:
        """One RL iteration (the module docstring's steps); returns its metrics."""
        algo = self.cfg.algo
        # 1. rollout: this rank's whole groups, one sample per turn
        episodes, batch, rstats = self.rollout(step, total)
        max_turns, subgoal_coef = self.curriculum.max_turns(step, total), self.curriculum.subgoal_coef(step, total)

        # 2. scoring forward (no grad): old log-probs, entropy, reference log-probs, values. The samples of
        #    the first mini-batch skip the policy's part: the update's first forward, made with the very
        #    weights that played the rollout, scores them (`on_policy`, algo.reuse_scoring_forward)
        t0 = time.perf_counter()
        on_policy = self.on_policy_rows(batch, step)
        self.score(batch, skip_policy=on_policy)
        score_s = time.perf_counter() - t0

        # 3. entropy statistics of the rollout (all-reduced; no extra forward pass) and the fluctuation
        #    monitor; after the update when it scores samples itself (only a monitor that clamps needs
        #    them before). The history is updated after the update: its references use steps 0..k-1 only
        #    (paper: Href(k)). The choice is made from the config, the same on every rank (collectives).
        metrics = self._entropy_reference_metrics()
        stats = None if self.reuses_scoring() else self._entropy_statistics(batch, step, max_turns, metrics)

        # 4. advantages
        if algo.estimator != "none":
            batch.advantages, batch.returns = compute_advantages(batch, algo, all_reduce_sum)

        # 5. coefficients from schedules: L = L_RL - lambda * (L_H - beta_k * L_smooth) + kl_weight * KL
        coefs = self._coefficients(step, total, monitor_alert=bool(stats and stats[3]), metrics=metrics)

        # 6. update
        t0 = time.perf_counter()
        metrics.update(self.update(batch, coefs, step, self.history, on_policy=on_policy))
        update_s = time.perf_counter() - t0

        # 7. state: entropy history and schedule, the rollout's copy of the weights, the curriculum (true
        #    task success per level, all ranks)
        sums, counts, entropy_now, _ = stats or self._entropy_statistics(batch, step, max_turns, metrics)
        self.history.update(sums, counts)
        self.entropy_schedule.observe(entropy_now)
        self._refresh_rollout_copies()
        reduced = reduce_sums(rollout_sums(episodes, rstats), self.dist.device)
        self.curriculum.observe(step, level_results(reduced))

        # 8. metrics (all ranks; epo_cli/training/step_metrics.py says what each is)
        metrics.update(rollout_metrics(reduced))
        metrics.update(self.curriculum.metrics())
        metrics.update(self.sampling_metrics)
        metrics.update(batch_metrics(batch, len(on_policy), subgoal_coef, max_turns))
        metrics.update(perf_metrics(rstats, reduced, score_s, update_s, self.engine.optimizer.param_groups[0]["lr"]))
        return metrics

    def _entropy_reference_metrics(self) -> dict[str, float]:
        """policy/entropy_ref: the smoothing band's centre (global reference) for this update, once known."""
        if self.history.num_steps > 0:
            return {"policy/entropy_ref": self.history.global_stream.value()}
        return {}

    def _coefficients(self, step: int, total: int, monitor_alert: bool, metrics: dict[str, float]) -> dict[str, float]:
        """This step's loss coefficients (lambda, beta_k, KL weight from their schedules; the entropy terms
        scaled down when the monitor clamps); coef/* go into `metrics`."""
        algo = self.cfg.algo
        lam = self.entropy_schedule(step, total)
        beta = self.phase_schedule(step, total)
        kl_weight = self.kl_schedule(step, total)
        clamp = algo.monitor.clamp_scale if monitor_alert and algo.monitor.action == "clamp" else 1.0
        coefs = loss_coefficients(algo, lam, beta, kl_weight, entropy_scale=clamp)
        if step == 0:
            self.logger.info(self.loss_stack.formula(coefs))
        metrics.update({f"coef/{k}": v for k, v in coefs.items()})
        metrics.update({"coef/lambda": lam, "coef/beta": beta})
        return coefs

    def _refresh_rollout_copies(self) -> None:
        """The generating copies of the policy (and critic) take the updated weights."""
        self.policy.refresh()
        if self.critic_engine is not None:
            self.critic.refresh()

    def _entropy_statistics(self, batch: TurnBatch, step: int, max_turns: int,
                            metrics: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
        """Per-turn sums/counts of the rollout's token entropies (all ranks), their mean, and the fluctuation
        monitor's verdict; the entropy metrics go into `metrics`."""
        sums, counts = step_statistics(batch.entropy, batch.turn_index, max(self.cfg.env.max_turns, max_turns))
        sums, counts = all_reduce_sum(sums.double()), all_reduce_sum(counts.double())
        entropy_now = float(sums.sum() / counts.sum().clamp(min=1))
        metrics["policy/entropy"] = entropy_now
        for t in torch.nonzero(counts).flatten().tolist():
            metrics[f"policy/entropy_turn/{t}"] = float(sums[t] / counts[t])
        metrics.update(self.monitor.update(entropy_now))
        alert = self.monitor.alert
        if alert:
            self.logger.warn(f"entropy fluctuation above algo.monitor.threshold at step {step + 1} "
                             f"(sigma={metrics['policy/entropy_fluctuation']:.4f})"
                             + (": entropy terms clamped for this step" if self.cfg.algo.monitor.action == "clamp"
                                else ""))
        return sums, counts, entropy_now, alert

    def reuses_scoring(self) -> bool:
        """Whether the update's first forward scores its own samples (see on_policy_rows); False when that
        is not provably the rollout's policy or not wanted:
          - algo.reuse_scoring_forward=false;
          - dropout anywhere in the policy (a training-mode forward would differ from the rollout's policy);
          - algo.monitor.action=clamp (this step's coefficients need every entropy before the update)."""
        algo = self.cfg.algo
        return bool(algo.reuse_scoring_forward) and algo.monitor.action != "clamp" and not _has_dropout(
            self.engine.module)

    def on_policy_rows(self, batch: TurnBatch, step: int) -> set[int]:
        """This rank's samples whose old log-probs the update's own forward can provide: those of the first
        mini-batch of the first epoch, which the update reaches before any optimizer step, with the weights
        that played the rollout (empty unless reuses_scoring())."""
        return set(self.mini_batches(batch, step, 0)[0]) if self.reuses_scoring() else set()

    # ------------------------------------------------------------------------------------------------------
    def score(self, batch: TurnBatch, skip_policy: set[int] | None = None) -> None:
        """Old-policy log-probs and entropy (+ reference log-probs, critic values), no grad. Rows in
        `skip_policy` get only the reference and critic passes (the update fills in their old log-probs)."""
        device, pad = self.dist.device, self.tokenizer.pad_token_id
        temperature = self.cfg.rollout.temperature
        n = len(batch)
        skip_policy = skip_policy or set()
        batch.old_logprobs, batch.entropy = [torch.empty(0)] * n, [torch.empty(0)] * n
        batch.ref_logprobs = [torch.empty(0)] * n if self.ref_model is not None else []
        values = torch.zeros(n) if self.critic_engine is not None else None
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        scored = [r for r in range(n) if r not in skip_policy]
        passes = [(rows, True) for rows in self.plan_micro_batches(scored, lengths)]
        if self.ref_model is not None or values is not None:
            passes += [(rows, False) for rows in self.plan_micro_batches(sorted(skip_policy), lengths)]
        with torch.no_grad():
            for rows, with_policy in passes:
                mb = collate(batch, rows, pad, device, packed=self.packing)
                out = policy_forward(self.policy.module, mb, temperature, self.vocab_limit) if with_policy else None
                ref = (policy_forward(self.ref_model, mb, temperature, self.vocab_limit, with_entropy=False)
                       if self.ref_model is not None else None)
                for i, r in enumerate(rows):
                    k = len(batch.response_ids[r])
                    if out is not None:
                        batch.old_logprobs[r] = out.logprobs[i, :k].float().cpu()
                        batch.entropy[r] = out.entropy[i, :k].float().cpu()
                    if ref is not None:
                        batch.ref_logprobs[r] = ref.logprobs[i, :k].float().cpu()
                if values is not None:
                    values[rows] = value_forward(self.critic.module, mb)[:len(rows)].float().cpu()
        batch.old_values = values

    def plan_micro_batches(self, rows: list[int], lengths: list[int]) -> list[list[int]]:
        """The passes over `rows`: packs up to the token budget (algo.pack_tokens), or padded micro-batches of
        micro_batch_size samples of similar length."""
        algo = self.cfg.algo
        if not self.packing:
            return plan_micro_batches(rows, lengths, algo.micro_batch_size)
        budget = algo.pack_tokens or default_budget(lengths, algo.micro_batch_size)
        return plan_packs(rows, lengths, budget)

    # ------------------------------------------------------------------------------------------------------
    def mini_batches(self, batch: TurnBatch, step: int, epoch: int) -> list[list[int]]:
        """This rank's rows of each global mini-batch. The split depends only on (seed, step, epoch) and
        the samples' global ids, so 1 rank and N ranks form the same global mini-batches."""
        # (random key, global id): a tie of keys is broken by the id, never by the rank or row
        keys = [(derive_seed(self.cfg.seed, "minibatch", step, epoch, t, i), t, i)
                for t, i in zip(batch.traj_id.tolist(), batch.turn_index.tolist())]
        everyone = all_gather_objects(keys)
        ordered = sorted((k, rank, row) for rank, ks in enumerate(everyone) for row, k in enumerate(ks))
        size = self.cfg.algo.mini_batch_size
        out: list[list[int]] = [[] for _ in range(max(1, math.ceil(len(ordered) / size)))]
        for pos, (_, rank, row) in enumerate(ordered):
            if rank == self.dist.rank:
                out[pos // size].append(row)
        return out

    def _aggregation_modes(self) -> set[str]:
        modes = set(required_aggregations(self.loss_stack.terms))
        if self.value_term is not None:
            modes.add(self.value_term.aggregation)
        return modes

    def update(self, batch: TurnBatch, coefs: dict[str, float], step: int,
               history: EntropyHistory | None = None, on_policy: set[int] | None = None) -> dict[str, float]:
        """ppo_epochs x mini-batches x micro-batches; one engine.step() per mini-batch.

        `on_policy` (see on_policy_rows): rows of the first mini-batch that scoring skipped; their old
        log-probs and entropies are this forward's own, detached (ratio exactly 1), and are written back to
        `batch` for later epochs and the entropy statistics."""
        algo = self.cfg.algo
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        # sorted: each mode's denominator is one all-reduce, and a set's order (str hashes are salted per
        # process) differs between ranks, which would pair up different modes' sums
        modes = sorted(self._aggregation_modes())
        shared = _UpdateInputs(batch, coefs, history, on_policy or set(), lengths, modes,
                               _row_denominators(batch, modes, algo.entropy.decay))
        tally = UpdateTally()
        self.engine.train()
        for epoch in range(algo.ppo_epochs if algo.name != "sft" else 1):
            for mini, rows in enumerate(self.mini_batches(batch, step, epoch) if algo.name != "sft"
                                        else [list(range(len(batch)))]):
                self._mini_batch_step(shared, rows, (step, epoch, mini), tally)
        out_metrics = tally.metrics()
        if batch.old_values is not None and batch.returns is not None:
            out_metrics.update(critic_metrics(batch.old_values, batch.returns, self.dist.device))
        self._track_skips(tally.skipped, tally.optimizer_steps)
        check_finite_weights(self.engine.module, step + 1, self.cfg, self.run, checkpoint.latest_tag(self.run),
                             all_reduce_max)  # before this step's checkpoint and the next rollout
        return out_metrics

    def _mini_batch_step(self, shared: _UpdateInputs, rows: list[int], position: tuple[int, int, int],
                         tally: UpdateTally) -> None:
        """One optimizer step on this rank's `rows` of a global mini-batch: every rank runs as many
        micro-batches (empty ones where it has fewer), then engine.step(); the term metrics of the step are
        summed over ranks into `tally`. `position` is (step, epoch, mini-batch index)."""
        algo, device = self.cfg.algo, self.dist.device
        micro = self.plan_micro_batches(rows, shared.lengths)
        n_micro = int(all_reduce_max(torch.tensor(len(micro))).item())
        micro += [[] for _ in range(n_micro - len(micro))]
        # global denominators of each aggregation mode over this mini-batch (all ranks)
        denominators = {mode: float(all_reduce_sum(shared.row_denominators[mode][rows].sum().to(device))
                                    .clamp(min=1e-12)) for mode in shared.modes}
        step_metrics: dict[str, float] = {}
        for micro_index, m in enumerate(micro):
            mb = collate(shared.batch, m, self.tokenizer.pad_token_id, device, num_rows=max(len(m), 1),
                         packed=self.packing)
            # random token choices (Clip-Cov) are a function of the run's seed and position only
            self.loss_stack.reseed(derive_seed(self.cfg.seed, "clip_cov", *position, micro_index, self.dist.rank))
            for mode in shared.modes:
                mb.weights[mode] = normalized_weights(mode, mb.response_mask, mb.turn_index, mb.num_turns,
                                                      algo.entropy.decay, denominator=denominators[mode]).to(device)
            if shared.history is not None and "entropy_smoothing" in algo.loss_terms:
                mb.entropy_ref = shared.history.reference(mb.turn_index.cpu()).to(device)
            # the very first forward of the update is the old policy's: it scores its on-policy samples
            reuse = bool(m) and m[0] in shared.on_policy and tally.optimizer_steps == 0
            term_metrics = self._micro_batch_backward(mb, m, shared.batch, shared.coefs, reuse)
            for k, v in term_metrics.items():
                step_metrics[k] = step_metrics.get(k, 0.0) + float(v)
            tally.real_tokens += int(mb.attention_mask.sum())
            tally.padded_tokens += mb.attention_mask.numel()
        self.engine.step()
        if self.critic_engine is not None:
            self.critic_engine.step()
        if step_was_skipped(self.engine):
            tally.skipped += 1
        norm = grad_norm(self.engine)
        if norm is not None:
            tally.grad_norms.append(norm)
        names = sorted(step_metrics)
        reduced = all_reduce_sum(torch.tensor([step_metrics[k] for k in names], dtype=torch.float64,
                                              device=device)).tolist() if names else []
        tally.add_step(dict(zip(names, reduced)))

    def _micro_batch_backward(self, mb: MicroBatch, rows: list[int], batch: TurnBatch, coefs: dict[str, float],
                              reuse: bool) -> dict[str, Any]:
        """Forward, loss stack and backward of one micro-batch (policy, then critic); its term metrics.
        With `reuse`, this forward's log-probs and entropies become the rows' old ones (in `batch` too)."""
        out = policy_forward(self.engine, mb, self.cfg.rollout.temperature, self.vocab_limit,
                             with_entropy=self._needs_entropy() or reuse)
        if reuse:  # this forward is the old policy's: score these samples with it
            mb.old_logprobs = out.logprobs.detach()
            mb.rollout_entropy = out.entropy.detach()
            for i, r in enumerate(rows):
                k = len(batch.response_ids[r])
                batch.old_logprobs[r] = mb.old_logprobs[i, :k].float().cpu()
                batch.entropy[r] = mb.rollout_entropy[i, :k].float().cpu()
        loss, term_metrics = self.loss_stack(mb, out, coefs)
        # DeepSpeed averages gradients over ranks; the weights already normalise globally
        self.engine.backward(loss * self.dist.world_size, scale_wrt_gas=False)
        if self.critic_engine is not None:
            self._critic_backward(mb, self.dist.world_size, term_metrics)
        return term_metrics

    def _needs_entropy(self) -> bool:
        return any(t in self.cfg.algo.loss_terms for t in ("entropy", "entropy_smoothing"))

    def _critic_backward(self, mb: MicroBatch, world: int, metrics: dict[str, Any]) -> None:
        values = value_forward(self.critic_engine, mb)
        vloss, vmetrics = self.value_term(mb, PolicyOutputs(logprobs=None, entropy=None, values=values))
        self.critic_engine.backward(self.cfg.algo.value.coef * vloss * world, scale_wrt_gas=False)
        metrics.update(vmetrics)

    def _track_skips(self, skipped: int, n_updates: int) -> None:
        if skipped:
            self.logger.warn(f"{skipped}/{n_updates} updates skipped: non-finite loss or gradient")
        self.state.consecutive_skips = self.state.consecutive_skips + skipped if skipped == n_updates else 0
        if self.state.consecutive_skips >= self.cfg.trainer.max_nonfinite_skips:
            latest = checkpoint.latest_tag(self.run)
            raise UserError(
                f"Training stopped: {self.state.consecutive_skips} consecutive updates had a non-finite loss "
                f"or gradient (trainer.max_nonfinite_skips={self.cfg.trainer.max_nonfinite_skips}); the weights "
                f"were not changed by them. Last checkpoint: {latest or 'none'}. Lower algo.lr or check the "
                "reward scale, then resume with trainer.resume=<run dir>."
            )

    # ------------------------------------------------------------------------------------------------------
    def train_sft(self) -> dict[str, float]:
        """Behaviour cloning on expert demonstrations through the same update as RL (nll term)."""
        cfg, algo = self.cfg, self.cfg.algo
        data = self.demonstrations()
        n = len(data)
        total = cfg.trainer.total_steps
        coefs = loss_coefficients(algo, 0.0, 0.0, 0.0)
        metrics: dict[str, float] = {}
        self._agree_on_stop()
        while self.state.step < total and self.stop_signal is None:
            step = self.state.step
            self._set_learning_rates(step, total)
            # the mini-batch is a function of (seed, step): epochs are permutations, resumes are exact
            per_epoch = max(1, n // algo.mini_batch_size)
            epoch, pos = divmod(step, per_epoch)
            shuffle = torch.Generator().manual_seed(derive_seed(cfg.seed, "sft_epoch", epoch))
            perm = torch.randperm(n, generator=shuffle).tolist()
            global_rows = perm[pos * algo.mini_batch_size:(pos + 1) * algo.mini_batch_size]
            mine = global_rows[self.dist.rank::self.dist.world_size]
            t0 = time.perf_counter()
            metrics = self.update(data.select(mine), coefs, step)
            update_s = time.perf_counter() - t0
            tokens = sum(len(data.prompt_ids[r]) + len(data.response_ids[r]) for r in mine)
            metrics.update({"perf/update_s": update_s, "perf/tokens_per_s": tokens / max(update_s, 1e-9),
                            "perf/lr": self.engine.optimizer.param_groups[0]["lr"],
                            "sft/epoch": step / per_epoch})
            self.policy.refresh()
            if self._after_step(step + 1, total, metrics):
                break
        self._finish()
        return metrics

    def demonstrations(self) -> TurnBatch:
        algo = self.cfg.algo
        if algo.demos != "expert":
            records = read_jsonl(algo.demos)
        else:
            rng = random.Random(derive_seed(self.cfg.seed, "demos"))
            level = algo.demo_level
            tasks = self.suite.sample_tasks(self.cfg.env.train_split, algo.demo_episodes, rng, level=level)
            settings = PlaySettings(self.builder, self.tokenizer, self.cfg.env.max_turns)
            episodes, _ = run_episodes(ExpertPolicy(self.tokenizer), self.pool,
                                       episode_slots(tasks, list(range(len(tasks)))), settings)
            solved = [ep for ep in episodes if ep.won]
            records = episodes_to_records(solved)
            if self.dist.is_main:
                write_jsonl(self.run / "demos.jsonl", records)
            self.logger.info(f"expert solved {len(solved)}/{len(episodes)} demo episodes "
                             f"({sum(len(e.turns) for e in solved)} turn samples) -> {self.run / 'demos.jsonl'}")
            if not solved:
                raise UserError("The expert solved none of the demonstration episodes; check env.max_turns.")
        return records_to_batch(records, self.builder, self.tokenizer)

    # ------------------------------------------------------------------------------------------------------
    def evaluate(self, split: str, episodes_n: int, temperature: float,
                 save_samples: Path | None = None) -> tuple[dict[str, float], list[Episode]]:
        """Play `episodes_n` fixed tasks of `split` (sharded over ranks); returns all-reduced metrics."""
        cfg = self.cfg
        tasks = eval_tasks(self.suite, split, episodes_n, cfg.seed)
        ids = list(range(len(tasks)))
        metrics, episodes = evaluate_split(self._model_policy(temperature), self.pool, self.builder,
                                           self.tokenizer, split, self._my_share(tasks), self._my_share(ids),
                                           cfg.env.max_turns, cfg.seed,
                                           reduce=lambda sums: reduce_sums(sums, self.dist.device),
                                           overlap=cfg.rollout.overlap)
        if save_samples is not None and self.dist.is_main:
            write_samples(save_samples, episodes[: cfg.rollout.num_samples_to_save])
        return metrics, episodes

    def _maybe_evaluate(self, done_steps: int, total: int) -> dict[str, float]:
        cfg = self.cfg
        every = cfg.trainer.eval_every
        if not cfg.env.eval_splits or not (done_steps == total or (every > 0 and done_steps % every == 0)):
            return {}
        out: dict[str, float] = {}
        for i, split in enumerate(cfg.env.eval_splits):
            samples = self.run / "samples" / f"step_{done_steps}-{split}.md"
            metrics, _ = self.evaluate(split, cfg.trainer.eval_episodes, cfg.rollout.eval_temperature, samples)
            out.update(metrics)
            if i == 0:
                out["eval/success"] = metrics.get(f"eval/{split}/success", 0.0)
        return out

    # ------------------------------------------------------------------------------------------------------
    def _state_payload(self) -> dict[str, Any]:
        return {
            "trainer": self.state.__dict__,
            "entropy_history": self.history.state_dict(),
            "monitor": self.monitor.state_dict(),
            "entropy_schedule": self.entropy_schedule.state_dict(),
            "curriculum": self.curriculum.state_dict(),
        }

    def _load(self, ckpt: Path) -> None:
        payload = checkpoint.load(ckpt, self.engine, self.critic_engine, self.dist.rank)
        with refusing_damaged(ckpt):  # a part's state of the wrong shape: one message, not a traceback
            self.state = TrainState(**payload["trainer"])
            self.history.load_state_dict(payload["entropy_history"])
            self.monitor.load_state_dict(payload["monitor"])
            self.entropy_schedule.load_state_dict(payload.get("entropy_schedule", {}))
            self.curriculum.load_state_dict(payload.get("curriculum", {}))
        self.policy.refresh()
        if self.critic_engine is not None:
            self.critic.refresh()

    def _maybe_checkpoint(self, done_steps: int, total: int, metrics: dict[str, float]) -> None:
        cfg = self.cfg
        best_key = cfg.trainer.best_metric
        is_best = False
        if best_key and best_key in metrics and math.isfinite(metrics[best_key]):
            if self.state.best_value is None or metrics[best_key] > self.state.best_value:
                self.state.best_value, self.state.best_step, is_best = metrics[best_key], done_steps, True
        every = cfg.trainer.save_every
        due = done_steps == total or (every > 0 and done_steps % every == 0) or self._should_stop(done_steps)
        if due or is_best:
            checkpoint.save(self.run, done_steps, self.engine, self.critic_engine, self._state_payload(),
                            self.dist.rank, keep=cfg.trainer.keep_checkpoints,
                            best_step=self.state.best_step)

    def _after_step(self, done_steps: int, total: int, metrics: dict[str, float]) -> bool:
        """Evaluate, log and checkpoint a finished step; True when this process should stop now."""
        self.state.step = done_steps
        metrics.update(self._maybe_evaluate(done_steps, total))
        self.logger.log(done_steps, metrics, total)
        self._agree_on_stop()  # before the checkpoint: a stop makes one due
        self._maybe_checkpoint(done_steps, total, metrics)
        if self.stop_signal is None and self._agree_on_stop():  # a signal during that save: stop now, not a step later
            self._maybe_checkpoint(done_steps, total, metrics)
        return self._should_stop(done_steps)

    def _agree_on_stop(self) -> bool:
        """All ranks stop after the same step: the largest signal number any rank received (or that the
        launching process relayed) wins. A tiny all-reduce; True when a stop is agreed."""
        mine = STOP.requested(self.run) or 0
        agreed = int(all_reduce_max(torch.tensor(mine, dtype=torch.long, device=self.dist.device)).item())
        if agreed and self.stop_signal is None:
            self.stop_signal = agreed
            self.logger.info(f"stopping after step {self.state.step} ({signal_name(agreed)})")
        return self.stop_signal is not None

    def _should_stop(self, done_steps: int) -> bool:
        if done_steps >= self.cfg.trainer.total_steps:
            return False
        stop = self.cfg.trainer.stop_after
        return self.stop_signal is not None or (stop is not None and done_steps >= stop)

    def _finish(self) -> None:
        """Export the final policy (Hugging Face folder) and mark the run finished."""
        if self.state.step >= self.cfg.trainer.total_steps:
            final = self.run / "final"
            module = self.policy.module
            if self.dist.is_main:
                if hasattr(module, "merge_and_unload"):  # LoRA: export a plain model
                    module = frozen_copy(module).merge_and_unload()
                shutil.rmtree(final, ignore_errors=True)
                module.save_pretrained(final)
                self.tokenizer.save_pretrained(final)
                write_status(self.run, "finished", step=self.state.step)
        elif self.dist.is_main:
            extra = {"signal": signal_name(self.stop_signal)} if self.stop_signal else {}
            write_status(self.run, "stopped", step=self.state.step, **extra,
                         checkpoint=checkpoint.latest_tag(self.run),
                         resume=f"epo train trainer.resume={self.run}")


def _has_dropout(model: torch.nn.Module) -> bool:
    """Whether a training-mode forward of `model` is random (dropout layers, attention dropout)."""
    config = getattr(model, "config", None)
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def _row_denominators(batch: TurnBatch, modes: list[str], decay: float) -> dict[str, torch.Tensor]:
    """Each sample's contribution d to every aggregation mode's denominator ([N] float64 per mode),
    from the sample metadata alone (no padding of token ids needed)."""
    lengths = batch.response_lengths
    mask = torch.arange(max(int(lengths.max()), 1) if len(lengths) else 1)[None, :] < lengths[:, None]
    num_turns = batch.num_turns.clamp(min=1)
    return {mode: AGGREGATIONS[mode].weights(mask, batch.turn_index, num_turns, decay)[1].double()
            for mode in modes}

