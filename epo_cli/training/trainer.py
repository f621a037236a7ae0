"""The training recipe: `Trainer.rl_step` is one RL iteration, read top to bottom; SFT runs `sft_step`.

    epo train algo=epo env=household trainer.total_steps=20

One RL iteration (`rl_step`, numbered as there). Steps 1-5 are public methods that take and return values
(nothing writes into an argument), so benchmarks and scripts/gpu_check.py run the trainer's own steps:
    1 sample       <- GroupSampler.sample (training/group_sampler.py): curriculum tasks (tasks_per_step x
                      group_size; this rank plays whole groups) -> one sample per turn (TurnBatch)
                      (algo.dynamic_sampling: groups that fail algo.group_filter replaced by fresh rounds,
                      DAPO); then the `on_rollout` callbacks see the rollout
    2 score        <- PolicyUpdate.score (training/update.py): old log-probs, entropy (sampling temperature),
                      reference log-probs, critic values. With algo.reuse_scoring_forward the update's own
                      first forward scores the first mini-batch instead: PolicyUpdate's business alone
    3 advantages   <- AdvantageEstimator: the estimator algo.estimator names  gae | grpo | rloo | gigpo
    4 coefficients <- schedules: lambda (entropy group), beta_k (algo.phase), KL weight; the entropy terms
                      scaled by algo.monitor.clamp_scale when the monitor clamps (its verdict in advance)
    5 update       <- PolicyUpdate.run: ppo_epochs x mini-batches x micro-batches, each micro-batch in
                      PolicyUpdate.train_micro_batch (forward, log_ratio = logp - old_logp, the rollout
                      correction's weights, then LossStack):
                      loss = sum_i coef_i * term_i   (e.g. policy_clip + 0.01*kl - lambda*entropy
                                                      + lambda*beta_k*entropy_smoothing)
                      engine.backward(loss); one engine.step() per mini-batch; critic likewise (ppo);
                      returns every row scored; then skipped steps and finite weights checked on all ranks
    sync           <- the rollout engine (rollout.engine: hf | vllm) and the scoring copies take the updated
                      weights (Models.sync_weights; ZeRO-3 gathers them, vLLM reloads them) and eval mode
    6 entropy      <- per-turn statistics of the rollout's entropies (all-reduced; no extra forward pass),
                      fluctuation monitor (EntropyControl); collapse/* diagnostics (CollapseWatch,
                      training/collapse.py; algo.diagnostics)
    7 state        <- entropy history and schedule (EntropyControl), curriculum
    8 metrics      <- epo_cli/training/step_metrics.py; the collapse alert (CollapseWatch.alert)
Around each step (`_loop`): the learning rate from its schedule before; evaluate every eval_every, log,
checkpoint every save_every after (`_after_step`). SFT (training/sft.py) uses the same loop and update.
Starting, stopping and the run's status.json belong to the run's lifecycle (launch/lifecycle.py).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from epo_cli.algos.advantages import AdvantageEstimator
from epo_cli.algos.curriculum import build_curriculum
from epo_cli.algos.losses import LossStack, build_loss_terms, build_value_term, term_coefficients
from epo_cli.algos.rollout_correction import mismatch_metrics_from_sums, mismatch_sums
from epo_cli.algos.schedules import build_kl_schedule, build_lr_schedule, build_phase_schedule
from epo_cli.envs import EnvSuite, make_suite
from epo_cli.envs.pool import EnvPool
from epo_cli.errors import UserError
from epo_cli.loggers.jsonl import truncate_metrics_file
from epo_cli.loggers.logger import MetricsLogger
from epo_cli.rollout.batch import TurnBatch
from epo_cli.rollout.prompts import PromptBuilder, chat_encoder
from epo_cli.rundir import checkpoint_paths
from epo_cli.rundir.saved_state import refusing_damaged
from epo_cli.seeding import derive_seed
from epo_cli.training import checkpoint
from epo_cli.training.collapse import CollapseWatch
from epo_cli.training.engine import all_reduce_max, all_reduce_sum, barrier, init_distributed
from epo_cli.training.evaluate import TrainingEval
from epo_cli.training.export import export_policy
from epo_cli.training.finite import check_finite_weights
from epo_cli.training.group_sampler import GroupSampler, Rollout
from epo_cli.training.models import build_models
from epo_cli.training.settings import cut_settings, entropy_control
from epo_cli.training.sft import demonstrations, sft_step
from epo_cli.training.step_metrics import (
    batch_metrics,
    level_results,
    perf_metrics,
    reduce_sums,
    rollout_metrics,
    rollout_sums,
)
from epo_cli.training.stop import STOP, signal_name
from epo_cli.training.update import PolicyUpdate, UpdateResult, skip_streak


@dataclass
class TrainState:
    """Everything besides model/optimizer that a resume must restore."""

    step: int = 0
    consecutive_skips: int = 0
    best_value: float | None = None
    best_step: int | None = None
    logger_ids: dict[str, str] = field(default_factory=dict)
    collapse_signals: list[str] = field(default_factory=list)  # beyond their alert thresholds (CollapseWatch)


@dataclass(frozen=True)
class Coefficients:
    """One step's loss coefficients (rl_step's step 4) and the schedule values behind them."""

    loss: dict[str, float]  # each loss term's coefficient (what LossStack multiplies its terms by)
    lam: float  # lambda: the entropy group's weight (entropy schedule)
    beta: float  # beta_k: entropy_smoothing's weight within the group (algo.phase)

    def metrics(self) -> dict[str, float]:
        """coef/<term>, coef/lambda, coef/beta."""
        return {**{f"coef/{k}": v for k, v in self.loss.items()}, "coef/lambda": self.lam, "coef/beta": self.beta}


class Trainer:
    def __init__(self, cfg: DictConfig, run: Path, suite: EnvSuite | None = None) -> None:
        """`suite`: the run's env suite, if the caller built it already (one per process, handed down).
        The run config is read here only: each part gets its settings (training/settings.py) or the
        component its section builds; nothing after construction reads `cfg`."""
        self.run, algo = run, cfg.algo
        self.cfg = cfg  # what ran, for callers that report it (benchmarks, scripts); never read below
        self.dist = init_distributed(cfg.trainer.device, cfg.launcher.timeout_s)
        self.settings = settings = cut_settings(cfg, self.dist)
        self._seed_process()
        self.suite = suite or make_suite(cfg.env)
        self.suite.check()
        self.curriculum = build_curriculum(cfg, self.suite)
        self.models = build_models(settings.models, self.dist, self.suite)
        self.loss_stack = LossStack(build_loss_terms(algo))
        self.term_coefficients = term_coefficients(algo)
        value_term = build_value_term(algo) if self.models.critic_engine is not None else None
        self.policy_update = PolicyUpdate(settings.update, self.dist, self.models, self.loss_stack, value_term)
        self.entropy = entropy_control(cfg)  # history, fluctuation monitor, lambda's schedule
        self.phase_schedule, self.kl_schedule = build_phase_schedule(algo.phase), build_kl_schedule(algo)
        self.lr_schedule = build_lr_schedule(algo)
        self.estimator = AdvantageEstimator.from_config(algo) if algo.estimator != "none" else None
        self.builder = PromptBuilder(cfg.env.prompt_template, cfg.env.history_length,
                                     cfg.rollout.max_prompt_tokens,
                                     chat_encoder(self.models.tokenizer, cfg.env.system_prompt))
        self.state = TrainState()
        self.stop_signal: int | None = None  # a stop signal all ranks agreed on (epo_cli.training.stop)
        self._resume(cfg.trainer.resume)
        # the envs' expert (env.expert=null) runs only where its actions are read: SFT from the expert
        reads_expert = settings.loop.sft and algo.demos == "expert"
        self.pool = EnvPool(self.suite, cfg.env.num_workers, cfg.env.step_timeout_s, reads_expert=reads_expert)
        self._open_logger(MetricsLogger(cfg, run, enabled=self.dist.is_main, resume_ids=self.state.logger_ids))
        self.sampler = GroupSampler(settings.sampler, self.dist.rank, self.dist.world_size, self.suite, self.pool,
                                    self.curriculum, self.builder, self.models.tokenizer, self.estimator)
        self.evaluation = TrainingEval(settings.evaluation, self.dist, self.suite, self.pool,
                                       self.builder, self.models.tokenizer)
        self.collapse = CollapseWatch(settings.collapse, self.dist, self.models,
                                      run if self.dist.is_main else None, self.logger.warn)
        #: called with every rollout and its step, after step 1 (a benchmark keeps the episodes it plays)
        self.on_rollout: list[Callable[[Rollout, int], None]] = []

    @property
    def engine(self) -> Any:
        return self.models.engine

    @property
    def ref_model(self) -> torch.nn.Module | None:
        return self.models.ref_model

    def _seed_process(self) -> None:
        """Threads, determinism and this process's global RNGs."""
        loop = self.settings.loop
        torch.set_num_threads(loop.num_threads)
        if loop.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        process_seed = derive_seed(loop.seed, "process", self.dist.rank)
        torch.manual_seed(process_seed)
        random.seed(process_seed)

    def _resume(self, resume: str | None) -> None:
        """Load the checkpoint trainer.resume=`resume` names, if any (before the env pool and the loggers
        start: the loggers continue the resumed run's ids)."""
        self.resume_from = checkpoint_paths.resolve_resume(resume, self.run)
        if self.resume_from is not None:
            self._load(self.resume_from)

    def _open_logger(self, logger: MetricsLogger) -> None:
        """Take `logger` (its sinks open); on a resume, drop the metrics rows after the checkpoint."""
        run, resume_from = self.run, self.resume_from
        self.logger = logger
        self.state.logger_ids = self.logger.run_ids
        if resume_from is not None and self.dist.is_main:
            truncate_metrics_file(run, self.state.step)  # rows after the checkpoint are re-logged
            # from an earlier step_N: newer checkpoints belong to the abandoned branch (kept, moved aside)
            for moved in checkpoint_paths.supersede_newer(run, self.state.step):
                self.logger.warn(f"resuming from step {self.state.step}: the newer checkpoint was moved to "
                                 f"{moved} (nothing deleted)")
            self.logger.info(f"resumed from {resume_from} at step {self.state.step}")
        if resume_from is not None:
            barrier()

    # ---- the loop ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Every step from state.step to trainer.total_steps, or until a stop; the last step's metrics. The
        run's status.json is its lifecycle's (launch/lifecycle.py), which calls this."""
        try:
            if self.settings.loop.sft:
                data = demonstrations(self.settings.demos, self.suite, self.pool, self.builder,
                                      self.models.tokenizer, self.run / "demos.jsonl" if self.dist.is_main else None,
                                      self.logger.info)
                final = self._loop(lambda step, total: self.sft_step(data, step))
            else:
                final = self._loop(self.rl_step)
        except (OSError, RuntimeError) as err:
            if not checkpoint_paths.is_disk_error(err):
                raise
            raise UserError(checkpoint_paths.disk_error_message(self.run, err)) from None
        finally:
            self.pool.close()
            self.logger.close()
        return final

    def _loop(self, one_step: Callable[[int, int], dict[str, float]]) -> dict[str, float]:
        total = self.settings.loop.total_steps
        metrics: dict[str, float] = {}
        self._agree_on_stop()  # a signal during start-up: stop before the first step
        while self.state.step < total and self.stop_signal is None:
            step = self.state.step
            self.set_learning_rates(step, total)
            metrics = one_step(step, total)
            if self._after_step(step + 1, total, metrics):
                break
        self._finish()
        return metrics

    def set_learning_rates(self, step: int, total: int) -> None:
        """algo.lr (policy) and algo.value.lr (critic) times the warm-up/decay multiplier of this step."""
        self.policy_update.set_learning_rates(self.lr_schedule(step, total))

    def rl_step(self, step: int, total: int) -> dict[str, float]:
        """One RL iteration (the module docstring's steps); returns its metrics. Each step is a public method
        that takes and returns values, so a benchmark composes the very same steps."""
        metrics = self.entropy.reference_metrics()  # policy/entropy_ref: the band's centre before this step
        # 1. episodes: this rank's whole groups, one sample per turn (then the on_rollout callbacks)
        rollout = self.sample(step, total)
        max_turns, subgoal_coef = self.curriculum.max_turns(step, total), self.curriculum.subgoal_coef(step, total)

        # 2. scoring forward (no grad): old log-probs, entropies, reference log-probs, values; with scoring
        #    reuse, the first mini-batch is scored by the update's own first forward instead (PolicyUpdate)
        t0 = time.perf_counter()
        batch = self.score(rollout.batch, step)
        score_s = time.perf_counter() - t0

        # 3. advantages (a new batch)
        batch = self.advantages(batch)

        # 4. coefficients from schedules: L = L_RL - lambda * (L_H - beta_k * L_smooth) + kl_weight * KL
        coefs = self.coefficients(step, total, batch)
        metrics.update(coefs.metrics())
        if step == 0:
            self.logger.info(self.loss_stack.formula(coefs.loss))

        # 5. update; its batch has every row scored (those the update's first forward scored included)
        t0 = time.perf_counter()
        result = self.update(batch, coefs, step)
        update_s = time.perf_counter() - t0
        metrics.update(result.metrics)
        batch = result.batch
        metrics.update(self.mismatch_metrics(batch))  # engine vs trainer log-probs (the rollout's)

        # sync: the rollout engine and the scoring copies take the updated weights (every rank: a collective)
        t0 = time.perf_counter()
        self.sync_weights()
        metrics["perf/sync_s"] = time.perf_counter() - t0

        # 6. entropy statistics of the rollout (all ranks; no extra forward pass), the fluctuation monitor;
        #    collapse diagnostics, before step 7 so that EPO's band is the one this step was trained against
        width = self.turn_width(step, total)
        entropy = self.entropy.statistics(batch, step, width, self.logger.warn)
        metrics.update(entropy.metrics)
        metrics.update(self.collapse.metrics(batch, rollout.episodes, self.entropy.history, step, subgoal_coef, width))

        # 7. state: entropy history (its references use steps 0..k-1 only, paper: Href(k)) and schedule, the
        #    curriculum (true task success per level, all ranks)
        self.entropy.observe(entropy)
        reduced = reduce_sums(rollout_sums(rollout.episodes, rollout.stats), self.dist.device)
        self.curriculum.observe(step, level_results(reduced))

        # 8. metrics (all ranks; epo_cli/training/step_metrics.py says what each is)
        metrics.update(rollout_metrics(reduced) | self.curriculum.metrics() | rollout.metrics)
        metrics.update(batch_metrics(batch, result.scored_rows, subgoal_coef, max_turns))
        metrics.update(perf_metrics(rollout.stats, reduced, score_s, update_s, self.policy_update.learning_rate))
        alert, self.state.collapse_signals = self.collapse.alert(metrics, step + 1, self.state.collapse_signals)
        metrics.update(alert)  # the collapse alert: a warning when a signal crosses its threshold
        return metrics

    # ---- the steps of rl_step (public: benchmarks and scripts/gpu_check.py compose them) -------------------
    def sample(self, step: int, total: int) -> Rollout:
        """Step 1: this rank's episodes of step `step` with the rollout policy (GroupSampler.sample); every
        `on_rollout` callback then sees the rollout."""
        policy = self.models.sampling_policy()
        rollout = self.sampler.sample(policy, step, total)
        if policy.keep_logprobs:  # the engine's log-probs of each row's response (mismatch metrics, correction)
            batch = rollout.batch
            kept = [policy.logprobs_of(p, r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
            rollout = replace(rollout, batch=replace(batch, engine_logprobs=[
                None if lp is None else torch.tensor(lp, dtype=torch.float32) for lp in kept]))
        for callback in self.on_rollout:
            callback(rollout, step)
        return rollout

    def score(self, batch: TurnBatch, step: int) -> TurnBatch:
        """Step 2: `batch` scored without gradient (PolicyUpdate.score; rows left to the update's own first
        forward under scoring reuse are its business)."""
        return self.policy_update.score(batch, step)

    def advantages(self, batch: TurnBatch) -> TurnBatch:
        """Step 3: a new batch with the advantages and returns of the estimator algo.estimator names
        (unchanged for estimator=none)."""
        if self.estimator is None:
            return batch
        advantages, returns = self.estimator(batch, all_reduce_sum)
        return replace(batch, advantages=advantages, returns=returns)

    def coefficients(self, step: int, total: int, batch: TurnBatch) -> Coefficients:
        """Step 4: this step's loss coefficients: lambda, beta_k and the KL weight from their schedules, the
        entropy terms scaled by algo.monitor.clamp_scale when the monitor clamps on `batch`'s entropies."""
        lam, beta = self.entropy.schedule(step, total), self.phase_schedule(step, total)
        clamps = self.entropy.clamps_now(batch, self.turn_width(step, total))
        clamp = self.settings.loop.clamp_scale if clamps else 1.0
        loss = self.term_coefficients.at(lam, beta, self.kl_schedule(step, total), entropy_scale=clamp)
        return Coefficients(loss, lam, beta)

    def update(self, batch: TurnBatch, coefs: Coefficients, step: int) -> UpdateResult:
        """Step 5: the policy (and critic) update on `batch` (PolicyUpdate.run), then its checks on every rank."""
        self.models.rollout_engine.before_update()  # vLLM on a shared GPU: sleeps (sync_weights wakes it)
        result = self.policy_update.run(batch, coefs.loss, step, self.entropy.history)
        return self._check_update_on_all_ranks(result)

    def sync_weights(self) -> None:
        """The step after the update: the rollout engine takes the trained weights (hf: ZeRO-3's copy gathered;
        vllm: reloaded, its prefix cache reset) and the scoring modules go back to eval mode (Models.sync_weights).
        The one place weights reach the rollouts; every rank calls it."""
        self.models.sync_weights()

    def mismatch_metrics(self, batch: TurnBatch) -> dict[str, float]:
        """rollout/logp_diff_* and friends (algos/rollout_correction.py): the engine's log-probs of the sampled
        tokens against the trainer's old log-probs (all ranks: all-reduced); {} when rollout.mismatch_metrics
        is off (the sampling policy then kept none)."""
        if not batch.engine_logprobs:
            return {}
        sums = mismatch_sums(batch.engine_logprobs, batch.old_logprobs, self.models.rollout.correction)
        return mismatch_metrics_from_sums(sums, all_reduce_sum, all_reduce_max, self.dist.device)

    def turn_width(self, step: int, total: int) -> int:
        """How many turn slots the entropy statistics have: env.max_turns, or the curriculum's longer limit
        (read before the curriculum observes the step)."""
        return max(self.settings.loop.max_turns, self.curriculum.max_turns(step, total))

    def sft_step(self, data: TurnBatch, step: int) -> dict[str, float]:
        """One behaviour-cloning step on the demonstrations `data` (training/sft.py)."""
        coefs = self.term_coefficients.at(0.0, 0.0, 0.0)
        result = self._check_update_on_all_ranks(sft_step(self.policy_update, data, coefs, step))
        self.sync_weights()
        return result.metrics

    def _check_update_on_all_ranks(self, result: UpdateResult) -> UpdateResult:
        """Count skipped updates (too many in a row stop the run; the weights were not changed by them) and
        check the weights are finite on every rank (a max all-reduce: all ranks stop together)."""
        if result.skipped:
            self.logger.warn(f"{result.skipped}/{result.optimizer_steps} updates skipped: non-finite loss or gradient")
        self.state.consecutive_skips = skip_streak(self.state.consecutive_skips, result,
                                                   self.settings.loop.max_nonfinite_skips,
                                                   lambda: checkpoint_paths.latest_tag(self.run))
        # non-finite weights (an lr far too large) stop the run before this step's checkpoint and next rollout
        check_finite_weights(self.models.engine.module, self.state.step + 1, self.settings.likely_causes,
                             self.run, checkpoint_paths.latest_tag(self.run), all_reduce_max)
        return result

    # ---- after each step: evaluation, checkpoints, stopping ------------------------------------------------
    def _maybe_evaluate(self, done_steps: int, total: int) -> dict[str, float]:
        if not self.evaluation.due(done_steps, total):
            return {}
        policy = self.models.sampling_policy(self.models.rollout.eval_temperature)
        return self.evaluation.all_splits(policy, done_steps, self.run / "samples" if self.dist.is_main else None)

    def _load(self, ckpt: Path) -> None:
        payload = checkpoint.load(ckpt, self.models.engine, self.models.critic_engine, self.dist.rank,
                                  self.settings.loop.algo)
        with refusing_damaged(ckpt):  # a part's state of the wrong shape: one message, not a traceback
            self.state = TrainState(**payload["trainer"])
            self.entropy.load_state_dict(payload)
            self.curriculum.load_state_dict(payload.get("curriculum", {}))
        self.models.sync_weights()

    def _maybe_checkpoint(self, done_steps: int, total: int, metrics: dict[str, float]) -> None:
        loop, best_key = self.settings.loop, self.settings.loop.best_metric
        is_best = False
        if best_key and best_key in metrics and math.isfinite(metrics[best_key]):
            if self.state.best_value is None or metrics[best_key] > self.state.best_value:
                self.state.best_value, self.state.best_step, is_best = metrics[best_key], done_steps, True
        every = loop.save_every
        due = done_steps == total or (every > 0 and done_steps % every == 0) or self._should_stop(done_steps)
        if due or is_best:  # what a resume restores besides model and optimizer: the parts' states
            payload = {"trainer": self.state.__dict__, **self.entropy.state_dict(),
                       "curriculum": self.curriculum.state_dict()}
            checkpoint.save(self.run, done_steps, self.models.engine, self.models.critic_engine, payload,
                            self.dist.rank, keep=loop.keep_checkpoints, best_step=self.state.best_step,
                            algo=loop.algo)

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
        if done_steps >= self.settings.loop.total_steps:
            return False
        stop = self.settings.loop.stop_after
        return self.stop_signal is not None or (stop is not None and done_steps >= stop)

    def _finish(self) -> None:
        """Export the final policy (Hugging Face folder) once every step has trained."""
        if self.dist.is_main and self.state.step >= self.settings.loop.total_steps:
            export_policy(self.models.policy.module, self.models.tokenizer, self.run / "final")
