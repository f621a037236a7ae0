"""Every kind of outside thing that goes wrong is one message naming the setting or the file, exit non-zero,
no traceback; where it can be checked before any work, it is (nothing written).

    a file where a folder goes      eval out=, report --out, sweep output_dir, model.cache_dir, sweep summarize
    read-only run directories       epo eval run=, epo report, epo train trainer.resume=
    damaged files a sweep reads     status.json, sweep.json, sweep_job.json (a warning; the summary goes on)
    settings an outside library or program refuses
                                    hostfile lines, MLflow URI, attention implementation, LoRA targets, a model
                                    folder with its own code, prompt templates, ScienceWorld simplification
                                    and JVM options
    a full disk                     status.json still says failed
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import SmallConfig, metrics_rows, one_error, read_only_view, run_epo


def fake_run(path: Path) -> Path:
    """A finished-looking run directory (config.yaml, two metrics rows, status) that eval and report read."""
    from epo_cli.compose import compose

    path.mkdir(parents=True)
    (path / "config.yaml").write_text(OmegaConf.to_yaml(compose(SmallConfig().run())))
    (path / "metrics.jsonl").write_text('{"step": 1, "rollout/success": 0.0}\n{"step": 2, "rollout/success": 0.5}\n')
    (path / "status.json").write_text('{"status": "finished"}')
    return path


# ---- a file where a folder goes ---------------------------------------------------------------------------

FILE_FOR_FOLDER = {
    "eval out": (["eval", "policy=random", "episodes=1", "out={file}"], "out: '{file}' is a file"),
    "report --out": (["report", "{run}", "--out", "{file}"], "--out: '{file}' is a file"),
    "eval model.cache_dir": (["eval", "policy=random", "episodes=1", "model.cache_dir={file}",
                              "output_dir={tmp}"], "model.cache_dir (or $EPO_CACHE): '{file}' is a file"),
    "sweep output_dir": (["sweep", "algo=sft", "seed=0,1", "output_dir={file}"], "is a file, not a folder"),
    "sweep summarize": (["sweep", "summarize", "{file}"], "is not a folder"),
    "train output_dir": (["train", "output_dir={file}/runs", "trainer.total_steps=1"], "Cannot write the run"),
}


@pytest.mark.parametrize("case", list(FILE_FOR_FOLDER))
def test_a_file_where_a_folder_goes_is_one_message_before_any_work(case: str, tmp_path: Path) -> None:
    args, text = FILE_FOR_FOLDER[case]
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    run = fake_run(tmp_path / "run")
    fill = {"file": blocker, "run": run, "tmp": tmp_path / "out"}
    before = sorted(p.name for p in tmp_path.rglob("*"))
    proc = run_epo([a.format(**fill) for a in args], cwd=tmp_path, expect=None)
    assert proc.returncode != 0
    one_error(proc, text.format(**fill))
    assert blocker.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no work started, nothing written


# ---- read-only run directories ----------------------------------------------------------------------------

@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A run directory on a read-only view: a read-only bind mount as root (root ignores permissions),
    else the permissions themselves."""
    source = fake_run(tmp_path / "source")
    (source / "checkpoints" / "step_2").mkdir(parents=True)
    (source / "checkpoints" / "step_2" / "COMPLETE").write_text("2")
    (source / "checkpoints" / "latest").write_text("step_2")
    with read_only_view(source, tmp_path / "read_only") as view:
        yield view


@pytest.mark.parametrize("command", ["eval", "report", "resume"])
def test_a_read_only_run_directory_is_one_message(read_only: Path, tmp_path: Path, command: str,
                                                  epo_cache: Path) -> None:
    args = {"eval": ["eval", f"run={read_only}", "policy=random", "episodes=1"],
            "report": ["report", str(read_only)],
            "resume": ["train", f"trainer.resume={read_only}"]}[command]
    proc = run_epo(args, cwd=tmp_path, expect=None)
    assert proc.returncode != 0
    one_error(proc, str(read_only))


# ---- damaged files a sweep reads ---------------------------------------------------------------------------

@pytest.mark.parametrize("damaged", ["status.json", "sweep.json", "sweep_job.json"])
@pytest.mark.parametrize("content", ["{half", "[1, 2]", '{"options": {"threshold": "x", "direction": 3}}'])
def test_a_damaged_sweep_file_is_a_warning_and_the_summary_goes_on(tmp_path: Path, damaged: str,
                                                                   content: str) -> None:
    sweep = tmp_path / "sweep"
    job = sweep / "0-seed-0"
    job.mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps({"options": {"threshold": 0.5}}))
    (job / "sweep_job.json").write_text(json.dumps({"job": 0, "overrides": ["seed=0"]}))
    (job / "status.json").write_text('{"status": "finished"}')
    (job / "metrics.jsonl").write_text('{"step": 1, "eval/success": 1.0}\n')
    target = sweep / damaged if damaged == "sweep.json" else job / damaged
    target.write_text(content)
    proc = run_epo(["sweep", "summarize", str(sweep)], cwd=tmp_path)
    assert "Traceback" not in proc.stderr and (sweep / "summary.csv").exists(), proc.stderr
    if damaged != "status.json":  # a damaged status reads as "unknown", which the summary shows
        assert "warning:" in proc.stderr and damaged in proc.stderr, proc.stderr


