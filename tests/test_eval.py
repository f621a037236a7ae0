"""`epo eval`: confidence intervals by hand, scripted policies whose outcome is checked against the env played
directly, weights from final/ and from a DeepSpeed checkpoint reproducing the trainer's own evaluation, the
programmatic evaluate_run giving what the command gives, true/false options read by the same rule as config
keys, and user errors (one message, non-zero exit, no traceback)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from epo_cli.errors import ConfigError
from epo_cli.evaluation.run import EVAL_JSON_FIELDS, EvalCommandConfig, evaluate_run, parse_eval_args
from epo_cli.evaluation.split import mean_interval, wilson_interval

from conftest import SmallConfig, metrics_rows, one_error, run_cli, run_epo

#: a tiny sft run: enough for checkpoints, final/ and one evaluation at the end
TINY_RUN = ["train", *SmallConfig().sft("trainer.eval_episodes=2", "env.eval_splits=[eval_in_distribution]")]


# ---- intervals (hand-computed) ---------------------------------------------------------------------------

def test_wilson_interval_hand_values() -> None:
    # 8/10: p=0.8, z^2=3.8415; centre (0.8 + 0.19207)/1.38415 = 0.71674, half 1.41601*sqrt(0.016+0.0096037)
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.49016, abs=1e-4) and hi == pytest.approx(0.94332, abs=1e-4)
    # 0/10: the interval starts at 0 and ends at 2*0.13877
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.27753, abs=1e-4)
    # n/n: lower bound n / (n + z^2)
    lo, hi = wilson_interval(8, 8)
    assert lo == pytest.approx(8 / (8 + 1.959963984540054 ** 2), abs=1e-9) and hi == 1.0
    assert all(math.isnan(x) for x in wilson_interval(0, 0))


def test_mean_interval_hand_values() -> None:
    mean, std, lo, hi = mean_interval([2.0, 4.0, 6.0])  # std 2, half 1.96*2/sqrt(3) = 2.26317
    assert (mean, std) == (4.0, 2.0)
    assert lo == pytest.approx(1.73683, abs=1e-4) and hi == pytest.approx(6.26317, abs=1e-4)


# ---- scripted policies -------------------------------------------------------------------------------------

def _expert_turns(task_id: str, max_turns: int) -> tuple[bool, int]:
    """Play the household task behind `task_id` with its expert, directly on the env (no CLI, tokenizer)."""
    from epo_cli.envs.base import Task
    from epo_cli.envs.household import HouseholdEnv

    _, split, level, task_type, seed = task_id.split("/")
    env = HouseholdEnv()
    _, info = env.reset(Task(task_id, task_type, int(seed), split, level))
    for turn in range(1, max_turns + 1):
        result = env.step(info["expert_action"])
        info = result.info
        if result.done:
            return bool(info["won"]), turn
    return False, max_turns


@pytest.mark.slow
def test_eval_expert_matches_env_played_by_hand(epo_cache: Path, tmp_path: Path) -> None:
    # small_pick_and_light: the expert needs 5-10 turns on these tasks, so max_turns=8 loses some
    args = ["eval", "policy=expert", "env.level=small_pick_and_light", "env.max_turns=8", "episodes=10",
            "split=eval_in_distribution", f"out={tmp_path}"]
    run_epo(args, cwd=tmp_path)
    result = json.loads((tmp_path / "expert-eval_in_distribution-t0.4.json").read_text())
    assert set(EVAL_JSON_FIELDS) <= set(result)
    assert result["format"] == "epo-eval/1" and result["policy"] == "expert"
    episodes = result["per_episode"]
    assert len(episodes) == result["episodes"] == 10
    expected = {ep["task_id"]: _expert_turns(ep["task_id"], 8) for ep in episodes}
    for ep in episodes:
        assert (ep["won"], ep["turns"]) == expected[ep["task_id"]], ep
    wins = sum(won for won, _ in expected.values())
    assert 0 < wins < 10, "the check needs both outcomes"
    assert result["success"]["wins"] == wins and result["success"]["rate"] == pytest.approx(wins / 10)
    assert result["success"]["ci95"] == pytest.approx(list(wilson_interval(wins, 10)))
    assert result["success"]["ci_method"] == "wilson"
    for task_type, item in result["success_by_task_type"].items():
        mine = [expected[ep["task_id"]][0] for ep in episodes if ep["task_type"] == task_type]
        assert (item["wins"], item["n"]) == (sum(mine), len(mine))
    assert result["invalid_rate"]["rate"] == 0.0  # the expert always answers in the response format
    assert result["episode_len"]["mean"] == pytest.approx(sum(t for _, t in expected.values()) / 10)
    assert result["metrics"]["eval/eval_in_distribution/success"] == pytest.approx(wins / 10)
    samples = Path(result["samples"]).read_text()
    assert "WON" in samples and "**Turn 1**" in samples


@pytest.mark.slow
def test_eval_look_policy_never_succeeds(epo_cache: Path, tmp_path: Path) -> None:
    # the real console script (a smoke test of `epo eval`; the other tests here run it in-process)
    run_cli(["eval", "policy=look", "env.max_turns=5", "episodes=6", "greedy=true"], cwd=tmp_path)
    # no run given: results go under <output_dir>/eval/<time>/
    (path,) = (tmp_path / "outputs" / "eval").glob("*/look-eval_in_distribution-greedy.json")
    result = json.loads(path.read_text())
    assert result["success"]["wins"] == 0 and result["success"]["rate"] == 0.0
    assert result["success"]["ci95"] == pytest.approx([0.0, wilson_interval(0, 6)[1]])
    assert result["episode_len"]["mean"] == 5.0 and result["invalid_rate"]["rate"] == 0.0
    assert result["greedy"] is True and result["temperature"] == 0.0


# ---- a trained run: final/ and checkpoints, the same numbers as the trainer -------------------------------

@pytest.fixture(scope="module")
def tiny_run(epo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eval_run")
    run_epo([*TINY_RUN, f"run_dir={out / 'run'}"], cwd=out)
    return out / "run"


def _final_eval_metrics(run: Path) -> dict[str, float]:
    last = metrics_rows(run)[-1]
    return {k: v for k, v in last.items() if k.startswith("eval/eval_in_distribution/")}


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["latest", "final"])
def test_eval_reproduces_the_trainers_evaluation(tiny_run: Path, checkpoint: str) -> None:
    """Same tasks, same sampling seeds, same weights (loaded without DeepSpeed): identical trajectories."""
    run_epo(["eval", f"run={tiny_run}", f"checkpoint={checkpoint}", "episodes=2"], cwd=tiny_run)
    name = {"latest": "step_2", "final": "final"}[checkpoint]
    result = json.loads((tiny_run / "eval" / f"{name}-eval_in_distribution-t0.4.json").read_text())
    assert set(EVAL_JSON_FIELDS) <= set(result)
    assert result["checkpoint"] == checkpoint and result["checkpoint_resolved"] == name
    assert result["metrics"] == pytest.approx(_final_eval_metrics(tiny_run))
    trainer_samples = (tiny_run / "samples" / "step_2-eval_in_distribution.md").read_text()
    assert Path(result["samples"]).read_text() == trainer_samples


@pytest.mark.slow
def test_eval_consolidates_a_zero2_checkpoint(epo_cache: Path, tmp_path: Path) -> None:
    """ZeRO 1-3 checkpoints hold sharded fp32 weights: zero_to_fp32 gathers them, no engine is built."""
    run = tmp_path / "zero2"
    run_epo([*TINY_RUN, "deepspeed=zero2", f"run_dir={run}"], cwd=tmp_path)
    assert list((run / "checkpoints" / "step_2").glob("*zero_pp_rank_0_*optim_states.pt"))
    run_epo(["eval", f"run={run}", "checkpoint=step_2", "episodes=2"], cwd=tmp_path)
    result = json.loads((run / "eval" / "step_2-eval_in_distribution-t0.4.json").read_text())
    assert result["metrics"] == pytest.approx(_final_eval_metrics(run))
    trainer_samples = (run / "samples" / "step_2-eval_in_distribution.md").read_text()
    assert Path(result["samples"]).read_text() == trainer_samples


def _assert_user_error(proc, *words: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "error:" in proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


@pytest.mark.slow
def test_eval_user_errors(tiny_run: Path, tmp_path: Path) -> None:
    proc = run_epo(["eval", f"run={tmp_path / 'missing'}"], cwd=tmp_path, expect=None)
    _assert_user_error(proc, "does not exist", "run=")
    proc = run_epo(["eval", f"run={tiny_run}", "split=holdout"], cwd=tmp_path, expect=None)
    _assert_user_error(proc, "Unknown split 'holdout'", "eval_out_of_distribution")
    proc = run_epo(["eval", f"run={tiny_run}", "checkpoint=step_99"], cwd=tmp_path, expect=None)
    _assert_user_error(proc, "step_99", "missing")
    # a corrupt checkpoint: a copy of the run whose model states are cut short
    broken = tmp_path / "broken"
    shutil.copytree(tiny_run, broken, ignore=shutil.ignore_patterns("final", "tb", "samples", "eval"))
    states = broken / "checkpoints" / "step_2" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:1000])
    proc = run_epo(["eval", f"run={broken}", "checkpoint=latest", "episodes=1"], cwd=tmp_path, expect=None)
    _assert_user_error(proc, "corrupt", "checkpoint=final")
    # no final/ (a run that did not finish) and no checkpoint named: a clear message too
    proc = run_epo(["eval", f"run={broken}", "checkpoint=final"], cwd=tmp_path, expect=None)
    _assert_user_error(proc, "no final/")


# ---- one rule for true/false, in `epo eval` and in every config key ---------------------------------------

@pytest.mark.parametrize("value", ["yes", "no", "1", "0", "on", "3"])
def test_eval_and_compose_refuse_the_same_non_bools(value: str, tmp_path: Path) -> None:
    """greedy= (an eval option) and env.cache_pddl= (a config key) follow config.parse_bool: a word that only
    looks like a bool is refused with the same message by both commands, never read as true or false."""
    proc = run_epo(["eval", "policy=look", f"greedy={value}"], cwd=tmp_path, expect=2)
    one_error(proc, f"Wrong type for config key 'greedy': '{value}' is not a bool. Expected true or false.")
    proc = run_epo(["config", "show", "env=alfworld", f"env.cache_pddl={value}"], cwd=tmp_path, expect=2)
    shown = repr(int(value)) if value.isdigit() else repr(value)  # Hydra reads 1 as an int, yes as text
    one_error(proc, f"Wrong type for config key 'env.cache_pddl': {shown} is not a bool. Expected true or false.")


def test_eval_and_compose_read_true_and_false_in_any_case(tmp_path: Path) -> None:
    for text, value in (("true", True), ("TRUE", True), ("False", False)):
        assert parse_eval_args([f"greedy={text}"])[0].greedy is value
        proc = run_epo(["config", "show", "env=alfworld", f"env.cache_pddl={text}"], cwd=tmp_path)
        assert f"cache_pddl: {str(value).lower()}" in proc.stdout
    # quoted, the word is text for Hydra: still the same bool (it used to be refused as "'true' is not a bool")
    proc = run_epo(["config", "show", "env=alfworld", "env.cache_pddl='false'"], cwd=tmp_path)
    assert "cache_pddl: false" in proc.stdout


# ---- evaluate_run: the programmatic evaluation behind `epo eval` -------------------------------------------

RANDOM_EVAL = dict(policy="random", split="eval_in_distribution", episodes=3, temperature=1.0)


@pytest.mark.slow
def test_evaluate_run_gives_what_epo_eval_gives(epo_cache: Path, tmp_path: Path) -> None:
    """The same options in, the same scores, episodes and files out; only when and how it ran differ."""
    overrides = ["env.max_turns=4", "seed=3"]
    result = evaluate_run(EvalCommandConfig(**RANDOM_EVAL, out=tmp_path / "api"), overrides)
    run_epo(["eval", *(f"{k}={v}" for k, v in RANDOM_EVAL.items()), f"out={tmp_path / 'cli'}", *overrides],
            cwd=tmp_path)
    (cli_path,) = (tmp_path / "cli").glob("*.json")
    from_cli = json.loads(cli_path.read_text())
    assert result.path == tmp_path / "api" / cli_path.name
    assert json.loads(result.path.read_text()) == json.loads(json.dumps(result.payload))  # what it returns is on disk
    when = {"created", "command", "duration_s", "samples"}
    assert {k: v for k, v in result.payload.items() if k not in when} == \
        {k: v for k, v in from_cli.items() if k not in when}
    assert from_cli["command"].startswith("epo eval policy=random")
    assert [ep.task.task_id for ep in result.episodes] == [ep["task_id"] for ep in from_cli["per_episode"]]
    assert result.success_rate == from_cli["success"]["rate"]
    assert (tmp_path / "api" / Path(from_cli["samples"]).name).read_text() == Path(from_cli["samples"]).read_text()


def test_evaluate_run_holds_options_to_the_commands_rules(tmp_path: Path) -> None:
    """A script's options meet the rules of `epo eval`'s: refused before anything is read or written."""
    with pytest.raises(ConfigError, match="episodes must be >= 1"):
        evaluate_run(EvalCommandConfig(policy="look", episodes=0, out=tmp_path / "out"))
    with pytest.raises(ConfigError, match="either greedy=true or temperature=T"):
        evaluate_run(EvalCommandConfig(policy="look", greedy=True, temperature=0.5, out=tmp_path / "out"))
    with pytest.raises(ConfigError, match="Unknown policy 'teacher'"):
        evaluate_run(EvalCommandConfig(policy="teacher", out=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_score_episodes_admissible_share_and_response_length_by_hand() -> None:
    """Two episodes, three turns: 'go to desk 1' and 'look' are listed, 'fly away' is not -> 2/3 admissible;
    responses of 2, 4 and 6 tokens -> 4.0 tokens per turn."""
    from epo_cli.envs.base import Task
    from epo_cli.evaluation.split import score_episodes
    from epo_cli.rollout.episodes import Episode, Turn

    def turn(action: str, n_tokens: int) -> Turn:
        return Turn(prompt_ids=[1], response_ids=list(range(n_tokens)), response_text="", observation="",
                    admissible=["go to desk 1", "look"], action=action, valid=True, subgoals=[],
                    truncated_prompt=False, obs_trimmed=False)

    task = Task("t", "pick_and_place", 0)
    episodes = [Episode(task, 0, 0, turns=[turn("go to desk 1", 2), turn("fly away", 4)]),
                Episode(task, 1, 0, turns=[turn("look", 6)])]
    scored = score_episodes(episodes)
    assert scored["admissible_rate"]["rate"] == pytest.approx(2 / 3)
    assert scored["admissible_rate"]["ci95"] == pytest.approx(list(wilson_interval(2, 3)))
    assert scored["response_tokens"] == {"mean": 4.0, "turns": 3}
