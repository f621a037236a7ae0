"""Distributed training on 2 CPU ranks (gloo) against 1 rank with the same global batch.

Starting a rank costs ~30-40 s of imports on this machine, so the comparisons share processes: this file
is also a script (`_harness`) that trains several short runs one after another inside one set of ranks
(one process group), started by the deepspeed launcher exactly as `epo train launcher=deepspeed` starts
epo_cli.launch.rank. The launcher path itself (`epo train launcher=deepspeed`: run directory, worker module,
failure handling, resume) is exercised through the real CLI by the killed-rank / resume test.

    runs (all from the behaviour-cloned warm start, 2 groups x 2 rollouts per iteration)
    1 rank          grpo (2 iterations), ppo (2), epo (2), gigpo (1), grpo + dynamic sampling (1), Clip-Cov (1)
    2 ranks         grpo ZeRO-2 (1), grpo ZeRO-3 (2, checkpoint every step), ppo ZeRO-2 (1),
                    ppo ZeRO-3 (2), epo ZeRO-2 (2), grpo + LoRA ZeRO-2 (1), gigpo ZeRO-2 (1),
                    grpo + dynamic sampling ZeRO-2 (1), Clip-Cov ZeRO-2 (1), grpo ZeRO-2 (3: the reference of
                    the SIGTERM test), then a collective that must time out
    CLI, 2 ranks    grpo ZeRO-3 whose rank 1 dies while saving step 2; then `trainer.resume=<run>`
                    grpo ZeRO-2 stopped by SIGTERM after its first step(s), then resumed: the uninterrupted
                    run's metrics; and stopped by two SIGTERMs: it leaves at once, no rank left behind
                    the first free master port picked is held (by the test): the ranks start again on another;
                    a held launcher.master_port: one message naming it
    CLI, no ranks   batch/world-size checks, SLURM submission (a stand-in `sbatch` records the script)
    in-process      the multi-node deepspeed command from a hostfile; the failure message's choice of cause;
                    torch's error for a held port is recognised, and the port-taken messages
"""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import metrics_rows

REPO = Path(__file__).resolve().parent.parent

#: one RL iteration = 2 tasks x 2 rollouts of <= 6 turns; mini-batches of 8 samples in micro-batches of 2,
#: so an iteration takes several optimizer steps and ranks hold uneven numbers of micro-batches
RL_ARGS = [
    "env.level=tiny_open_pick_place", "env.prompt_template=compact", "env.max_turns=8", "env.eval_splits=[]",
    "algo.tasks_per_step=2", "algo.group_size=2", "algo.mini_batch_size=8", "algo.micro_batch_size=2",
    "trainer.save_every=1", "logger.tensorboard=false",
    # A learning signal in every iteration: groups that all fail would have all-zero advantages, leaving
    # only the KL term, whose gradient at policy = reference is rounding noise that Adam amplifies.
    # Progress events add rewards; in 8 turns the warm start wins some of the second iteration's tasks.
    "curriculum.subgoal_rewards=true",
]
#: Clip-Cov acting on 5% of the tokens, drawn among all (a band every covariance lies in)
CLIP_COV = ["algo.policy_loss=clip_cov", "algo.policy_clip.clip_cov_ratio=0.05", "algo.policy_clip.clip_cov_lb=-1e6",
            "algo.policy_clip.clip_cov_ub=1e6"]
