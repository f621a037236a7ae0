"""The ranks started by `epo train launcher=deepspeed` keep their temp files in a folder of their own, removed
once they are gone (epo_cli.launch.deepspeed._run_ranks). DeepSpeed probes its ops at start-up by compiling in
mkdtemp() folders; a rank killed meanwhile (here: the launcher ending an attempt whose port was taken) would
otherwise leave them in the system temp directory. DeepSpeed's CPU allreduce buffers in /dev/shm, which it never
unlinks, go too (remove_allreduce_buffers)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from epo_cli.launch import deepspeed as deepspeed_launch
from epo_cli.launch.deepspeed import _run_ranks
from epo_cli.launch.layout import Layout

#: a stand-in for the deepspeed launcher and its ranks: makes a temp folder as DeepSpeed's op probe does, then
#: exits, or records that rank 0 found its port taken and waits to be killed
RANK = """
import json, sys, tempfile, time
from pathlib import Path

run = Path(sys.argv[1])
(run / "made.txt").write_text(tempfile.mkdtemp())
if sys.argv[2] == "port_taken":
    (run / "ranks").mkdir(exist_ok=True)
    (run / "ranks" / "rank0.error").write_text(json.dumps({"rank": 0, "port_taken": True, "time": 0.0}))
    time.sleep(300)
"""


@pytest.mark.parametrize("ending", ["exits", "port_taken"])
def test_the_ranks_temp_files_go_with_them(tmp_path: Path, ending: str) -> None:
    system_temp = Path(tempfile.gettempdir())
    before = set(system_temp.iterdir())
    code = _run_ranks([sys.executable, "-c", RANK, str(tmp_path), ending], Layout(1, 1, gpu=False), tmp_path)
    assert (code == 0) == (ending == "exits"), code  # killed: the launcher ended that attempt at once
    made = Path((tmp_path / "made.txt").read_text())
    assert made.parent.parent == system_temp and made.parent.name.startswith("epo-ranks-"), made
    assert not made.parent.exists()  # removed with everything the ranks left in it
    assert set(system_temp.iterdir()) == before


#: a stand-in for two ranks on one node: each maps its allreduce buffer under DeepSpeed's name and exits
#: without unlinking it, as DeepSpeed's CPU allreduce does
BUFFERS = """
import os, sys
from pathlib import Path

shm, port = Path(sys.argv[1]), sys.argv[2]
for rank in (0, 1):
    (shm / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_{rank}").write_bytes(b"buffer")
"""


def test_the_ranks_allreduce_buffers_go_with_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(deepspeed_launch, "SHM_DIR", shm)
    other_job = shm / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29501_0"  # another port: live
    other_job.write_bytes(b"in use")
    run = tmp_path / "run"
    run.mkdir()
    code = _run_ranks([sys.executable, "-c", BUFFERS, str(shm), "29500"], Layout(1, 2, gpu=False), run, 29500)
    assert code == 0
    assert sorted(p.name for p in shm.iterdir()) == [other_job.name]  # this run's two are gone, not the other's

