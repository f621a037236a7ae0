"""Generation tokens/s: the package's `generate` against the sampling loop it replaced, in one run.

    python scripts/bench/bench_generation.py [--models tiny,small] [--repeats 3] [--turns 15] [--quick]
    python scripts/bench/bench_generation.py --horizon 15,30,60 [--iterations 3]
    python scripts/bench/bench_generation.py --profile [--models tiny]

The prompts are the demo regime's (`experiment=improve_on_teacher`: household level tiny_open_pick_place,
compact template, 4 tasks x group 8 = 32 envs, 15 turns): one rollout of a slipping expert (slip 0.4, the
demo's noisy teacher) is recorded, and every turn's generate call (the live envs' prompts and their sampling
seeds) is replayed by each implementation, interleaved per repeat so drift in the machine's load hits all
alike. max_new_tokens 64, temperature 1.0.

Models: `tiny` (model=tiny, random weights) and `small` (the tiny builder at hidden 256, intermediate 1024,
4 layers, 8 heads: ~4M parameters, ~3M of them in matmuls). Regimes:
- `demo`: stop at "</action>" as in training. A random model never writes it, so every row runs to
  max_new_tokens: the per-token cost with no finished rows.
- `long-tail`: stop at one character chosen so that ~1/16 of the vocabulary's token texts hold it, so rows
  finish after geometric numbers of tokens (mean ~16), the spread of a trained policy's turns: here finished
  rows and cache re-indexes count. The new implementation runs with finished rows leaving the batch at every
  finish (`compact 1.0`, what the old loop did), when fewer than half are live (`compact 0.5`, the default)
  and never (`compact 0`).

Printed per model and regime: generated tokens, tokens/s, ratio against the old loop, cache re-indexes per
call, and the fraction of the machine's limit: model FLOPs per generated token (2 x matmul parameters +
4 x layers x hidden x mean attended length) x tokens/s over the dense matmul FLOP/s measured here (float32,
one thread, 512 x 512). Prefill FLOPs (the prompts) are not counted, though generate's time includes them.
Every variant must produce the same tokens as the others of the new implementation ("same" column; the old
loop draws other random numbers, so its tokens differ).

--profile: cProfile of the new implementation on the demo regime's calls: where the time per generated token
goes (the model's forward and its parts, sampling, stop detection, the rest of the loop).

--horizon: whole GRPO iterations of the demo regime (`experiment=improve_on_teacher env.max_turns=T`, tiny
random model, so nearly every episode runs all T turns), one Trainer per T, iterations interleaved, the first
not counted. Printed per T: iteration wall time per env turn, its parts (rollout, of it generate, scoring,
update) per env turn, and the mean response tokens per turn.
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402  (after the environment above)

from epo_cli.errors import UserError  # noqa: E402

SMALL = ["model.hidden_size=256", "model.intermediate_size=1024", "model.num_hidden_layers=4",
         "model.num_attention_heads=8", "model.num_key_value_heads=4"]


# ---- BASELINE: the sampling loop before issue 32, copied verbatim from epo_cli/rollout/generation.py ---------
# (per token: one torch.multinomial per row with its own torch.Generator, a Python loop over the rows that
# decodes each row's last 8 tokens to look for the stop string, a cache re-index at every finish)


def _cache_kwarg(model):
    """transformers 5.x names the KV cache argument `cache`; 4.x `past_key_values`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _output_cache(out):
    """The KV cache of a forward output (`cache` in transformers 5.x, `past_key_values` in 4.x)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def _refuse_nonfinite(ok):
    """One message instead of torch.multinomial's traceback when the policy's outputs are nan/inf."""
    if not bool(ok.all()):
        raise UserError("The policy's outputs (logits) hold nan or inf, so no token can be sampled: its weights "
                        "are non-finite (e.g. a model exported by a run that diverged). Use an earlier "
                        "checkpoint or another model.")


def _distinct_prompts(prompts):
    """The distinct prompts (first-seen order) and, per row, the index of its prompt among them; None for
    the index when every prompt is distinct (nothing to share)."""
    first = {}
    row_of = [first.setdefault(tuple(p), len(first)) for p in prompts]
    if len(first) == len(prompts):
        return prompts, None
    return [list(p) for p in first], row_of



def old_sample_next(logits, params, generators):
    """One token per row from logits [B, V] (float32) -> [B] long."""
    if params.temperature <= 0:
        _refuse_nonfinite(~torch.isnan(logits))
        return logits.argmax(-1)
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative - sorted_logits.softmax(-1) > params.top_p  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    _refuse_nonfinite(torch.isfinite(probs))  # nan or +inf logits (top-k/top-p's -inf ones give 0)
    if generators is None:
        return torch.multinomial(probs, 1).squeeze(-1)
    return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])


@torch.no_grad()
def old_generate(model, prompts, params, tokenizer, seeds=None, vocab_limit=None, shared_prefill=True,
                 logprobs=None):
    """Sample a response for each prompt; returns the response token ids (stop string / EOS included)."""
    from epo_cli.rollout.generation import left_pad, positions_from_mask
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    eos_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    cache_kw = _cache_kwarg(model)

    distinct, row_of = _distinct_prompts(prompts) if shared_prefill else (prompts, None)
    ids, mask = left_pad(distinct, pad_id, device)  # [U, P]
    position = positions_from_mask(mask)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, logits_to_keep=1)
    cache = _output_cache(out)
    logits = out.logits[:, -1].float()  # [U, V]
    if row_of is not None:  # copy each distinct prompt's cache (and its next-token logits) to its rows
        index = torch.tensor(row_of, device=device)  # [B] -> row in the distinct batch
        cache.batch_select_indices(index)
        mask, position, logits = mask[index], position[index], logits[index]
    next_position = position[:, -1] + 1  # [B]
    generators = None
    if seeds is not None:
        generators = [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]

    responses: list[list[int]] = [[] for _ in prompts]
    rows = list(range(len(prompts)))  # original index of each live batch row
    if logprobs is not None:
        logprobs[:] = [[] for _ in prompts]
    for _ in range(params.max_new_tokens):
        if vocab_limit is not None:
            logits = logits[:, :vocab_limit]
        tokens = old_sample_next(logits, params, generators)
        if logprobs is not None:
            scaled = logits / params.temperature if params.temperature > 0 else logits
            picked = scaled.log_softmax(-1).gather(-1, tokens[:, None])[:, 0].tolist()
            for row, value in zip(rows, picked):
                logprobs[row].append(value)
        keep: list[int] = []
        for b, (row, token) in enumerate(zip(rows, tokens.tolist())):
            responses[row].append(token)
            tail = tokenizer.decode(responses[row][-8:]) if params.stop else ""
            if token not in eos_ids and not (params.stop and params.stop in tail):
                keep.append(b)
        if not keep:
            break
        if len(keep) < len(rows):  # finished rows leave the batch, with their cache rows
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, tokens, next_position = mask[index], tokens[index], next_position[index]
            rows = [rows[b] for b in keep]
            if generators is not None:
                generators = [generators[b] for b in keep]
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                    use_cache=True, **{cache_kw: cache})
        cache = _output_cache(out)
        next_position = next_position + 1
        logits = out.logits[:, -1].float()
    return responses

# ---- END OF BASELINE -----------------------------------------------------------------------------------------


def demo_calls(cfg, suite, tokenizer, turns: int) -> list[tuple[list[list[int]], list[int]]]:
    """Every turn's generate call (prompts, seeds) of one demo-regime rollout played by a slipping expert."""
    from epo_cli.envs.pool import EnvPool
    from epo_cli.rollout.episodes import EpisodeSlot, ExpertPolicy, PlayConfig, run_episodes
    from epo_cli.rollout.prompts import PromptBuilder, chat_encoder

    calls = []

    class Recording(ExpertPolicy):
        def act(self, prompts, infos, seeds):
            calls.append((prompts, seeds))
            return super().act(prompts, infos, seeds)

    algo = cfg.algo
    tasks = suite.sample_tasks(cfg.env.train_split, algo.tasks_per_step, random.Random(0), level=cfg.env.level)
    slots = [EpisodeSlot(task, g * algo.group_size + k, g) for g, task in enumerate(tasks)
             for k in range(algo.group_size)]
    builder = PromptBuilder(cfg.env.prompt_template, cfg.env.history_length, cfg.rollout.max_prompt_tokens,
                            chat_encoder(tokenizer))
    run_episodes(Recording(tokenizer, slip=0.4), EnvPool(suite, num_workers=0), slots,
                 PlayConfig(builder, tokenizer, turns, seed=cfg.seed))
    return calls