def test_sweep_files_hold_standard_json(tmp_path: Path) -> None:
    from epo_cli.launch.sweep import _write_json

    _write_json(tmp_path / "job.json", {"objective": {"value": float("-inf")}, "x": [float("nan")]})
    assert json.loads((tmp_path / "job.json").read_text(), parse_constant=lambda c: 1 / 0) == \
        {"objective": {"value": None}, "x": [None]}


def test_a_nan_sweep_threshold_is_refused(tmp_path: Path) -> None:
    for value in ("nan", "inf"):
        proc = run_epo(["sweep", "algo=sft", "seed=0,1", f"sweep.threshold={value}", f"output_dir={tmp_path}"],
                       cwd=tmp_path, expect=2)
        one_error(proc, "sweep.threshold must be a finite number")
    assert not (tmp_path / "sweeps").exists()


# ---- settings that an outside library or program refuses ---------------------------------------------------

@pytest.mark.parametrize("lines", ["node-1 slots=abc", "node-1", "node-1 slots=0", "node-1 slots=2 gpus=3",
                                   "node-1 slots=2\nnode-1 slots=2", "\x00\x81\xff binary"])
def test_a_malformed_hostfile_is_one_message_before_any_rank_starts(tmp_path: Path, lines: str) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_bytes(lines.encode("latin-1"))
    proc = run_epo(["train", "algo=grpo", "launcher=deepspeed", "launcher.num_gpus=2", "launcher.num_nodes=1",
                    f"launcher.hostfile={hostfile}", f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, expect=1)
    one_error(proc, "launcher.hostfile", str(hostfile))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("template", "text"), [
    ("Obs: {observation} {task.__class__}", "{task.__class__}, which is not one of its fields"),
    ("Obs: {observation} {goal}", "{goal}, which is not one of its fields"),
    ("Obs: {observation} {", "not a valid template"),
    ("Obs: {observation} {0}", "{0}, which is not one of its fields"),
])
def test_a_broken_prompt_template_is_refused_at_config_time(tmp_path: Path, template: str, text: str) -> None:
    proc = run_epo(["config", "show", f"env.prompt_template='{template}'"], cwd=tmp_path, expect=2)
    one_error(proc, text, "env.prompt_template")


def test_a_literal_template_with_every_field_renders_on_every_turn() -> None:
    from epo_cli.rollout.prompts import TEMPLATE_FIELDS, EpisodeMemory, PromptBuilder

    template = " ".join("{" + f + "}" for f in TEMPLATE_FIELDS) + " {{literal}}"
    builder = PromptBuilder(template, 2, 1000, lambda text: list(range(len(text.split()))))
    memory = EpisodeMemory(task="put a mug")
    assert builder.render(memory, "a room", ["look"], 0).startswith("put a mug a room 'look' 0 0  1 {literal}")
    memory.observations.append("a room")
    memory.actions.append("look")
    assert "Action 1: 'look'" in builder.render(memory, "a hall", ["go"], 1)


