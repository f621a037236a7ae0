"""Issue 41, classes 1-3 for the side files: a rank's failure record and the stop relay (ranks/), a sweep job's
record, and `epo eval checkpoint=`'s weight-name rule.

These files are written and read by epo's own processes, but they live in a run dir that may have been received
from elsewhere, so they follow the same rules as status.json: written without following a planted entry (the
file outside stays byte-identical), read as bounded data (a /dev/zero symlink is not read until memory runs out),
and a checkpoint's weight names are checked by the model's own tying rules, not by a list of names.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from epo_cli.errors import UserError
from epo_cli.evaluation.run import _load_state
from epo_cli.launch.deepspeed import read_rank_records
from epo_cli.launch.rank import rank_error_file, record_failure
from epo_cli.launch.sweep import _write_json
from epo_cli.rundir.writable import UnsafeEntryError
from epo_cli.training.stop import RELAY_FILE, StopRequest, write_relay

from conftest import PRECIOUS


@pytest.fixture
def run(tmp_path: Path) -> Path:
    (tmp_path / "run" / "ranks").mkdir(parents=True)
    return tmp_path / "run"


# ---- writes ------------------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_the_stop_relay_is_never_written_through_a_planted_symlink(run: Path, outside: Path) -> None:
    (run / RELAY_FILE).symlink_to(outside)
    with pytest.raises(UnsafeEntryError, match="stop.json"):
        write_relay(run, signal.SIGTERM)
    assert outside.read_bytes() == PRECIOUS


@pytest.mark.timeout(30)
def test_a_rank_failure_record_is_never_written_through_a_planted_symlink(run: Path, outside: Path) -> None:
    rank_error_file(run, 0).symlink_to(outside)
    record_failure(run, 0, RuntimeError("boom"), timeout_s=None)  # best effort: never raises
    assert outside.read_bytes() == PRECIOUS
    rank_error_file(run, 0).unlink()
    record_failure(run, 0, RuntimeError("boom"), timeout_s=None)
    assert json.loads(rank_error_file(run, 0).read_text())["message"] == "RuntimeError: boom"


@pytest.mark.timeout(30)
def test_a_sweep_job_record_is_never_written_through_a_planted_symlink(tmp_path: Path, outside: Path) -> None:
    (tmp_path / "sweep_job.json").symlink_to(outside)
    with pytest.raises(UnsafeEntryError, match="sweep_job.json"):
        _write_json(tmp_path / "sweep_job.json", {"job": 0})
    assert outside.read_bytes() == PRECIOUS


# ---- reads -------------------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("planted", ["/dev/zero symlink", "FIFO", "deep nesting"])
def test_a_planted_stop_relay_is_bounded_and_still_asks_to_stop(planted: str, run: Path) -> None:
    relay = run / RELAY_FILE
    if planted == "/dev/zero symlink":
        relay.symlink_to("/dev/zero")
    elif planted == "FIFO":
        os.mkfifo(relay)
    else:
        relay.write_text("[" * 200_000 + "]" * 200_000)
    assert StopRequest().requested(run) == int(signal.SIGTERM)


@pytest.mark.timeout(30)
def test_the_stop_relay_reports_the_signal_it_carries(run: Path) -> None:
    write_relay(run, signal.SIGINT)
    assert StopRequest().requested(run) == int(signal.SIGINT)


@pytest.mark.timeout(30)
def test_planted_rank_records_are_skipped_not_read_whole(run: Path) -> None:
    (run / "ranks" / "rank0.error").symlink_to("/dev/zero")
    os.mkfifo(run / "ranks" / "rank1.error")
    (run / "ranks" / "rank2.error").write_text("[" * 200_000 + "]" * 200_000)
    (run / "ranks" / "rank3.error").write_text('["a list, not a record"]')
    (run / "ranks" / "rank4.error").write_text('{"time": "late"}')
    record_failure(run, 5, RuntimeError("the real one"), timeout_s=None)
    assert [r["rank"] for r in read_rank_records(run)] == [5]


# ---- eval checkpoint=: the weight names by the model's own rules -----------------------------------------------

def _tiny_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def test_a_tied_head_may_be_absent_from_a_checkpoint() -> None:
    source, target = _tiny_llama(tied=True), _tiny_llama(tied=True)
    state = {k: v for k, v in source.state_dict().items() if k != "lm_head.weight"}
    _load_state(target, state, Path("ckpt"))
    assert torch.equal(target.lm_head.weight, source.model.embed_tokens.weight)


def test_an_untied_head_absent_from_a_checkpoint_is_refused_by_name() -> None:
    state = {k: v for k, v in _tiny_llama(tied=False).state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(UserError, match=r"1 of its weights are missing \(lm_head.weight\)"):
        _load_state(_tiny_llama(tied=False), state, Path("ckpt"))


def test_a_renamed_embedding_is_refused_naming_both_names() -> None:
    state = _tiny_llama(tied=True).state_dict()
    state["model.embed_tokenz.weight"] = state.pop("model.embed_tokens.weight")
    with pytest.raises(UserError) as err:
        _load_state(_tiny_llama(tied=True), state, Path("ckpt"))
    assert "model.embed_tokens.weight" in str(err.value) and "model.embed_tokenz.weight" in str(err.value)
