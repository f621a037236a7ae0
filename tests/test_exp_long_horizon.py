"""scripts/experiments/exp_long_horizon.py: its episode measures on hand-made episodes, its arms composing as
named, and its quick mode through the real `epo train` path on a coin collector warm start (a summary with
both splits' evaluations and the plots; a second invocation redoes nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from epo_cli.launch.setup import compose_for_train
from tests.test_benchmarks import script_temp_dir

from conftest import metrics_rows, only_run_dir

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts" / "experiments"
sys.path.insert(0, str(SCRIPTS))

import exp_long_horizon as lh  # noqa: E402  (a script, importable once scripts/experiments/ is on the path)


def room(name: str, exits: str = "") -> str:
    return f"-= {name} =-\nYou are in the {name}. {exits}"


def test_walk_counts_moves_revisits_and_dead_ends() -> None:
    # A (start) -east-> B -north-> D (dead end) -south-> B -east-> C (coin); plus a look and a wall
    two_ways = ["go east", "go north", "go west", "look"]
    turns = [
        (room("B"), ["go east", "look"]),           # 1: A -> B
        ("You can't go that way.", two_ways),       # 2: no move
        (room("B"), two_ways),                      # 3: look: the same room
        (room("D"), two_ways),                      # 4: B -> D
        (room("B"), ["go south", "inventory"]),     # 5: D -> B (D offered one exit: a dead end)
        (room("C"), two_ways),                      # 6: B -> C
        ("You take the coin.", ["go west", "take coin"]),
    ]
    assert lh.walk(room("A"), turns) == {"moves": 4, "revisits": 1, "dead_end_visits": 1, "rooms": 4}
    # the coin's room with a single exit is no dead end; a room entered on the last turn is not judged
    coin_end = [(room("B"), ["go east"]), (room("C"), ["go west", "go east"]),
                ("You take the coin.", ["go west", "take coin"])]
    assert lh.walk(room("A"), coin_end) == {"moves": 2, "revisits": 0, "dead_end_visits": 0, "rooms": 3}
    assert lh.walk(room("A"), coin_end[:1])["dead_end_visits"] == 0
    assert lh.walk(room("A"), []) == {"moves": 0, "revisits": 0, "dead_end_visits": 0, "rooms": 1}


def test_entropy_bins_by_turn_index() -> None:
    bins = lh.by_turn_bins([(1, 1.0), (10, 3.0), (11, 0.5), (25, 0.1), (21, 0.3)])
    assert bins == [{"turns": "1-10", "mean": 2.0, "n": 2}, {"turns": "11-20", "mean": 0.5, "n": 1},
                    {"turns": "21-30", "mean": pytest.approx(0.2), "n": 2}]
    evals = [{"entropy_by_turn": bins}, {"entropy_by_turn": bins[:2]}]
    assert lh.entropy_curve(evals) == [("1-10", 2.0), ("11-20", 0.5)]  # bins every seed reached


def test_arms_compose_to_what_they_name() -> None:
    def cfg(key: str):
        return compose_for_train([f"experiment={lh.EXPERIMENT}", *lh.ARMS[key].overrides, "model.path=/x"])[0]

    base = cfg("grpo")
    assert base.env.challenge == "coin_collector" and base.env.challenge_level == 130 and base.env.max_turns == 80
    assert list(base.algo.loss_terms) == ["policy_clip", "kl"]
    assert "entropy" in cfg("grpo_ent").algo.loss_terms and cfg("grpo_ent").entropy.coef == 0.01
    assert (cfg("epo").algo.name, cfg("epo").algo.entropy_smoothing.alpha) == ("epo", 0.1)
    assert cfg("epo_bind").algo.entropy_smoothing.alpha == 1.0
    for key in ("grpo_count", "epo_count"):
        assert cfg(key).algo.intrinsic.kind == "count" and cfg(key).algo.intrinsic.coef == 3.0
    assert cfg("epo_count").algo.name == "epo" and cfg("gigpo").algo.estimator == "gigpo"


@pytest.mark.slow
@pytest.mark.realenv
def test_quick_mode_writes_a_summary_and_redoes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("textworld")
    _, env = script_temp_dir(tmp_path)
    games = f"env.cache_dir={tmp_path / 'games'}"
    warm_dir = tmp_path / "warm"
    proc = subprocess.run([sys.executable, "-m", "epo_cli", "train", "experiment=coin_warm_start", "logger=none",
                           "trainer.total_steps=2", "algo.demo_episodes=2", "env.challenge_level=103",
                           "env.num_games=2", "env.num_eval_games=2", games, f"output_dir={warm_dir}"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    warm = next(p for p in warm_dir.glob("*/*") if (p / "final").is_dir())

    out = tmp_path / "study"
    command = [sys.executable, str(SCRIPTS / "exp_long_horizon.py"), "--quick", "--warm-start", str(warm),
               "--out", str(out), "--jobs", "2", games]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {"grpo", "epo_count"} and summary["iterations"] == 2
    assert summary["levels"] == [103, 123]  # the longer chains: 23 rooms instead of 3
    for split in ("target", "longer"):
        warm_eval = summary["warm_eval"][split]
        assert warm_eval["episodes"] == 2 and 0.0 <= warm_eval["success"] <= 1.0 and warm_eval["entropy"] > 0
        assert 1 <= warm_eval["episode_len"] <= 4
    for arm in summary["arms"].values():
        assert arm["runs"] == 1 and arm["seeds"] == [0] and 0.0 <= arm["target_success"] <= 1.0
        assert 0.0 <= arm["longer_success"] <= 1.0 and arm["target_revisits"] >= 0 and arm["iteration_s"] > 0
        assert arm["target_revisits"] <= arm["target_moves"] <= arm["target_episode_len"]
        assert abs(sum(arm["target_action_shares"].values()) - 1.0) < 1e-6
    md = (out / "summary.md").read_text()
    assert "| GRPO | 1 |" in md and "| warm start |" in md and "Definitions" in md and "1-10:" in md
    assert "Eval actions by kind" in md and "| diversity drop after iteration 12, GRPO | 73% |" in md
    assert (out / "long_horizon.png").stat().st_size > 5000 and (out / "entropy_by_turn.png").stat().st_size > 3000
    again = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and "$ epo train" not in again.stdout and "$ eval" not in again.stdout

    # --continue-from: the study's runs continued by one iteration (quick: 2 -> 3) in a new folder, resumed
    # through the real CLI at the learning rate they ended with; the earlier study is left as it was
    more = tmp_path / "more"
    proc = subprocess.run([*command[:command.index("--out")], "--out", str(more), "--continue-from", str(out), games],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    continued = json.loads((more / "summary.json").read_text())
    assert continued["iterations"] == 3 and set(continued["arms"]) == {"grpo", "epo_count"}
    assert "continued to 3 at the learning rate" in continued["settings"]
    for arm in ("grpo", "epo_count"):
        before = metrics_rows(only_run_dir(out / "runs" / arm / "it2-seed0"))
        after = metrics_rows(only_run_dir(more / "runs" / arm / "it3-seed0"))
        assert [r["step"] for r in before] == [1, 2] and [r["step"] for r in after] == [1, 2, 3]
        assert after[:2] == before and after[2]["perf/lr"] == before[1]["perf/lr"]
        assert continued["arms"][arm]["runs"] == 1 and 0.0 <= continued["arms"][arm]["target_success"] <= 1.0


def test_training_entropy_by_turn_reads_the_last_iterations() -> None:
    rows = [{"policy/entropy_turn/0": 9.0}] + [{"policy/entropy_turn/0": 1.0, "policy/entropy_turn/10": 0.5,
                                                 "policy/entropy": 0.9}] * 4 + [{"policy/entropy_turn/0": 3.0}]
    assert lh.train_entropy_by_turn(rows, last=5) == [{"turns": "1-10", "mean": 1.4, "n": 5},
                                                      {"turns": "11-20", "mean": 0.5, "n": 4}]


def test_action_kinds() -> None:
    here = ["go east", "go north", "look", "inventory"]
    turns = [("go east", here), ("go south", here), ("go west", ["go west", "go south"]), ("look", here),
             ("go east", here), ("take coin", ["take coin"]), ("go east", here)]
    # east: on; south: no such exit; west: back (reverses east); look; east: back (reverses west); take; east: on
    assert lh.action_kinds(turns) == {"no such exit": 1, "back": 2, "on": 2, "look/inventory": 1, "other": 1}