BASELINE_RUNS = {
    "grpo": ["algo=grpo", "trainer.total_steps=2"],
    "ppo": ["algo=ppo", "trainer.total_steps=2"],
    "epo": ["algo=epo", "trainer.total_steps=2"],
    "gigpo": ["algo=gigpo", "trainer.total_steps=1"],
    "grpo_ds": ["algo=grpo", "trainer.total_steps=1", "algo.dynamic_sampling=true",
                "algo.dynamic_sampling_max_rounds=2"],
    "clip_cov": ["algo=grpo", "trainer.total_steps=1", *CLIP_COV],
}
SHARDED_RUNS = {
    "grpo_z2": ["algo=grpo", "trainer.total_steps=1", "deepspeed=zero2"],
    "grpo_z3": ["algo=grpo", "trainer.total_steps=2", "deepspeed=zero3"],
    "ppo_z2": ["algo=ppo", "trainer.total_steps=1", "deepspeed=zero2"],
    "ppo_z3": ["algo=ppo", "trainer.total_steps=2", "deepspeed=zero3"],
    "epo_z2": ["algo=epo", "trainer.total_steps=2", "deepspeed=zero2"],
    "lora_z2": ["algo=grpo", "trainer.total_steps=1", "deepspeed=zero2", "model.lora.rank=4"],
    # GiGPO's step groups and dynamic sampling's replacement rounds: the same global batch on 2 ranks
    "gigpo_z2": ["algo=gigpo", "trainer.total_steps=1", "deepspeed=zero2"],
    "grpo_ds_z2": ["algo=grpo", "trainer.total_steps=1", "deepspeed=zero2", "algo.dynamic_sampling=true",
                   "algo.dynamic_sampling_max_rounds=2"],
    # Clip-Cov's tokens are chosen over the whole mini-batch (both ranks' micro-batches): the same tokens
    "clip_cov_z2": ["algo=grpo", "trainer.total_steps=1", "deepspeed=zero2", *CLIP_COV],
    # the uninterrupted reference of test_sigterm_then_resume_matches_the_uninterrupted_run (3 steps, so that
    # a stop after step 1 or 2 leaves a step to resume)
    "grpo_z2_stop": ["algo=grpo", "trainer.total_steps=3", "deepspeed=zero2"],
}
REL_TOL = 1e-4
#: metrics that must be equal exactly (counts and success rates: the rollouts themselves are identical)
EXACT_PREFIXES = ("rollout/success", "rollout/episode_len", "rollout/samples", "rollout/invalid_rate",
                  "curriculum/", "perf/optimizer_steps", "coef/")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


# ---- the harness (runs inside the ranks) -------------------------------------------------------------------

def _harness(spec_file: str) -> None:
    """Train every run of the spec in this process group; rank 0 records facts about each run."""
    import torch

    from epo_cli.compose import compose
    from epo_cli.launch.libraries import quiet_libraries
    from epo_cli.launch.setup import prepare_run_dir
    from epo_cli.training.engine import barrier, init_distributed
    from epo_cli.training.trainer import Trainer

    quiet_libraries()
    spec = json.loads(Path(spec_file).read_text())
    facts: dict[str, Any] = {}
    dist = None
    for name, overrides in spec["runs"].items():
        cfg = compose([*overrides, f"run_dir={Path(spec['root']) / name}", "launcher.timeout_s=300"])
        dist = dist or init_distributed(cfg.trainer.device, cfg.launcher.timeout_s)
        if dist.is_main:
            prepare_run_dir(cfg, overrides)
        barrier()
        trainer = Trainer(cfg, Path(cfg.run_dir))
        trainer.train()
        facts[name] = _run_facts(trainer)
        barrier()
    # launcher.timeout_s reaches the process group: a collective that one rank never joins must raise
    # (not hang) on the other, and the worker must classify it as a timeout
    import datetime

    from epo_cli.launch.rank import is_timeout

    group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
    if dist.rank == 0:
        try:
            torch.distributed.barrier(group=group)
            facts["timeout"] = "no error"
        except Exception as err:  # noqa: BLE001 - what is raised is the point
            facts["timeout"] = {"raised": type(err).__name__, "classified": is_timeout(err)}
    else:
        import time

        time.sleep(8)
    default_timeout = _default_group_timeout()
    if dist.rank == 0:
        facts["default_timeout_s"] = default_timeout
        Path(spec["facts"]).write_text(json.dumps(facts))


