"""Components are registered with their own settings: adding one needs its registration and a config entry.

`ToyLoss` below is a loss term that epo_cli does not know: it is registered here, at module level, with its
own settings dataclass, and selected with overrides only (algo.loss_terms=[..., toy] and
algo.components.toy.*). The real compose validates its settings, the real builders put it in the loss stack
with its `coef`, and one in-process RL iteration reports its `loss/toy`. A toy advantage estimator and a toy
schedule join it (registered by the `toys` fixture, so other tests see the built-in registries): with
nothing else touched, all three compose, are validated, warn when set but unused, and train one step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import Tensor

from epo_cli.algos.aggregation import normalized_weights, weighted_sum
from epo_cli.algos.losses import LossStack, LossTerm, PolicyOutputs, build_loss_terms, loss_coefficients
from epo_cli.algos.registries import AGGREGATIONS, ESTIMATORS, LOSS_TERMS
from epo_cli.algos.schedules import (
    SCHEDULES,
    Schedule,
    build_entropy_schedule,
    build_kl_schedule,
    build_phase_schedule,
    progress,
)
from epo_cli.compose import compose
from epo_cli.config import num, one_of
from epo_cli.errors import ConfigError
from epo_cli.rollout.batch import MicroBatch, TurnBatch

from conftest import REPO, world_of_one_env


@dataclass
class ToyConfig:
    coef: float = num(0.5, ge=0)
    #: the per-token loss is (-log p) ** power
    power: int = num(2, ge=1)
    aggregation: str = one_of("token-mean", registry="aggregations")


class ToyLoss(LossTerm):
    name = "toy"

    def __init__(self, power: int, aggregation: str) -> None:
        super().__init__()
        self.power, self.aggregation = power, aggregation

    def forward(self, mb: MicroBatch, out: PolicyOutputs) -> tuple[Tensor, dict[str, Tensor]]:
        loss = weighted_sum(mb.weights[self.aggregation], (-out.logprobs) ** self.power)
        return loss, {"loss/toy": loss.detach()}


@LOSS_TERMS.register("toy", config=ToyConfig)
def _toy(settings: ToyConfig) -> LossTerm:
    return ToyLoss(settings.power, settings.aggregation)


TOY = ["algo=grpo", "algo.loss_terms=[policy_clip,kl,toy]"]


@dataclass
class ToyFlagConfig:
    coef: float = num(0.5, ge=0)
    squared: bool = True


def _toy_flag(settings: ToyFlagConfig) -> LossTerm:
    return ToyLoss(2 if settings.squared else 1, "token-mean")


def test_a_component_bool_setting_takes_only_true_or_false(monkeypatch: pytest.MonkeyPatch) -> None:
    """Component settings get the schema's bool rule too: OmegaConf alone would read squared=3 as true.
    (toy_flag is registered for this test only: other tests list the registry's names.)"""
    monkeypatch.setattr(LOSS_TERMS, "_entries", dict(LOSS_TERMS._entries))  # restored after the test
    LOSS_TERMS.register("toy_flag", config=ToyFlagConfig)(_toy_flag)
    flag = ["algo=grpo", "algo.loss_terms=[policy_clip,kl,toy_flag]"]
    assert compose([*flag, "algo.components.toy_flag.squared=false"]).algo.components.toy_flag.squared is False
    for bad in ("3", "yes"):
        with pytest.raises(ConfigError, match="'algo.components.toy_flag.squared': .* is not a bool"):
            compose([*flag, f"algo.components.toy_flag.squared={bad}"])


def test_config_module_does_not_import_torch() -> None:
    code = "import sys, epo_cli.config, epo_cli.registry; assert 'torch' not in sys.modules, 'torch imported'"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr


def test_toy_settings_are_composed_and_checked_against_its_own_dataclass() -> None:
    cfg = compose([*TOY, "algo.components.toy.coef=0.25", "algo.components.toy.power=1"])
    assert dict(cfg.algo.components.toy) == {"coef": 0.25, "power": 1, "aggregation": "token-mean"}
    # no section given: the dataclass defaults
    assert dict(compose(TOY).algo.components.toy) == {"coef": 0.5, "power": 2, "aggregation": "token-mean"}


@pytest.mark.parametrize("override, message", [
    ("algo.components.toy.coef=-1", "'algo.components.toy.coef': -1.0 is out of range; allowed: 0 <= value"),
    ("algo.components.toy.power=0", "'algo.components.toy.power': 0 is out of range; allowed: 1 <= value"),
    ("algo.components.toy.aggregation=token-meen", "Did you mean 'token-mean'?"),
    ("algo.components.toy.pwer=3", "Unknown config key 'algo.components.toy.pwer'. Did you mean "
                                   "'algo.components.toy.power'?\nValid keys in 'algo.components.toy': coef, power, "
                                   "aggregation."),
    ("algo.components.toy.power=many", "Wrong type for config key 'algo.components.toy.power'"),
    ("algo.components.kl.coef=1", "no registered component 'kl' takes its settings from algo.components"),
])
def test_bad_toy_settings_fail_at_config_time(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose([*TOY, override])
    assert message in str(err.value)


def test_unselected_component_settings_warn() -> None:
    with pytest.warns(UserWarning, match="algo.components.toy: no effect"):
        compose(["algo=grpo", "algo.components.toy.coef=1"])


@pytest.mark.parametrize("override, message", [
    ("algo.loss_terms=[policy_clip,toyy]", "Invalid value 'toyy' for 'algo.loss_terms'. Did you mean 'toy'? Valid "
                                           "values: entropy, entropy_smoothing, kl, nll, policy_clip, toy, value."),
    ("algo.estimator=rlooo", "Invalid value 'rlooo' for 'algo.estimator'. Did you mean 'rloo'? "
                             "Valid values: gae, gigpo, grpo, rloo, auto, none."),
    ("entropy.schedule=cosin", "Invalid value 'cosin' for 'entropy.schedule'. Did you mean 'cosine'?"),
    ("entropy.schedule=paper", "entropy.schedule=paper takes gamma, which the 'entropy' section has no key for. "
                               "Schedules it can use: adaptive_target, constant, cosine, delayed_linear, exp_anneal, "
                               "linear, two_phase."),
    ("algo.phase.schedule=warmup_cosine", "algo.phase.schedule=warmup_cosine takes warmup_ratio, min_lr_ratio"),
    ("algo.kl.schedule=linear",
     "Invalid value 'linear' for 'algo.kl.schedule'. Valid values: constant, phase_kl_ramp."),
    ("algo.policy_loss=clipcov", "Did you mean 'clip_cov'? Valid values: clip, clip_cov, kl_cov."),
])
def test_unknown_names_fail_at_config_time_listing_the_registry(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose(["algo=grpo", override])
    assert message in str(err.value)


def test_toy_term_is_built_into_the_stack_with_its_coef() -> None:
    algo = compose([*TOY, "algo.components.toy.coef=0.25", "algo.components.toy.power=2"]).algo
    terms = build_loss_terms(algo)
    assert list(terms) == ["policy_clip", "kl", "toy"] and isinstance(terms["toy"], ToyLoss)
    coefs = loss_coefficients(algo, entropy_coef=0.001, phase_beta=2.0, kl_weight=0.01)
    assert coefs == {"policy_clip": 1.0, "kl": 0.01, "toy": 0.25}
    # one row, two tokens, logp [-1, -2]: token-mean of (-logp)^2 = (1 + 4) / 2 = 2.5; its share of the
    # total: 0.25 * 2.5 = 0.625 (policy_clip and kl are 0 here: ratio 1 with A = 0, logp = ref_logp)
    mask = torch.ones(1, 2, dtype=torch.bool)
    turn, turns = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    mb = MicroBatch(input_ids=torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 3, dtype=torch.long),
                    position_ids=torch.arange(3)[None], response_mask=mask, prompt_width=1,
                    response_ids=torch.zeros(1, 2, dtype=torch.long), turn_index=turn, num_turns=turns,
                    old_logprobs=torch.tensor([[-1.0, -2.0]]), ref_logprobs=torch.tensor([[-1.0, -2.0]]),
                    advantages=torch.zeros(1), num_real=1,
                    weights={m: normalized_weights(m, mask, turn, turns) for m in AGGREGATIONS})
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = PolicyOutputs(logprobs=logprobs, entropy=torch.zeros(1, 2), log_ratio=logprobs - mb.old_logprobs)
    total, metrics = LossStack(terms)(mb, out, coefs)
    assert metrics["loss/toy"].item() == pytest.approx(2.5)
    assert total.item() == pytest.approx(0.625)
    total.backward()  # d/dlogp of 0.25 * mean((-logp)^2) = 0.25 * 2 * logp / 2 -> [-0.25, -0.5]
    assert out.logprobs.grad.tolist()[0] == pytest.approx([-0.25, -0.5])


def test_every_declared_builtin_has_its_code() -> None:
    """The algorithm registries are declared torch-free (epo_cli/algos/registries.py) and implemented where
    their code is: once those modules are imported, no declared name is left without its component."""
    import epo_cli.algos.advantages
    import epo_cli.algos.aggregation
    import epo_cli.algos.group_filter
    import epo_cli.algos.losses  # noqa: F401 - they implement the declared names
    from epo_cli.algos import REGISTRIES
    from epo_cli.registry import Registry

    missing = [f"{reg.kind} '{name}'" for reg in REGISTRIES.values() for name in reg.names()
               if reg.entry(name).build is None]
    assert not missing, f"declared but never implemented: {missing}"
    reg = Registry("thing")
    reg.declare("a", reads=("x.y",))
    with pytest.raises(ValueError, match="registered twice"):
        reg.declare("a")
    with pytest.raises(ValueError, match="implemented but not declared"):
        reg.implement("b", print)
    with pytest.raises(RuntimeError, match="declared but its code was never registered"):
        reg.target("a")
    assert reg.implement("a", len) is len and reg["a"] is len and reg.reads("a") == ("x.y",)
    with pytest.raises(KeyError, match="unknown thing 'c'; valid: a"):
        reg["c"]  # noqa: B018 - the lookup is what is tested


# ---- a toy estimator and a toy schedule beside the toy term ----------------------------------------------

@dataclass
class ToyAdvantageConfig:
    #: the advantage is scale * (score - the group's mean score)
    scale: float = num(1.0, gt=0)


#: batch sizes the toy estimator was called with (the training step asserts it ran)
TOY_ADVANTAGE_CALLS: list[int] = []


def toy_advantages(batch: TurnBatch, settings: ToyAdvantageConfig, all_reduce_sum=None) -> tuple[Tensor, Tensor]:
    scores = batch.outcome + batch.reward  # [N]
    adv = torch.zeros_like(scores)
    for group in batch.group_id.unique():
        member = batch.group_id == group
        adv[member] = settings.scale * (scores[member] - scores[member].mean())
    TOY_ADVANTAGE_CALLS.append(len(batch))
    return adv, scores


def _toy_needs_groups(cfg) -> None:  # noqa: ANN001 - a composed config
    if cfg.algo.group_size < 2:
        raise ConfigError(f"toy_adv centres scores in groups: algo.group_size >= 2 (got {cfg.algo.group_size}).")


class ToyStep(Schedule):
    """`start` until `exploration_share` of training, then `end` (one step)."""

    start: float
    end: float
    exploration_share: float

    def __post_init__(self) -> None:
        if not 0.0 < self.exploration_share < 1.0:
            raise ValueError(f"toy_step needs 0 < exploration_share < 1 (got {self.exploration_share})")

    def __call__(self, step: int, total_steps: int) -> float:
        return self.start if progress(step, total_steps) < self.exploration_share else self.end


@pytest.fixture
def toys(monkeypatch: pytest.MonkeyPatch) -> None:
    """toy_adv (an estimator with its own settings and check) and toy_step (a schedule with no max_value of
    its own) registered for one test: nothing else in epo_cli is touched."""
    for registry in (ESTIMATORS, SCHEDULES):
        monkeypatch.setattr(registry, "_entries", dict(registry._entries))  # restored after the test
    ESTIMATORS.register("toy_adv", config=ToyAdvantageConfig, check=_toy_needs_groups)(toy_advantages)
    step = dataclass(ToyStep)
    SCHEDULES.register("toy_step", config=step)(step)


#: EPO's terms plus the toy term, advantages from toy_adv, beta_k from toy_step (algo.phase's keys)
TOYS = ["algo=epo", "algo.loss_terms=[policy_clip,kl,entropy,entropy_smoothing,toy]", "algo.estimator=toy_adv",
        "algo.phase.schedule=toy_step", "algo.phase.start=0.3", "algo.phase.end=0.6",
        "algo.phase.exploration_share=0.5"]


def test_the_toys_compose(toys: None) -> None:
    cfg = compose([*TOYS, "algo.components.toy_adv.scale=2"])
    assert cfg.algo.estimator == "toy_adv" and dict(cfg.algo.components.toy_adv) == {"scale": 2.0}
    assert cfg.algo.phase.schedule == "toy_step" and dict(cfg.algo.components.toy)["coef"] == 0.5
    assert "toy_step" in compose(["entropy.schedule=toy_step"]).entropy.schedule  # the entropy group has its keys


@pytest.mark.parametrize("overrides, message", [
    (["algo.components.toy_adv.scale=0"], "'algo.components.toy_adv.scale': 0.0 is out of range; allowed: 0 < value"),
    (["algo.group_size=1"], "toy_adv centres scores in groups: algo.group_size >= 2 (got 1)"),  # its check
    (["algo.phase.exploration_share=1.0"], "algo.phase.schedule=toy_step: toy_step needs 0 < exploration_share < 1"),
    (["algo.components.toy.power=0"], "'algo.components.toy.power': 0 is out of range"),
    (["algo.estimator=toy_ad"], "Invalid value 'toy_ad' for 'algo.estimator'. Did you mean 'toy_adv'?"),
])
def test_the_toys_are_validated(toys: None, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        compose([*TOYS, *overrides])
    assert message in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    # set, but not in algo.loss_terms / not algo.estimator
    (["algo=grpo", "algo.components.toy.coef=1"], "algo.components.toy: no effect in this run"),
    (["algo=grpo", "algo.components.toy_adv.scale=3"], "algo.components.toy_adv: no effect in this run"),
    # toy_step reads no gamma: the paper schedule would (read from the schedule registry, nothing else)
    ([*TOYS, "algo.phase.gamma=5"], "algo.phase.gamma=5.0: no effect in this run (read only with "
                                    "algo.phase.schedule=paper)"),
    # the toy schedule's parameters under grpo, whose loss has no entropy_smoothing term for beta_k to weight
    (["algo=grpo", "algo.phase.schedule=toy_step", "algo.phase.end=0.7"],
     "algo.phase.schedule=toy_step, algo.phase.end=0.7: no effect in this run (beta weights only the "
     "'entropy_smoothing' term"),
    # max beta_k of a schedule without a max_value of its own: evaluated over the run (0.5 * 2.5 >= 1)
    ([*TOYS, "algo.entropy_smoothing.alpha=0.5", "algo.phase.end=2.5"], r"alpha * max beta_k = 0.5 * 2.5 >= 1"),
])
def test_the_toys_warn(toys: None, overrides: list[str], message: str) -> None:
    with pytest.warns(UserWarning) as caught:
        compose(overrides)
    assert any(message in str(w.message) for w in caught), [str(w.message) for w in caught]


@dataclass
class ToyBonusConfig:
    #: the bonus is this many times the entropy group's lambda
    scale: float = num(2.0, ge=0)


def test_a_term_weighted_by_a_schedule_and_that_schedule_need_nothing_else(toys: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss term whose coefficient is code that reads a weight (lam: the entropy group's schedule) and its
    settings, and a schedule for that weight (toy_step): registered here, with nothing in epo_cli touched,
    they compose, their settings are read (no warning), and the step's coefficients come out of the real
    schedule builders and loss_coefficients."""
    monkeypatch.setattr(LOSS_TERMS, "_entries", dict(LOSS_TERMS._entries))  # restored after the test
    LOSS_TERMS.register("toy_bonus", config=ToyBonusConfig,
                        coef=lambda lam, settings: -lam * settings.scale)(lambda settings: ToyLoss(1, "token-mean"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # entropy.* and algo.components.toy_bonus are read: no "no effect" line
        cfg = compose(["algo=grpo", "algo.loss_terms=[policy_clip,kl,toy_bonus]", "algo.components.toy_bonus.scale=3",
                       "entropy.schedule=toy_step", "entropy.start=0.2", "entropy.end=0.1",
                       "entropy.exploration_share=0.5"])
    lam, beta = build_entropy_schedule(cfg.entropy), build_phase_schedule(cfg.algo.phase)
    kl = build_kl_schedule(cfg.algo)
    # 4 steps: steps 0-1 (p < 0.5) lambda = start 0.2 -> -0.2 * 3 = -0.6; steps 2-3 end 0.1 -> -0.3
    for step, bonus in ((0, -0.6), (1, -0.6), (2, -0.3), (3, -0.3)):
        coefs = loss_coefficients(cfg.algo, lam(step, 4), beta(step, 4), kl(step, 4))
        assert coefs == {"policy_clip": 1.0, "kl": 0.01, "toy_bonus": pytest.approx(bonus)}
    # the monitor's clamp scales lambda, so the toy's bonus too: -0.2 * 0.1 * 3
    assert loss_coefficients(cfg.algo, 0.2, 2.0, 0.01, entropy_scale=0.1)["toy_bonus"] == pytest.approx(-0.06)
    # without the term, lambda weights nothing this run uses: the warning names the toy among its terms
    with pytest.warns(UserWarning, match="lambda weights only the 'entropy' and 'entropy_smoothing' and 'toy_bonus'"):
        compose(["algo=grpo", "entropy.coef=0.5"])


def test_a_coefficient_reads_only_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """A coef whose parameter names no weight (or a coef string of earlier versions) is refused when the config
    is composed, naming the weights."""
    monkeypatch.setattr(LOSS_TERMS, "_entries", dict(LOSS_TERMS._entries))
    LOSS_TERMS.register("toy_alpha", config=ToyConfig, coef=lambda alpha: alpha)(_toy)
    with pytest.raises(ValueError, match="takes alpha, which is not a weight; .* lam, beta, kl or settings"):
        compose(["algo=grpo", "algo.loss_terms=[policy_clip,kl,toy_alpha]"])
    # the string coefficients of earlier versions name the replacement
    del LOSS_TERMS._entries["toy_alpha"]
    LOSS_TERMS.register("toy_text", config=ToyConfig, coef="-lambda")(_toy)
    with pytest.raises(ValueError, match=r"not a string: for coef='-lambda' write e.g. coef=lambda lam, beta"):
        compose(["algo=grpo", "algo.loss_terms=[policy_clip,kl,toy_text]"])


def test_a_training_step_runs_the_toys(toys: None, epo_cache: Path, tmp_path: Path) -> None:
    from epo_cli.training.trainer import Trainer

    cfg = compose([*TOYS, "algo.components.toy.coef=0.1", "env.level=tiny_open_pick_place",
                   "env.prompt_template=compact", "env.max_turns=3", "algo.tasks_per_step=1", "algo.group_size=2",
                   "algo.micro_batch_size=4", "algo.mini_batch_size=8", "env.eval_splits=[]", "logger.console=false",
                   "logger.tensorboard=false", "trainer.total_steps=2"])
    cfg.run_dir = str(tmp_path / "toy")
    Path(cfg.run_dir).mkdir()
    with world_of_one_env():
        TOY_ADVANTAGE_CALLS.clear()
        trainer = Trainer(cfg, Path(cfg.run_dir))
        try:
            assert isinstance(trainer.loss_stack.terms["toy"], ToyLoss)
            metrics = trainer.rl_step(0, cfg.trainer.total_steps)
        finally:
            trainer.pool.close()
            trainer.logger.close()
    # (-log p) ** 2 of sampled tokens is positive: the term ran on the rollout and was logged
    assert metrics["loss/toy"] > 0 and torch.isfinite(torch.tensor(metrics["loss/toy"]))
    assert TOY_ADVANTAGE_CALLS and TOY_ADVANTAGE_CALLS[0] > 0  # the toy estimator made the advantages
    assert metrics["coef/beta"] == pytest.approx(0.3)  # step 0 of 2: toy_step's start (the paper's would be 2)
