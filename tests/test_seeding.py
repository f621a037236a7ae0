"""derive_seed: the documented encoding (SHA-256 of the parts as compact JSON, first 31 bits), the same in
every process whatever its hash salt, distinct for distinct parts, and in range."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epo_cli.seeding import derive_seed

REPO = Path(__file__).resolve().parent.parent


def test_value_is_the_first_31_bits_of_the_sha256_of_the_json_parts() -> None:
    # computed here from the documented recipe, independently of the implementation
    digest = hashlib.sha256(b'[0,"turn",3,17,2]').hexdigest()
    assert derive_seed(0, "turn", 3, 17, 2) == int(digest[:8], 16) >> 1
    assert derive_seed() == int(hashlib.sha256(b"[]").hexdigest()[:8], 16) >> 1
    # negative numbers (evaluation plays step -1) and non-ASCII text are part of the encoding too
    assert derive_seed(-1, "é") == int(hashlib.sha256(b'[-1,"\\u00e9"]').hexdigest()[:8], 16) >> 1


def test_same_value_in_processes_with_different_hash_salts() -> None:
    code = "from epo_cli.seeding import derive_seed; print(derive_seed(7, 'minibatch', 1, 0, 5, 3))"
    values = set()
    for salt in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": salt, "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        values.add(int(out.stdout))
    assert values == {derive_seed(7, "minibatch", 1, 0, 5, 3)}


def test_distinct_parts_give_distinct_seeds_in_range() -> None:
    seeds = [derive_seed(seed, what, step, row)
             for seed in range(3) for what in ("turn", "minibatch") for step in range(10) for row in range(20)]
    assert len(set(seeds)) == len(seeds)  # 1,200 values of 2**31: a chance collision ~ 1 in 3,000
    assert all(0 <= s < 2 ** 31 for s in seeds)
    # order matters, and an int is not the string of its digits
    assert derive_seed(1, 2) != derive_seed(2, 1)
    assert derive_seed(1, "2") != derive_seed(1, 2)
    # a large run seed still gives a 31-bit value
    assert 0 <= derive_seed(2 ** 80, "x") < 2 ** 31


@pytest.mark.parametrize("bad", [1.0, True, None, b"x"])
def test_unstable_part_types_are_refused(bad: object) -> None:
    with pytest.raises(TypeError, match="ints and strings"):
        derive_seed(0, bad)