def _default_group_timeout() -> float | None:
    """The default process group's collective timeout, in seconds (a private torch API: None if absent)."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    try:
        backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - the behavioural timeout check above does not depend on it
        return None


def _run_facts(trainer: Any) -> dict[str, Any]:
    """Trainable parameter counts, and under ZeRO-3 how far the exported model is from the engine."""
    import deepspeed
    import torch

    engine = trainer.engine
    params = list(engine.module.parameters())
    facts: dict[str, Any] = {
        "world": trainer.dist.world_size,
        "trainable": sum(int(getattr(p, "ds_numel", p.numel())) for p in params if p.requires_grad),
        "total": sum(int(getattr(p, "ds_numel", p.numel())) for p in params),
        "ref_has_adapters": trainer.ref_model is not None and any(
            "lora" in name for name, _ in trainer.ref_model.named_parameters()),
    }
    if trainer.cfg.deepspeed.zero_stage == 3:  # consolidation: the export vs the engine's gathered weights
        from transformers import AutoModelForCausalLM

        torch.distributed.barrier()  # rank 0 writes <run>/final at the end of train()
        exported = dict(AutoModelForCausalLM.from_pretrained(trainer.run / "final").named_parameters())
        worst = 0.0
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            for name, p in engine.module.named_parameters():
                worst = max(worst, float((exported[name].float() - p.detach().float()).abs().max()))
        facts["export_vs_engine_max_abs"] = worst
        torch.distributed.barrier()
    return facts


# ---- helpers (pytest side) -----------------------------------------------------------------------------

def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONHASHSEED="random")
    env.pop("EPO_TEST_KILL_RANK", None)
    return env


def _launch_harness(root: Path, runs: dict[str, list[str]], ranks: int, warm: Path) -> dict[str, Any]:
    from epo_cli.launch.deepspeed import run_cpu_world
    from epo_cli.runtime.deepspeed_config import PORT_ATTEMPTS, port_taken

    spec = {"root": str(root), "facts": str(root / "facts.json"),
            "runs": {name: [*args, *RL_ARGS, f"model.path={warm / 'final'}"] for name, args in runs.items()}}
    root.mkdir(parents=True, exist_ok=True)
    (root / "spec.json").write_text(json.dumps(spec))
    options = {"cwd": root, "capture_output": True, "text": True, "timeout": 900}
    for _attempt in range(PORT_ATTEMPTS):
        if ranks == 1:  # a plain process: a world of one (init_distributed sets it up)
            proc = subprocess.run([sys.executable, __file__, str(root / "spec.json")], env=_env(), **options)
        else:  # DeepSpeed's launcher on a free port; the allreduce buffers it leaves in /dev/shm are removed
            proc = run_cpu_world([__file__, str(root / "spec.json")], ranks, _env(), log_level="warning", **options)
        # the harness starts its ranks itself (its own script, not epo_cli.launch.rank), so it does what
        # `epo train launcher=deepspeed` does when another process took the free port it picked before rank 0
        # listened on it: that fails in the first init, before anything is written; start again on a new port
        if proc.returncode == 0 or not port_taken(proc.stdout + proc.stderr):
            break
    if proc.returncode != 0:
        raise AssertionError(f"harness with {ranks} rank(s) failed ({proc.returncode})\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads((root / "facts.json").read_text())


def _metrics(run: Path) -> list[dict[str, float]]:
    return metrics_rows(run)


def _compare(reference: dict[str, float], other: dict[str, float], what: str) -> None:
    keys = {k for k in reference if not k.startswith("perf/") and k not in ("time", "elapsed_s")}
    missing = keys - set(other)
    assert not missing, f"{what}: metrics missing: {sorted(missing)}"
    bad = []
    for k in sorted(keys):
        a, b = reference[k], other[k]
        if not isinstance(a, int | float):
            continue
        if k.startswith(EXACT_PREFIXES):
            ok = a == b or (math.isnan(a) and math.isnan(b))
        else:
            ok = math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-6) or (math.isnan(a) and math.isnan(b))
        if not ok:
            bad.append(f"{k}: {a!r} vs {b!r}")
    assert not bad, f"{what} differs:\n  " + "\n  ".join(bad)


def _logits(model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.arange(1, 33).reshape(2, 16) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits


def _assert_same_model(a: Path, b: Path) -> None:
    la, lb = _logits(a), _logits(b)
    scale = float(la.abs().max())
    diff = float((la - lb).abs().max())
    assert diff <= REL_TOL * max(scale, 1.0), f"logits of {a} and {b} differ by {diff} (scale {scale})"


# ---- fixtures: the shared runs ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def baseline(warm_start: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("one_rank")
    _launch_harness(root, BASELINE_RUNS, 1, warm_start)
    return root


@pytest.fixture(scope="module")
def sharded(warm_start: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("two_ranks")
    return root, _launch_harness(root, SHARDED_RUNS, 2, warm_start)


# ---- 2 ranks = 1 rank ------------------------------------------------------------------------------------

@pytest.mark.parametrize("algo,stage", [("grpo", 2), ("grpo", 3), ("ppo", 2), ("ppo", 3), ("epo", 2), ("gigpo", 2),
                                        ("grpo_ds", 2), ("clip_cov", 2)])
def test_two_ranks_match_one_rank(baseline: Path, sharded: tuple[Path, dict], algo: str, stage: int) -> None:
    root, facts = sharded
    name = f"{algo}_z{stage}"
    assert facts[name]["world"] == 2
    one, two = _metrics(baseline / algo), _metrics(root / name)
    # every iteration the sharded run made (ZeRO-3 and epo: two; the second has wins, so success is
    # compared exactly on a non-trivial value; epo's second iteration uses the entropy history of the first)
    for step, record in enumerate(two):
        _compare(one[step], record, f"{name} iteration {step + 1} vs 1 rank")
    assert two[0]["loss/policy_clip"] != 0.0  # a real learning signal, not only rounding noise
    if len(two) > 1:
        assert 0.0 < two[1]["rollout/success"] < 1.0, "expected some wins in the second iteration"


def test_zero3_export_is_the_consolidated_engine(baseline: Path, sharded: tuple[Path, dict]) -> None:
    """<run>/final under ZeRO-3 equals the engine's gathered weights and the 1-rank run's model."""
    root, facts = sharded
    assert facts["grpo_z3"]["export_vs_engine_max_abs"] == 0.0
    assert facts["ppo_z3"]["export_vs_engine_max_abs"] == 0.0
    _assert_same_model(root / "grpo_z3" / "final", baseline / "grpo" / "final")


def test_lora_under_zero2(sharded: tuple[Path, dict], warm_start: Path) -> None:
    """Only adapters train; the KL reference is the frozen base model (no adapters; KL > 0 once the
    adapters moved); the export is a plain merged model that differs from the base only in the adapted
    projections."""
    import torch
    from transformers import AutoModelForCausalLM

    root, facts = sharded
    lora = facts["lora_z2"]
    assert 0 < lora["trainable"] < lora["total"] / 10
    first = _metrics(root / "lora_z2")[0]
    assert lora["ref_has_adapters"] is False and first["policy/kl_ref"] > 0
    assert first["perf/optimizer_steps"] >= 1
    final = root / "lora_z2" / "final"
    assert not any("lora" in p.name for p in final.iterdir())
    merged = dict(AutoModelForCausalLM.from_pretrained(final).named_parameters())
    base = dict(AutoModelForCausalLM.from_pretrained(warm_start / "final").named_parameters())
    assert set(merged) == set(base)
    changed = {n for n in base if not torch.equal(base[n], merged[n])}
    assert changed and all(n.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for n in changed)


def test_collective_timeout_is_raised_not_hung(sharded: tuple[Path, dict]) -> None:
    _, facts = sharded
    assert facts["timeout"] != "no error" and facts["timeout"]["classified"], facts["timeout"]
    if facts.get("default_timeout_s") is not None:  # launcher.timeout_s reached the default group
        assert facts["default_timeout_s"] == pytest.approx(300.0)


# ---- the CLI: a rank dies, the job ends, the last checkpoint resumes ---------------------------------------

def test_dead_rank_ends_job_then_resume_matches(warm_start: Path, sharded: tuple[Path, dict],
                                                tmp_path: Path) -> None:
    from conftest import run_cli

    root, _ = sharded
    run = tmp_path / "run"
    args = ["train", "launcher=deepspeed", "launcher.num_procs=2", *SHARDED_RUNS["grpo_z3"], *RL_ARGS,
            f"model.path={warm_start / 'final'}", f"run_dir={run}"]
    env_before = os.environ.get("EPO_TEST_KILL_RANK")
    os.environ["EPO_TEST_KILL_RANK"] = "1:2"  # rank 1 exits (code 17) when it starts to save step 2
    try:
        proc = run_cli(args, cwd=tmp_path, expect=None, timeout=600)
    finally:
        os.environ.pop("EPO_TEST_KILL_RANK") if env_before is None else os.environ.update(
            EPO_TEST_KILL_RANK=env_before)
    assert proc.returncode != 0
    message = proc.stderr.split("Distributed training failed")[-1]
    # rank 1 is named; the code is the launcher's: rank 1's 17, or rank 0's 1 when rank 0 (which lost the
    # connection to it) ended first in the launcher's poll
    assert "rank 1 ended without a Python error" in message, proc.stderr[-3000:]
    assert proc.returncode in (17, 1) and f"launcher exited with code {proc.returncode}" in message, message
    assert "Traceback" not in message and f"trainer.resume={run}" in message
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_1"
    assert (run / "checkpoints" / "step_1" / "COMPLETE").exists()
    assert not (run / "checkpoints" / "step_2" / "COMPLETE").exists()
    assert json.loads((run / "status.json").read_text())["status"] == "failed"

    run_cli(["train", f"trainer.resume={run}"], cwd=tmp_path, timeout=600)
    resumed = _metrics(run)
    reference = _metrics(root / "grpo_z3")
    assert [m["step"] for m in resumed] == [1, 2]
    _compare(reference[1], resumed[1], "resumed iteration 2 vs uninterrupted ZeRO-3 run")
    _assert_same_model(run / "final", root / "grpo_z3" / "final")
    assert json.loads((run / "status.json").read_text())["status"] == "finished"


# ---- the CLI: a stop signal (SIGTERM from a scheduler) and resume; a second signal leaves at once ---------

def _start_two_ranks(warm_start: Path, run: Path) -> subprocess.Popen:
    from test_stop_and_resume import start_train

    return start_train(["launcher=deepspeed", "launcher.num_procs=2", *SHARDED_RUNS["grpo_z2_stop"], *RL_ARGS,
                        f"model.path={warm_start / 'final'}", f"run_dir={run}"], run.parent)


def test_sigterm_then_resume_matches_the_uninterrupted_run(warm_start: Path, sharded: tuple[Path, dict],
                                                           tmp_path: Path) -> None:
    """SIGTERM to `epo train launcher=deepspeed` (2 CPU ranks): every rank stops after the same step with a
    checkpoint (each rank's RNG states and ZeRO shard), exit 143; `trainer.resume=<run>` then ends with the
    metrics and the model of the uninterrupted 2-rank run (as the 1-rank test of test_stop_and_resume)."""
    import signal

    from test_stop_and_resume import signal_after_first_step, status

    from conftest import run_cli

    root, _ = sharded
    run = tmp_path / "run"
    code, err = signal_after_first_step(_start_two_ranks(warm_start, run), run, [signal.SIGTERM])
    assert code == 143, err[-4000:]
    assert "Traceback" not in err.split("SIGTERM received")[-1]
    st = status(run)
    assert st["status"] == "stopped" and st["signal"] == "SIGTERM" and 1 <= st["step"] < 3, st
    folder = run / "checkpoints" / f"step_{st['step']}"
    assert (folder / "COMPLETE").exists()
    assert (folder / "rng_rank0.pt").exists() and (folder / "rng_rank1.pt").exists()  # both ranks saved it
    assert len(list(folder.glob("*zero_pp_rank_*_optim_states.pt"))) == 2
    assert len(_metrics(run)) == st["step"] and not (run / "final").exists()

    run_cli(["train", f"trainer.resume={run}"], cwd=tmp_path, timeout=900)
    assert status(run)["status"] == "finished"
    reference, resumed = _metrics(root / "grpo_z2_stop"), _metrics(run)
    assert [m["step"] for m in resumed] == [1, 2, 3]
    for step, (a, b) in enumerate(zip(reference, resumed), 1):
        _compare(a, b, f"iteration {step}: stopped at {st['step']} and resumed vs uninterrupted (2 ranks)")
    _assert_same_model(run / "final", root / "grpo_z2_stop" / "final")


def _processes_naming(text: str) -> list[int]:
    """Processes whose command line holds `text` (the run directory every rank is started with)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_a_second_sigterm_leaves_at_once_and_leaves_no_rank(warm_start: Path, tmp_path: Path) -> None:
    """Two SIGTERMs back to back: `epo train` kills the ranks' session at once (the step in progress is
    abandoned), exits 143, and status.json says stopped with the abandoned step; no rank process is left."""
    import signal
    import time

    from test_stop_and_resume import signal_after_first_step, status

    run = tmp_path / "run"
    code, err = signal_after_first_step(_start_two_ranks(warm_start, run), run, [signal.SIGTERM, signal.SIGTERM])
    assert code == 143, err[-4000:]
    st = status(run)
    assert st["status"] == "stopped" and st["signal"] == "SIGTERM" and "abandoned" in st, st
    assert len(_metrics(run)) < 3 and not (run / "final").exists()  # it did not go on to the end
    deadline = time.monotonic() + 30
    while _processes_naming(str(run.resolve())) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_naming(str(run.resolve())) == [], "a rank outlived the second signal"


# ---- the CLI: the master port was taken -------------------------------------------------------------------

#: one short iteration of 2 CPU ranks from the tiny model's random weights: the run only has to get going
PORT_RUN = ["train", "launcher=deepspeed", "launcher.num_procs=2", "algo=grpo", "trainer.total_steps=1",
            "deepspeed=zero2", *[a for a in RL_ARGS if not a.startswith("env.max_turns=")], "env.max_turns=2",
            "rollout.max_new_tokens=8"]


def _held_port() -> Any:
    """A listening socket on a free port: another process's server, as far as rank 0 can tell."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


def test_a_picked_port_taken_before_rank_0_listens_starts_the_ranks_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, epo_cache: Path) -> None:
    """launcher.master_port=0 picks a port that is free now; rank 0 listens on it seconds later. Here the first
    port picked is held by this test (as another process would take it in between): rank 0 cannot listen, the
    launcher ends that attempt and starts the ranks again on a new free port, and the run completes."""
    import epo_cli.launch.deepspeed as launcher
    from epo_cli.runtime.deepspeed_config import free_port

    from conftest import run_epo

    run = tmp_path / "run"
    picked: list[int] = []
    with _held_port() as held:
        taken = held.getsockname()[1]

        def first_one_taken() -> int:
            picked.append(free_port() if picked else taken)
            return picked[-1]

        monkeypatch.setattr(launcher, "free_port", first_one_taken)
        proc = run_epo([*PORT_RUN, f"run_dir={run}"], cwd=tmp_path)
    assert picked[0] == taken and len(picked) == 2 and picked[1] != taken, picked
    assert proc.stderr.count("was taken by another process") == 1, proc.stderr[-3000:]
    assert f"the master port {taken} was taken" in proc.stderr and "(attempt 2 of 3)" in proc.stderr
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    assert [m["step"] for m in _metrics(run)] == [1]
    assert not list((run / "ranks").glob("*.error"))  # the first attempt's record went with it
    # DeepSpeed's CPU allreduce buffers (one per rank in /dev/shm, never unlinked by DeepSpeed) went with
    # both attempts' ranks (epo_cli.launch.deepspeed.remove_allreduce_buffers)
    left = [p.name for port in picked for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")]
    assert left == [], left


def test_a_taken_master_port_given_by_the_user_is_one_message(tmp_path: Path, epo_cache: Path) -> None:
    """launcher.master_port is the user's: not replaced; one message naming it, exit 1, no traceback."""
    from conftest import run_cli

    run = tmp_path / "run"
    with _held_port() as held:
        port = held.getsockname()[1]
        proc = run_cli([*PORT_RUN, f"launcher.master_port={port}", f"run_dir={run}"], cwd=tmp_path, expect=1,
                       timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"error: launcher.master_port={port} is taken"), proc.stderr
    assert "Traceback" not in proc.stderr and "starting the ranks again" not in proc.stderr, proc.stderr
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and f"launcher.master_port={port}" in status["error"]


def test_the_port_taken_error_and_message(tmp_path: Path) -> None:
    """torch's own error for a port another process holds is recognised (its wording is what the launcher
    relies on); the message names launcher.master_port whichever way the port was chosen, and only a port
    picked free on one node is replaced by another."""
    import datetime

    import torch.distributed as torch_dist

    from epo_cli.compose import compose
    from epo_cli.launch.deepspeed import port_picked_here, port_taken_message
    from epo_cli.launch.layout import layout_for
    from epo_cli.launch.rank import describe_failure, master_port_taken

    with _held_port() as held:
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError) as caught:  # torch.distributed.DistNetworkError
            torch_dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=5))
    assert master_port_taken(caught.value), caught.value
    os.environ["MASTER_PORT"] = str(port)
    try:
        assert describe_failure(caught.value, 600.0).startswith(f"could not listen on the master port {port}")
    finally:
        del os.environ["MASTER_PORT"]
    assert not master_port_taken(RuntimeError("Connection reset by peer"))

    def setting(*overrides: str) -> tuple[Any, Any]:
        cfg = compose(["algo=grpo", "launcher=deepspeed", *overrides])
        return cfg, layout_for(cfg)

    picked = setting("launcher.num_procs=2")
    assert port_picked_here(*picked)
    message = port_taken_message(*picked, [41001, 41002, 41003])
    assert "3 times" in message and "41001, 41002, 41003" in message and "launcher.master_port=" in message
    given = setting("launcher.num_procs=2", "launcher.master_port=41000")
    assert not port_picked_here(*given)
    assert port_taken_message(*given, [41000]).startswith("launcher.master_port=41000 is taken")
    hosts = tmp_path / "hosts"
    hosts.write_text("node-1 slots=8\nnode-2 slots=8\n")
    multi = setting("launcher.num_gpus=8", "launcher.num_nodes=2", f"launcher.hostfile={hosts}")
    assert not port_picked_here(*multi)
    message = port_taken_message(*multi, [29500])
    assert "29500" in message and "launcher.master_port=" in message and "first node" in message