def long_tail_stop(tokenizer, share: float = 1 / 16) -> str:
    """The printable character held by the share of token texts closest to `share`."""
    from epo_cli.rollout.generation import token_texts
    texts = token_texts(tokenizer, len(tokenizer))
    chars = sorted({ch for t in texts for ch in t if ch.isascii() and ch.isprintable() and not ch.isspace()})
    return min(chars, key=lambda ch: abs(sum(ch in t for t in texts) / len(texts) - share))


def matmul_flops() -> float:
    """Dense float32 matmul FLOP/s on this process's threads (best of 5 x 20 products of 512 x 512)."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            a @ b
        best = min(best, time.perf_counter() - start)
    return 20 * 2 * 512 ** 3 / best


def flops_per_token(model, attended: float) -> float:
    """Forward FLOPs of one generated token: 2 per matmul weight (every Linear, lm_head included) and 4 x
    layers x (query heads x head dim) per attended position (QK^T and attention x V)."""
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * weights + 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * attended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 4 turns (a smoke run)")
    parser.add_argument("--profile", action="store_true", help="profile the new implementation instead")
    parser.add_argument("--horizon", help="comma-separated env.max_turns values: time whole iterations instead")
    parser.add_argument("--iterations", type=int, default=3, help="--horizon: iterations per run (+1 warm-up)")
    args = parser.parse_args()
    if args.horizon:
        horizon([int(t) for t in args.horizon.split(",")], args.iterations)
        return
    if args.quick:
        args.repeats, args.turns = 1, 4
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.models.tiny import build_tiny
    from epo_cli.rollout.generation import SamplingConfig, generate

    peak = matmul_flops()
    print(f"dense matmul: {peak / 1e9:.2f} GFLOP/s on {torch.get_num_threads()} thread(s)")
    rows = []
    for name in args.models.split(","):
        cfg = compose(["experiment=improve_on_teacher", *(SMALL if name == "small" else [])])
        suite = make_suite(cfg.env)
        folder = build_tiny(cfg.model, suite)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        params_m = sum(p.numel() for p in model.parameters()) / 1e6
        calls = demo_calls(cfg, suite, tokenizer, args.turns)
        if args.profile:
            profile(name, model, tokenizer, calls, SamplingConfig(cfg.rollout.max_new_tokens, 1.0, 1.0, 0,
                                                                  cfg.rollout.stop))
            continue
        prompt_tokens = statistics.mean(len(p) for prompts, _ in calls for p in prompts)
        limit = len(tokenizer)
        for regime, stop in (("demo", cfg.rollout.stop), ("long-tail", long_tail_stop(tokenizer))):
            params = SamplingConfig(cfg.rollout.max_new_tokens, 1.0, 1.0, 0, stop)
            variants = {"old loop (baseline)": None, "new, compact 0.5": 0.5}
            if regime == "long-tail":
                variants = {"old loop (baseline)": None, "new, compact 1.0": 1.0, "new, compact 0.5": 0.5,
                            "new, compact 0": 0.0}
            seconds = {v: [] for v in variants}
            tokens, reindexes, outputs = {}, {}, {}
            for repeat in range(args.repeats):
                for variant in list(variants) if repeat % 2 == 0 else list(variants)[::-1]:
                    compact = variants[variant]
                    stats = {"reindexes": 0}
                    counting = _count_reindexes(stats)
                    start = time.perf_counter()
                    out = []
                    with counting:
                        for prompts, seeds in calls:
                            if compact is None:
                                out.append(old_generate(model, prompts, params, tokenizer, seeds, limit))
                            else:
                                out.append(generate(model, prompts, params, tokenizer, seeds, limit,
                                                    compact_below=compact))
                    seconds[variant].append(time.perf_counter() - start)
                    tokens[variant] = sum(len(r) for o in out for r in o)
                    reindexes[variant] = stats["reindexes"] / len(calls)
                    outputs[variant] = out
            new_outputs = [o for v, o in outputs.items() if variants[v] is not None]
            same = all(o == new_outputs[0] for o in new_outputs)
            base = tokens["old loop (baseline)"] / statistics.median(seconds["old loop (baseline)"])
            for variant in variants:
                rate = tokens[variant] / statistics.median(seconds[variant])
                mean_len = tokens[variant] / sum(len(p) for p, _ in calls)
                attended = prompt_tokens + mean_len / 2
                fraction = flops_per_token(model, attended) * rate / peak
                rows.append((f"{name} ({params_m:.1f}M)", f"{regime} (stop {stop!r})", variant, tokens[variant],
                             mean_len, rate, rate / base, reindexes[variant], fraction,
                             "-" if variants[variant] is None else ("yes" if same else "NO")))
                print(" | ".join(str(x) for x in rows[-1]), flush=True)
    print()
    print("| model | regime | implementation | tokens | mean response | tokens/s | vs old | re-indexes/call "
          "| of matmul limit | same |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for model_name, regime, variant, n, mean_len, rate, ratio, reidx, fraction, same in rows:
        print(f"| {model_name} | {regime} | {variant} | {n} | {mean_len:.1f} | {rate:.0f} | {ratio:.2f}x | "
              f"{reidx:.1f} | {fraction:.3f} | {same} |")


def profile(name: str, model, tokenizer, calls, params) -> None:
    """Where the new implementation's time goes on `calls` (cProfile; shares of the whole)."""
    import cProfile
    import pstats

    from epo_cli.rollout.generation import generate

    for prompts, seeds in calls[:2]:  # warm up (the stop matcher is built once)
        generate(model, prompts, params, tokenizer, seeds, len(tokenizer))
    profiler = cProfile.Profile()
    tokens = 0
    profiler.enable()
    for prompts, seeds in calls:
        tokens += sum(len(r) for r in generate(model, prompts, params, tokenizer, seeds, len(tokenizer)))
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = max(stats.total_tt, 1e-9)

    def cumulative(file_part: str, function: str) -> tuple[float, int]:
        hits = [(v[3], v[1]) for (file, _, func), v in stats.stats.items() if file_part in file and func == function]
        return (max(hits)[0], max(hits)[1]) if hits else (0.0, 0)

    def own(function: str) -> float:
        return sum(v[2] for (_, _, func), v in stats.stats.items() if func == function)

    print(f"\n{name}: {tokens} tokens in {total:.2f} s under cProfile ({1e3 * total / tokens:.3f} ms per token)")
    parts = {
        "model forward, all of it (prefill + decode steps)": cumulative("torch/nn/modules/module.py", "_call_impl"),
        "  attention kernel (sdpa)": (own("<built-in method torch._C._nn.scaled_dot_product_attention>"), 0),
        "  matmuls (linear)": (own("<built-in method torch._C._nn.linear>"), 0),
        "  attention mask building (create_causal_mask)": cumulative("masking_utils.py", "create_causal_mask"),
        "  KV cache writes (update)": cumulative("rollout/generation.py", "update"),
        "sampling (sample_next)": cumulative("rollout/generation.py", "sample_next"),
        "noise (counter_uniforms)": cumulative("rollout/generation.py", "counter_uniforms"),
        "stop confirmations (tokenizer.decode)": cumulative("tokenization_utils", "decode"),
    }
    for label, (seconds, calls_made) in parts.items():
        print(f"  {label:<55} {seconds:7.2f} s  {100 * seconds / total:5.1f}%"
              + (f"  ({calls_made} calls)" if calls_made else ""))
    stats.sort_stats("tottime").print_stats(12)


