"""One way to derive a seed from the run's seed and what the seed is for.

    derive_seed(cfg.seed, "turn", step, traj_id, turn)      # a rollout row's sampling seed
    derive_seed(cfg.seed, "minibatch", step, epoch, traj_id, turn)

Every seed drawn from the run's seed goes through `derive_seed`, so that a resumed run, every rank of a
distributed run and a rerun on another machine draw the same numbers. (Seeds that do not depend on the run
are constants: the tiny model is built with seed 0, one cached model per configuration; an env seeds its own
generator with its task's seed, which a derived generator drew.) The value is the first 31 bits of the
SHA-256 of the parts written as compact JSON: stable across processes, machines and Python versions.
Python's `hash` is not: str hashes are salted per process (PYTHONHASHSEED), and tuple hashing is an
implementation detail.
"""

from __future__ import annotations

import hashlib
import json

#: derived seeds are in [0, 2**31): valid for torch, random, numpy and 32-bit signed seed fields alike
SEED_BITS = 31


def derive_seed(*parts: int | str) -> int:
    """A seed in [0, 2**31) that depends only on `parts` (ints and strings, in order).

    Name what the seed is for with a string part ("turn", "minibatch", ...), so that two uses with the
    same numbers still get independent seeds. Other types (floats, tensors, numpy ints) are refused: their
    text form is not stable, so convert them with int() first."""
    for part in parts:
        if not isinstance(part, (int, str)) or isinstance(part, bool):
            raise TypeError(f"derive_seed takes ints and strings, got {type(part).__name__} ({part!r})")
    text = json.dumps(list(parts), separators=(",", ":"))
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") >> (32 - SEED_BITS)