# ---- the CLI without ranks: checks and SLURM submission ------------------------------------------------

def test_world_size_checks_fail_before_any_rank_starts(tmp_path: Path) -> None:
    from conftest import run_cli

    base = ["train", "algo=grpo", "launcher=deepspeed", f"output_dir={tmp_path}"]
    proc = run_cli([*base, "launcher.num_procs=3"], cwd=tmp_path, expect=2)
    assert "divisible" in proc.stderr and "world size 3" in proc.stderr
    proc = run_cli([*base, "launcher.num_gpus=8"], cwd=tmp_path, expect=1)
    assert "launcher.num_procs" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.glob("*/*/config.yaml"))  # nothing was started


def test_slurm_submission_script(tmp_path: Path) -> None:
    """launcher=slurm builds an sbatch job (2 nodes x 8 GPUs, one srun task per rank) and submits it."""
    from conftest import run_cli

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "sbatch"  # stands in for SLURM: keeps the script, answers like sbatch
    fake.write_text(f"#!/bin/sh\ncp \"$1\" {tmp_path}/submitted.sh\necho 'Submitted batch job 4242'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit only checks that it exists
    (bin_dir / "srun").chmod(fake.stat().st_mode)
    env_path = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}:{env_path}"
    try:
        proc = run_cli(["train", "algo=grpo", "launcher=slurm", "launcher.num_nodes=2", "launcher.num_gpus=8",
                        "launcher.partition=gpu", "launcher.account=rl", "launcher.time_min=90",
                        "algo.tasks_per_step=16", "algo.micro_batch_size=4", f"run_dir={tmp_path / 'run'}"],
                       cwd=tmp_path)
    finally:
        os.environ["PATH"] = env_path
    assert "submitted SLURM job 4242" in proc.stdout
    script = (tmp_path / "submitted.sh").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=rl", "#SBATCH --time=90",
                 "--kill-on-bad-exit=1", "export DS_ACCELERATOR=cuda"):
        assert line in script, f"{line!r} not in the sbatch script:\n{script}"
    import submitit

    pickled = next((tmp_path / "run" / "slurm").glob("*_submitted.pkl"))
    delayed = submitit.core.utils.DelayedSubmission.load(pickled)
    assert type(delayed.function).__name__ == "SlurmRank" and hasattr(delayed.function, "checkpoint")
    assert delayed.args == (str((tmp_path / "run").resolve()),)
    assert (tmp_path / "run" / "config.yaml").exists()