def horizon(turn_limits: list[int], iterations: int) -> None:
    """Iteration time per env turn at each turn limit (module docstring): one Trainer per limit in this
    process, their iterations interleaved (common.interleaved_iterations) so drift in the machine's load hits
    all alike; the first iteration warms up and is not counted."""
    from common import interleaved_iterations, scratch_dir

    from epo_cli.compose import compose
    from epo_cli.training.trainer import Trainer

    trainers = {}
    for turns in turn_limits:
        cfg = compose(["experiment=improve_on_teacher", f"env.max_turns={turns}",
                       f"trainer.total_steps={iterations + 1}", "logger.console=false", "logger.tensorboard=false"])
        run = scratch_dir(f"bench_horizon_{turns}_")
        cfg.run_dir = str(run)
        trainers[turns] = Trainer(cfg, run)
    parts = ("rollout_s", "generate_s", "score_s", "update_s")
    per_turn: dict[int, dict[str, list[float]]] = {t: {k: [] for k in (*parts, "iteration_s", "tokens")}
                                                   for t in turn_limits}

    def show(it: int, turns: int, metrics: dict[str, float]) -> None:
        episodes = trainers[turns].cfg.algo.tasks_per_step * trainers[turns].cfg.algo.group_size
        env_turns = metrics["rollout/episode_len"] * episodes
        tokens = metrics["perf/gen_tokens_per_s"] * metrics["perf/generate_s"]
        print(f"  iteration {it}, max_turns {turns}: {metrics['iteration_s']:.2f} s, {env_turns:.0f} env turns, "
              + ", ".join(f"{k} {metrics[f'perf/{k}']:.2f}" for k in parts), flush=True)
        if it == 0:
            return
        for k in parts:
            per_turn[turns][k].append(metrics[f"perf/{k}"] / env_turns)
        per_turn[turns]["iteration_s"].append(metrics["iteration_s"] / env_turns)
        per_turn[turns]["tokens"].append(tokens / env_turns)

    try:
        interleaved_iterations(trainers, iterations + 1, [], show)
    finally:
        for trainer in trainers.values():
            trainer.pool.close()
    mean = {t: {k: statistics.mean(v) for k, v in d.items()} for t, d in per_turn.items()}
    base = mean[turn_limits[0]]["iteration_s"]
    print()
    print("| env.max_turns | iteration ms / env turn | vs first | rollout | (generate) | scoring | update "
          "| response tokens / turn |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for turns in turn_limits:
        m = mean[turns]
        print(f"| {turns} | {1e3 * m['iteration_s']:.1f} | {m['iteration_s'] / base:.2f}x | "
              f"{1e3 * m['rollout_s']:.1f} | {1e3 * m['generate_s']:.1f} | {1e3 * m['score_s']:.1f} | "
              f"{1e3 * m['update_s']:.1f} | {m['tokens']:.1f} |")


class _count_reindexes:
    """Counts the cache re-indexes that drop finished rows (Cache.batch_select_indices calls to fewer rows;
    the shared prefill's copy goes to more rows), of either implementation."""

    def __init__(self, stats: dict) -> None:
        self.stats = stats

    def __enter__(self):
        from transformers.cache_utils import Cache
        self.original = Cache.batch_select_indices
        stats = self.stats

        def counted(cache, indices):
            if len(indices) < cache.layers[0].keys.shape[0]:  # fewer rows: finished ones leave (not a prefill copy)
                stats["reindexes"] += 1
            return self.original(cache, indices)

        Cache.batch_select_indices = counted
        return self

    def __exit__(self, *exc) -> None:
        from transformers.cache_utils import Cache
        Cache.batch_select_indices = self.original


if __name__ == "__main__":
    main()