def test_an_unavailable_attention_is_one_message_before_the_run_directory(tmp_path: Path) -> None:
    proc = run_epo(["train", "model.attn_implementation=flash_attention_2", "trainer.device=cpu",
                    f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, expect=1)
    one_error(proc, "model.attn_implementation=flash_attention_2 cannot be used here", "sdpa")
    assert not (tmp_path / "out").exists()


def test_a_lora_target_that_matches_nothing_names_the_modules(tmp_path: Path, epo_cache: Path) -> None:
    proc = run_epo(["train", *SmallConfig().sft("model.lora.rank=4", "model.lora.target_modules=[qq_proj]"),
                    f"output_dir={tmp_path}"], cwd=tmp_path, expect=1)
    one_error(proc, "model.lora.target_modules=['qq_proj'] matches no module", "q_proj")


def test_a_model_folder_with_its_own_code_is_one_message(tiny_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "custom"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    marker = tmp_path / "ran"
    config.update(model_type="custom_lm", auto_map={"AutoConfig": "custom.Config",
                                                    "AutoModelForCausalLM": "custom.Model"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    proc = run_epo(["eval", f"model.path={folder}", "episodes=1", f"output_dir={tmp_path / 'out'}"],
                   cwd=tmp_path, expect=1)
    one_error(proc, "holds its own model code", "model.trust_remote_code=true")
    assert not marker.exists()


def test_an_mlflow_uri_its_library_refuses_is_one_message(tmp_path: Path, epo_cache: Path) -> None:
    pytest.importorskip("mlflow")
    run = tmp_path / "run"
    proc = run_epo(["train", *SmallConfig().sft("logger=mlflow", "logger.mlflow.tracking_uri=nosuch://x"),
                    f"run_dir={run}"], cwd=tmp_path, expect=1)
    one_error(proc, "logger.mlflow.tracking_uri", "nosuch://x")
    assert json.loads((run / "status.json").read_text())["status"] == "failed"


needs_scienceworld = pytest.mark.skipif(
    importlib.util.find_spec("scienceworld") is None or shutil.which("java") is None,
    reason="scienceworld or Java not installed")


@needs_scienceworld
@pytest.mark.parametrize(("setting", "text"), [
    ("env.simplification=fastTravel", "env.simplification: unknown simplification(s) fastTravel"),
    ("env.jvm_options='-XX:+NoSuchFlag'", "Unrecognized VM option"),
    ("env.jvm_options='-javaagent:/nonexistent/agent.jar'", "is refused by the JVM"),
])
def test_scienceworld_settings_its_simulator_refuses(tiny_folder: Path, tmp_path: Path, setting: str,
                                                     text: str) -> None:
    proc = run_epo(["eval", "env=scienceworld", "policy=random", "episodes=1", "env.num_workers=0",
                    f"model.path={tiny_folder}", setting, f"out={tmp_path / 'out'}"], cwd=tmp_path, expect=2)
    one_error(proc, text)


# ---- a full disk ------------------------------------------------------------------------------------------

def test_status_json_says_failed_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No new file can be written (the atomic status.tmp + rename fails with ENOSPC): status.json is
    rewritten in place, which needs no new block."""
    import epo_cli.rundir.folder
    from epo_cli.rundir.folder import read_status, write_status

    def full_disk(path: Path, data: str, atomic: bool = True) -> None:  # a real ENOSPC, from /dev/full
        (path.parent / "status.json.tmp").write_text("")  # the temp file it had begun
        with open("/dev/full", "w") as f:  # (a symlink to /dev/full is refused now: issue 41)
            f.write(data)

    write_status(tmp_path, "running")
    monkeypatch.setattr(epo_cli.rundir.folder, "write_file", full_disk)  # writing a new file: ENOSPC
    write_status(tmp_path, "failed", error="Could not write to the run directory")
    assert read_status(tmp_path)["status"] == "failed"
    assert not (tmp_path / "status.json.tmp").exists()
    (tmp_path / "status.json").unlink()
    with pytest.raises(OSError) as err:  # nothing to rewrite in place: the error stays the caller's
        write_status(tmp_path, "failed")
    assert err.value.errno == errno.ENOSPC


def test_a_full_disk_during_a_run_leaves_status_failed(tmp_path: Path, epo_cache: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the CLI: the disk fills after the run started (every new file fails with ENOSPC from then on,
    the checkpoint's included); status.json still ends as `failed` with the error."""
    import epo_cli.rundir.folder
    from epo_cli.training import checkpoint

    full = {"on": False}

    def fill_up(run: Path, step: int) -> None:
        full["on"] = True
        raise OSError(errno.ENOSPC, "No space left on device", str(run / "checkpoints"))

    real_write = Path.write_text

    def write_text(self: Path, *args, **kwargs):
        if full["on"] and self.name == "status.json.tmp":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "SAVE_HOOKS", [fill_up])  # the fault-injection seam
    monkeypatch.setattr(Path, "write_text", write_text)
    run = tmp_path / "run"
    proc = run_epo(["train", *SmallConfig().sft("trainer.save_every=1"), f"run_dir={run}"], cwd=tmp_path,
                   expect=1)
    one_error(proc, "Could not write to the run directory")
    status = epo_cli.rundir.folder.read_status(run)
    assert status["status"] == "failed" and "No space left" in status["error"], status



# ---- a stop signal during a checkpoint save ------------------------------------------------------------------

def test_a_sigterm_during_a_checkpoint_save_stops_right_after_it(tmp_path: Path, epo_cache: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM arrives while step 1's periodic checkpoint is written: the run stops after step 1 (that
    checkpoint holds it), not after a step 2 that nobody asked for."""
    import signal

    from epo_cli.training import checkpoint

    sent = []

    def get_signalled(run: Path, step: int) -> None:
        if step == 1 and not sent:
            sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)  # epo's handler (installed by `epo train`) records it

    monkeypatch.setattr(checkpoint, "SAVE_HOOKS", [get_signalled])  # the fault-injection seam
    saved = signal.getsignal(signal.SIGTERM)
    run = tmp_path / "run"
    try:
        proc = run_epo(["train", *SmallConfig().sft("trainer.total_steps=4", "trainer.save_every=1"),
                        f"run_dir={run}"], cwd=tmp_path, expect=143)
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert "stopped after step 1" in proc.stderr, proc.stderr[-2000:]
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "stopped" and status["step"] == 1 and status["signal"] == "SIGTERM"
    assert [row["step"] for row in metrics_rows(run)] == [1]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_1"