# ---- launcher pieces without ranks -------------------------------------------------------------------

def test_multi_node_command_from_hostfile(tmp_path: Path) -> None:
    from epo_cli.compose import compose
    from epo_cli.launch.deepspeed import deepspeed_command
    from epo_cli.launch.layout import layout_for

    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nnode-1 slots=8\nnode-2 slots=8\n")
    cfg = compose(["algo=grpo", "launcher=deepspeed", "launcher.num_gpus=8", "launcher.num_nodes=2",
                   f"launcher.hostfile={hosts}", "launcher.master_addr=10.0.0.1"])
    layout = layout_for(cfg)
    assert (layout.world_size, layout.gpu) == (16, True)
    cmd = " ".join(deepspeed_command(cfg, tmp_path / "run", layout))
    for part in ("-m deepspeed.launcher.runner", "--num_nodes 2", "--num_gpus 8", "--master_port 29500",
                 f"--hostfile {hosts}", "--master_addr 10.0.0.1", "--module epo_cli.launch.rank",
                 f"--run-dir {tmp_path / 'run'}"):
        assert part in cmd, (part, cmd)


def test_failure_message_names_the_cause(tmp_path: Path) -> None:
    """The crash is reported, not the timeouts / lost connections it caused on the other ranks."""
    from epo_cli.launch.deepspeed import failure_message

    ranks = tmp_path / "ranks"
    ranks.mkdir()

    def record(rank: int, message: str, peer: bool, timeout: bool = False, t: float = 0.0) -> None:
        (ranks / f"rank{rank}.error").write_text(json.dumps(
            {"rank": rank, "message": message, "peer": peer, "timeout": timeout, "time": t}))

    record(0, "lost the connection to another rank", peer=True, t=1.0)
    record(3, "ValueError: bad observation", peer=False, t=2.0)
    assert "rank 3 failed: ValueError: bad observation" in failure_message(tmp_path, 1, 4)
    (ranks / "rank3.error").unlink()
    assert "rank 1 ended without a Python error" in failure_message(tmp_path, 247, 2)
    assert "launcher exited with code 247 (SIGKILL" in failure_message(tmp_path, 247, 2)
    record(0, "waited longer than launcher.timeout_s", peer=True, timeout=True)
    message = failure_message(tmp_path, 1, 2)
    assert "waited longer than launcher.timeout_s for rank 1" in message and "No checkpoint" in message


