"""RNG states of one rank as tensors and plain values, so that a checkpoint's rng_rank<r>.pt loads with
`torch.load(weights_only=True)` (no pickled numpy or Python objects) and restores every generator exactly.

    {"format": "epo-rng/2",
     "torch": ByteTensor (CPU generator), "cuda": [ByteTensor per visible GPU] (empty without CUDA),
     "python": {"version": int, "internal": int64[625], "gauss_next": float | None},
     "numpy": {"kind": "MT19937", "keys": int64[624], "pos": int, "has_gauss": int, "cached_gaussian": float}}
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from epo_cli.errors import UserError

RNG_FORMAT = "epo-rng/2"


def capture() -> dict[str, Any]:
    """This process's RNG states (Python, numpy, torch CPU and CUDA) as tensors and plain values."""
    py_version, py_internal, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {
        "format": RNG_FORMAT,
        "torch": torch.get_rng_state(),
        "cuda": list(cuda),
        "python": {"version": int(py_version), "internal": torch.tensor(py_internal, dtype=torch.int64),
                   "gauss_next": py_gauss},
        "numpy": {"kind": str(np_kind), "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
    }


def restore(state: dict[str, Any], source: Path) -> None:
    """Set every generator from `capture()`'s output (read back from `source`)."""
    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise UserError(f"'{source}' is not an RNG state file of this epo version (format {found!r}, "
                        f"expected {RNG_FORMAT!r}).")
    try:
        py, npy = state["python"], state["numpy"]
        random.setstate((py["version"], tuple(int(v) for v in py["internal"].tolist()), py["gauss_next"]))
        np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                             npy["cached_gaussian"]))
        torch.set_rng_state(state["torch"])
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
        raise UserError(f"'{source}' is a damaged RNG state file ({type(err).__name__}: {err}).") from None
    cuda = state.get("cuda") or []
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(f"the checkpoint holds CUDA RNG states of {len(cuda)} GPU(s) and this process sees "
                          f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}: they are not "
                          "restored, so GPU sampling will not repeat the original run exactly.", stacklevel=2)
