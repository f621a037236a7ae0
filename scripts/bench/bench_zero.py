"""ZeRO stages on 2 ranks: per-rank memory of parameters + gradients + optimizer state, and step time.

    OMP_NUM_THREADS=1 python scripts/bench/bench_zero.py                  # tiny Qwen2 (~1.9M params), CPU ranks
    python scripts/bench/bench_zero.py --hidden 256 --layers 4 --steps 5 --ranks 2

For ZeRO-0..3 the engine is built exactly as training builds it (epo_cli.training.engine.build_engine
with the config of `deepspeed=zeroN`), then trained on random tokens: one global mini-batch of
--mini-batch sequences per step, split over the ranks in micro-batches of --micro-batch.

Memory is counted, not sampled from RSS: after the backward pass of a step (the peak: gradients and
optimizer state both alive), every tensor reachable from the engine's module and from its optimizer
(DeepSpeed's ZeRO wrapper: flat partitions, fp32 master copies, gradient buckets, Adam moments) is
collected, de-duplicated by storage, and summed. It is reported per rank in three groups:
    params   the module's parameters as this rank holds them (ZeRO-3: its partition)
    optim    the torch optimizer's state (Adam moments) of this rank's partition
    other    what DeepSpeed adds: gradients (full, or this rank's partition), fp32 master partitions and
             reduction buckets
The ratio is the total against ZeRO-0 on the same number of ranks. Step time is the median over
--steps steps (after one warm-up step); "2 vs 1" is the time of a global step on 2 ranks over that on 1
rank (same global batch). On a 2-vCPU machine that behaves like ~1.5 cores, the ceiling is ~0.7.
Not included: the frozen reference model and, under ZeRO-3, the trainer's inference copy for generation
(one full copy of the weights per rank; see docs/distributed.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

STAGES = (0, 1, 2, 3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--mini-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)  # child: where to write results
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- counting tensors ----------------------------------------------------------------------------------

def _storage_key(t: Any) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def reachable_tensors(root: Any, max_depth: int = 6) -> list[Any]:
    """Every tensor reachable from `root` through attributes, lists, tuples and dicts (bounded depth)."""
    import torch

    found: list[Any] = []
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > max_depth:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            for attr in ("grad", "ds_tensor"):
                child = getattr(obj, attr, None) if attr != "grad" or obj.is_leaf else None
                if isinstance(child, torch.Tensor):
                    walk(child, depth + 1)
            return
        if isinstance(obj, torch.nn.Module):
            for t in list(obj.parameters()) + list(obj.buffers()):
                walk(t, depth + 1)
            return
        if isinstance(obj, dict):
            for v in list(obj.values()):
                walk(v, depth + 1)
            return
        if isinstance(obj, list | tuple | set):
            for v in list(obj):
                walk(v, depth + 1)
            return
        if isinstance(obj, str | int | float | bool | type(None)):
            return
        # objects of these packages hold DeepSpeed's buffers (bucket, partition and optimizer classes)
        if hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("deepspeed", "torch"):
            if isinstance(obj, torch.distributed.ProcessGroup):
                return
            for v in list(vars(obj).values()):
                walk(v, depth + 1)

    walk(root, 0)
    return found


def count_memory(engine: Any) -> dict[str, float]:
    """Bytes held by this rank: module parameters, Adam state, and everything else DeepSpeed keeps."""

    def total(tensors: list[Any], exclude: set[tuple[int, int]]) -> tuple[int, set[tuple[int, int]]]:
        keys: set[tuple[int, int]] = set()
        size = 0
        for t in tensors:
            if t.device.type == "meta":
                continue
            key = _storage_key(t)
            if key[1] == 0 or key in exclude or key in keys:
                continue
            keys.add(key)
            size += key[1]
        return size, keys

    params = []
    for p in engine.module.parameters():
        params.append(p.ds_tensor if hasattr(p, "ds_tensor") else p)  # ZeRO-3: this rank's partition
        if hasattr(p, "ds_tensor"):
            params.append(p)  # released (0 bytes) outside a forward
    p_bytes, seen = total(params, set())
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    state = [t for s in inner.state.values() for t in s.values() if hasattr(t, "untyped_storage")]
    o_bytes, o_keys = total(state, seen)
    seen |= o_keys
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    rest = reachable_tensors(engine.optimizer) + grads
    r_bytes, _ = total(rest, seen)
    return {"params": p_bytes, "optim": o_bytes, "other": r_bytes, "total": p_bytes + o_bytes + r_bytes}


# ---- one rank ----------------------------------------------------------------------------------------

def child(args: argparse.Namespace) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from epo_cli.compose import compose
    from epo_cli.training.engine import build_engine, init_distributed
    from epo_cli.training.settings import engine_settings

    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for stage in [int(s) for s in args.stages.split(",")]:
        cfg = compose([f"deepspeed=zero{stage}", "algo=grpo", f"algo.mini_batch_size={args.mini_batch}",
                       f"algo.micro_batch_size={args.micro_batch}", "trainer.device=cpu"])
        dist = init_distributed(cfg.trainer.device, cfg.launcher.timeout_s)
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=args.seq * 2, tie_word_embeddings=True))
        n_params = sum(p.numel() for p in model.parameters())
        engine = build_engine(model, engine_settings(cfg, dist), lr=1e-4)
        gen = torch.Generator().manual_seed(1)
        per_rank = args.mini_batch // dist.world_size
        data = torch.randint(0, args.vocab, (args.mini_batch, args.seq), generator=gen)
        mine = data[dist.rank * per_rank:(dist.rank + 1) * per_rank]
        times: list[float] = []
        memory: dict[str, float] = {}
        for step in range(args.steps + 1):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            for i in range(0, per_rank, args.micro_batch):
                ids = mine[i:i + args.micro_batch]
                loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
                engine.backward(loss / (per_rank // args.micro_batch), scale_wrt_gas=False)
            if step == 1:  # gradients and (after the warm-up step) optimizer state are both alive
                memory = count_memory(engine)
            engine.step()
            torch.distributed.barrier()
            if step > 0:
                times.append(time.perf_counter() - t0)
        results[str(stage)] = {"memory": memory, "step_s": sorted(times)[len(times) // 2],
                               "params": n_params, "world": dist.world_size}
        del engine, model
    if dist.rank == 0:
        Path(args.out).write_text(json.dumps(results))
    torch.distributed.barrier()


def run_world(args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    from epo_cli.launch.deepspeed import run_cpu_world

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        script = [str(Path(__file__).resolve()), "--child", "--out", str(out)]
        for key in ("hidden", "layers", "vocab", "seq", "mini_batch", "micro_batch", "steps", "stages"):
            script += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        run_cpu_world(script, ranks, env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    if args.mini_batch % (args.micro_batch * args.ranks):
        sys.exit("--mini-batch must be divisible by --micro-batch x --ranks")
    one = run_world(args, 1)
    many = run_world(args, args.ranks)
    mib = 1024 * 1024
    first = next(iter(many.values()))
    print(f"model: {first['params'] / 1e6:.2f}M params (fp32), global batch {args.mini_batch} x {args.seq} "
          f"tokens, micro-batch {args.micro_batch}, {args.ranks} ranks vs 1, {args.steps} timed steps")
    print(f"{'stage':<7}{'params MiB':>11}{'optim MiB':>11}{'other MiB':>11}{'total MiB':>11}"
          f"{'vs ZeRO-0':>11}{'step 1r s':>11}{f'step {args.ranks}r s':>11}{f'{args.ranks}r/1r':>8}")
    base = many.get("0", {}).get("memory", {}).get("total")
    for stage, r in many.items():
        m = r["memory"]
        t1 = one[stage]["step_s"]
        ratio = f"{m['total'] / base:.3f}" if base else "-"
        print(f"zero{stage:<3}{m['params'] / mib:>11.2f}{m['optim'] / mib:>11.2f}{m['other'] / mib:>11.2f}"
              f"{m['total'] / mib:>11.2f}{ratio:>11}{t1:>11.3f}{r['step_s']:>11.3f}{r['step_s'] / t1:>8.2f}")


if __name__ == "__main__":
    main()