if __name__ == "__main__":  # one rank of the harness (see _launch_harness)
    sys.path.insert(0, str(REPO / "tests"))
    _harness(sys.argv[1])


WORLD_OF_ONE = """
import json, socket, sys
from omegaconf import OmegaConf
import epo_cli.training.engine as engine
from epo_cli.runtime.deepspeed_config import free_port

held = socket.socket()
held.bind(("127.0.0.1", 0))
held.listen()
picked = []

def first_ones_taken():
    picked.append(held.getsockname()[1] if len(picked) < int(sys.argv[1]) else free_port())
    return picked[-1]

engine.free_port = first_ones_taken
cfg = OmegaConf.create({"trainer": {"device": "cpu"}, "launcher": {"timeout_s": 30}})
try:
    info = engine.init_distributed(cfg.trainer.device, cfg.launcher.timeout_s)
    print(json.dumps({"picked": picked, "world": info.world_size}))
except RuntimeError as err:
    print(json.dumps({"picked": picked, "error": str(err).splitlines()[0]}))
"""


@pytest.mark.parametrize("taken", [1, 3])
def test_a_world_of_one_picks_another_port_when_its_own_was_taken(tmp_path: Path, taken: int) -> None:
    """A plain process (no launcher) picks a free port for its own process group; another process can take it
    before the store listens on it. It then picks another, PORT_ATTEMPTS times in all: after one taken port
    the group starts on the second; when every pick is taken, torch's error is raised."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT", "EPO_OWN_MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", WORLD_OF_ONE, str(taken)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if taken == 1:
        assert result["world"] == 1 and len(result["picked"]) == 2
        assert result["picked"][1] != result["picked"][0]
    else:
        assert len(result["picked"]) == 3 and len(set(result["picked"])) == 1
        assert "EADDRINUSE" in result["error"]
