"""Batched sampling with a KV cache: one call generates a turn's response for every active env.

Why not `model.generate`: every row samples with its own seeded noise, so a trajectory's tokens do not
depend on which other envs share its batch or rank. A run then gives the same rollouts on 1 or N ranks and
after a resume. Each step does the same few tensor operations whatever the batch size; no Python loop over
rows runs per token:

- Sampling (`sample_next`) is inverse-CDF sampling with counter-based noise: row i's t-th token uses the
  uniform `counter_uniforms(seed_i, t)`, a hash of (seed, token position) computed for all rows at once in
  int64 arithmetic. A row's draws are a function of its own seed alone.
- Stop detection (`StopMatcher`) runs the stop string's matching automaton on token ids: a table, built
  once per tokenizer, says for every (automaton state, token id) the next state and whether the token
  completes the stop string. The rare rows it flags are confirmed with the decode-based check
  (`stop in tokenizer.decode(response[-8:])`), so the stops are exactly the decode-based check's.
- Finished rows may stay in the batch (their samples are ignored) until the live share drops below
  `compact_below`; only then do they leave it with their KV cache rows. Dropping rows re-indexes every
  layer's cache; keeping one costs a row of every later forward. The default (1.0) drops them at once,
  which measured fastest on CPU.
- The KV cache is written in place (`_ReservedLayer`): room for the whole response is reserved after the
  prefill, where transformers' DynamicLayer concatenates, copying the layer's cache at every token.

Shared prefill: rows with identical prompts (a GRPO group's turn 0: same task, same first observation)
run the prompt through the model once; its KV cache rows are then copied to every row that shares it
(`Cache.batch_select_indices` with repeated indices). Rows are independent in a batch, so this gives the
same tokens as prefilling every row, for less compute.
"""

from __future__ import annotations

import inspect
import random
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from epo_cli.errors import UserError


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    stop: str = "</action>"


#: the decode-based stop check looks at this many last tokens (`stop in tokenizer.decode(response[-8:])`)
STOP_WINDOW = 8
#: finished rows leave the batch (one cache re-index) once fewer than this share of its rows are live. 1.0:
#: at every finish. Measured on CPU (docs/performance.md), keeping finished rows until half are dead cost more
#: than the re-indexes it saved (a kept row costs a full row of compute there); a lower value may pay where a
#: decode step's cost hardly depends on its rows (a GPU), not measured yet
COMPACT_BELOW = 1.0


def _cache_kwarg(model: nn.Module) -> str:
    """transformers 5.x names the KV cache argument `cache`; 4.x `past_key_values`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def _output_cache(out) -> object:
    """The KV cache of a forward output (`cache` in transformers 5.x, `past_key_values` in 4.x)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def _takes_boolean_4d_mask(model: nn.Module) -> bool:
    """Can decode steps hand the model a ready [B, 1, 1, L] boolean mask (True = attend)? transformers passes
    a 4-D mask through as is, which skips building one per step; `sdpa` reads booleans that way. Not for
    other attention kernels (eager adds the mask, flash attention wants 2-D) or sliding-window layers."""
    config = getattr(model, "config", None)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return (getattr(config, "_attn_implementation", None) == "sdpa"
            and all(kind == "full_attention" for kind in layer_types))


def left_pad(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, P] token ids left-padded with pad_id, and the attention mask (1 on real tokens)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq):] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only, so left padding does not shift positions."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _refuse_nonfinite(ok: torch.Tensor) -> None:
    """One message instead of a wrong sample when the policy's outputs are nan/inf."""
    if not bool(ok.all()):
        raise UserError("The policy's outputs (logits) hold nan or inf, so no token can be sampled: its weights "
                        "are non-finite (e.g. a model exported by a run that diverged). Use an earlier "
                        "checkpoint or another model.")


# ---- counter-based noise: a uniform per (seed, token position) --------------------------------------------

_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (xorshift-multiply rounds) of values in [0, 2**32): int64 tensors or Python ints.

    The multipliers are odd and below 2**31, so every product stays below 2**63: no int64 overflow."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)


def seed_keys(seeds: list[int], device: torch.device) -> torch.Tensor:
    """[B] int64 hash keys of the rows' seeds (any int; its low 64 bits count)."""
    keys = [_mix32(_mix32((s & _MASK32) ^ 0x3C6EF372) ^ ((s >> 32) & _MASK32)) for s in seeds]
    return torch.tensor(keys, dtype=torch.long, device=device)


def counter_uniforms(keys: torch.Tensor, position: int) -> torch.Tensor:
    """[B] float64 uniforms in (0, 1), one per row: a function of (the row's seed key, `position`) only.

    Two 32-bit hashes of (key, counter) give 53 bits, so the smallest probability that can be drawn is ~1e-16."""
    counters = torch.tensor([_mix32((2 * position) & _MASK32), _mix32((2 * position + 1) & _MASK32)],
                            dtype=torch.long, device=keys.device)
    bits = _mix32(keys[:, None] ^ counters)  # [B, 2]
    return ((bits[:, 0] << 21) + (bits[:, 1] >> 11)).double().add_(0.5).mul_(2.0 ** -53)


# ---- sampling ----------------------------------------------------------------------------------------------


def sample_next(logits: torch.Tensor, params: SamplingConfig, uniforms: torch.Tensor | None,
                check: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row from logits [B, V] (float32) -> [B] long.

    uniforms: [B] float64 in (0, 1), the rows' noise for this token (None: drawn from torch's global RNG).
    Row i takes the first token whose cumulative probability exceeds uniforms[i] x the total (inverse CDF),
    after temperature, top-k (keep the logits >= the k-th largest) and top-p (the smallest most-likely set
    whose mass reaches p). check: [B] bool, the rows whose logits must be finite (default all)."""
    if params.temperature <= 0:
        ok = ~torch.isnan(logits.amax(-1))  # max propagates nan
        _refuse_nonfinite(ok if check is None else ok | ~check)
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
    # unnormalised probabilities in float64 (dividing by their sum would not change the draw)
    logits = logits.double()
    weights = (logits - logits.amax(-1, keepdim=True)).exp()
    cumulative = weights.cumsum(-1)
    total = cumulative[:, -1]
    finite = torch.isfinite(total)  # nan or +inf logits make the total nan (top-k/top-p's -inf ones weigh 0)
    _refuse_nonfinite(finite if check is None else finite | ~check)
    if uniforms is None:
        uniforms = torch.rand(weights.shape[0], dtype=torch.float64, device=weights.device)
    # strictly below the total, so the first cumulative weight above it belongs to a token of weight > 0
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target[:, None], right=True)[:, 0].clamp(max=weights.shape[-1] - 1)


# ---- stop detection on token ids ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StopMatcher:
    """The stop string's matching automaton on token ids.

    State q = how many characters of the stop string the text so far ends with (its longest such prefix,
    0..len(stop)). Feeding token t from state q: `next_state[q, t]` and `completes[q, t]` (the stop string
    ends inside t's text). Every decode-based stop is flagged (a superset: the stop string inside the last
    8 tokens' text means an occurrence that ends in the newest token); the flagged rows are confirmed by
    the decode-based check itself, which also rejects occurrences spread over more than 8 tokens."""

    next_state: torch.Tensor  # [len(stop) + 1, V] long
    completes: torch.Tensor  # [len(stop) + 1, V] bool


_STOP_MATCHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: decoding removes the space before these characters when the tokenizer cleans up tokenization spaces
#: (" ." -> ".", " n't" -> "n't", ...): a stop string holding one could appear there without its tokens
_CLEANUP_JOINS = frozenset(" .?!,'n")


def stop_matcher(tokenizer, stop: str, vocab_size: int, device: torch.device) -> StopMatcher | None:
    """The matcher of `stop` for token ids < vocab_size, built once per (tokenizer, stop, size, device).

    None where token texts cannot be matched one by one (a non-ASCII stop string, a tokenizer whose decode is
    not its tokens' texts laid end to end): `generate` then runs the decode-based check on every row."""
    try:
        per_tokenizer = _STOP_MATCHERS.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: build every time
        per_tokenizer = {}
    key = (stop, vocab_size, str(device))
    if key not in per_tokenizer:
        per_tokenizer[key] = _build_stop_matcher(tokenizer, stop, vocab_size, device)
    return per_tokenizer[key]


def token_texts(tokenizer, vocab_size: int) -> list[str] | None:
    """Each token id's text as it appears inside a decoded sequence (after an anchor token, so that decoders
    that drop a leading space at the start keep it); "" beyond the tokenizer. None if no anchor works."""
    known = min(vocab_size, len(tokenizer))
    for char in "Z#|q":
        anchor = tokenizer.encode(char, add_special_tokens=False)
        if len(anchor) != 1:
            continue
        prefix = tokenizer.decode(anchor)
        texts = tokenizer.batch_decode([[anchor[0], i] for i in range(known)])
        if all(t.startswith(prefix) for t in texts):
            return [t[len(prefix):] for t in texts] + [""] * (vocab_size - known)
    return None


def _build_stop_matcher(tokenizer, stop: str, vocab_size: int, device: torch.device) -> StopMatcher | None:
    if not stop.isascii():
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) and set(stop) & _CLEANUP_JOINS:
        return None
    texts = token_texts(tokenizer, vocab_size)
    if texts is None or not _texts_lay_end_to_end(tokenizer, texts, set(stop)):
        return None
    # the automaton on characters (Knuth-Morris-Pratt): class c < len(alphabet) is alphabet[c], the last
    # class every character the stop string does not hold
    alphabet = sorted(set(stop))
    cls = {ch: i for i, ch in enumerate(alphabet)}
    m, other = len(stop), len(alphabet)
    border = [0] * (m + 1)  # border[q]: longest proper prefix of stop[:q] that is also its suffix
    for q in range(2, m + 1):
        k = border[q - 1]
        while k and stop[k] != stop[q - 1]:
            k = border[k]
        border[q] = k + 1 if stop[k] == stop[q - 1] else 0
    char_step = [[0] * (other + 1) for _ in range(m + 1)]
    for q in range(m + 1):
        for ch, c in cls.items():
            if q < m and stop[q] == ch:
                char_step[q][c] = q + 1
            else:
                char_step[q][c] = char_step[border[q]][c] if q else 0
    # run every token's characters from every state at once: [V, longest text] character classes
    width = max((len(t) for t in texts), default=0)
    classes = torch.full((vocab_size, max(width, 1)), -1, dtype=torch.long)
    for token, text in enumerate(texts):
        if text:
            classes[token, :len(text)] = torch.tensor([cls.get(ch, other) for ch in text])
    step_table = torch.tensor(char_step, dtype=torch.long)
    next_state = torch.empty((m + 1, vocab_size), dtype=torch.long)
    completes = torch.zeros((m + 1, vocab_size), dtype=torch.bool)
    for q in range(m + 1):
        state = torch.full((vocab_size,), q, dtype=torch.long)
        for j in range(width):
            c = classes[:, j]
            real = c >= 0  # past a token's text: padding, no character
            state = torch.where(real, step_table[state, c.clamp(min=0)], state)
            completes[q] |= real & (state == m)
        next_state[q] = state
    return StopMatcher(next_state.to(device), completes.to(device))


def _texts_lay_end_to_end(tokenizer, texts: list[str], stop_chars: set[str], samples: int = 64) -> bool:
    """Does decoding random token sequences give their token texts laid end to end (as far as the stop
    string's characters go; runs of other characters count as one separator)? A guard for tokenizers whose
    decode inserts or merges text between tokens."""
    def squeeze(text: str) -> str:
        out: list[str] = []
        for ch in text:
            if ch in stop_chars:
                out.append(ch)
            elif not out or out[-1] != "\0":
                out.append("\0")
        return "".join(out)

    rng = random.Random(0)
    known = len(tokenizer)
    for _ in range(samples):
        ids = [rng.randrange(min(known, len(texts))) for _ in range(STOP_WINDOW)]
        if squeeze(tokenizer.decode(ids)) not in squeeze("".join(texts[i] for i in ids)):
            return False
    return True


# ---- a KV cache that does not copy itself at every step ----------------------------------------------------


class _ReservedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with room for the whole response: a step
    writes its key and value in place, where DynamicLayer concatenates (a copy of the layer's whole cache per
    token, its cost growing with the context). Attention reads the same numbers either way."""

    def reserve(self, capacity: int) -> None:
        length = self.keys.shape[-2]
        self.key_buffer = self.keys.new_empty((*self.keys.shape[:-2], capacity, self.keys.shape[-1]))
        self.value_buffer = self.values.new_empty((*self.values.shape[:-2], capacity, self.values.shape[-1]))
        self.key_buffer[..., :length, :] = self.keys
        self.value_buffer[..., :length, :] = self.values
        self.keys, self.values = self.key_buffer[..., :length, :], self.value_buffer[..., :length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        length, new = self.keys.shape[-2], key_states.shape[-2]
        # batch_select_indices (rows leaving the batch) replaced the views with new tensors: new buffers
        if self.keys.data_ptr() != self.key_buffer.data_ptr() or length + new > self.key_buffer.shape[-2]:
            self.reserve(max(self.key_buffer.shape[-2], length + new))
        self.key_buffer[..., length:length + new, :] = key_states
        self.value_buffer[..., length:length + new, :] = value_states
        self.keys = self.key_buffer[..., :length + new, :]
        self.values = self.value_buffer[..., :length + new, :]
        return self.keys, self.values


def _reserve_cache(cache, capacity: int) -> None:
    """Give each growing layer of the cache room for `capacity` positions (`_ReservedLayer`). Other layer
    kinds (sliding windows) keep growing by concatenation."""
    for layer in getattr(cache, "layers", []):
        if type(layer) is DynamicLayer and layer.is_initialized:
            layer.__class__ = _ReservedLayer
            layer.reserve(capacity)


# ---- generation ------------------------------------------------------------------------------------------


class _Batch:
    """The rows still in the decode batch: their KV cache, attention mask, next positions and which original
    row each is (`rows`). `prefill` builds it; `drop_finished` and `advance` change it."""

    def __init__(self, cache, mask: torch.Tensor, next_position: torch.Tensor, rows: torch.Tensor,
                 prompt_width: int, cache_kw: str) -> None:
        self.cache, self.mask, self.next_position, self.rows = cache, mask, next_position, rows
        self.prompt_width, self.cache_kw = prompt_width, cache_kw

    @classmethod
    def prefill(cls, model: nn.Module, prompts: list[list[int]], pad_id: int, shared_prefill: bool,
                max_new_tokens: int) -> tuple[_Batch, torch.Tensor]:
        """Run the prompts through the model (each distinct prompt once with shared_prefill: its cache rows
        are then copied to every row that has it); the batch and the rows' next-token logits [B, V] float32."""
        device = next(model.parameters()).device
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
        num_rows, prompt_width = len(prompts), mask.shape[1]
        # the attention mask of every step, allocated once: step t attends to prompt_width + t + 1 columns
        mask = torch.cat([mask, mask.new_ones((num_rows, max_new_tokens))], dim=1)
        if _takes_boolean_4d_mask(model):
            mask = mask.bool()[:, None, None, :]  # [B, 1, 1, width]
        _reserve_cache(cache, prompt_width + max_new_tokens)
        rows = torch.arange(num_rows, device=device)
        return cls(cache, mask, position[:, -1] + 1, rows, prompt_width, _cache_kwarg(model)), logits

    def drop(self, keep: torch.Tensor) -> None:
        """Keep only batch rows `keep` (indices), with their cache rows."""
        self.cache.batch_select_indices(keep)
        self.mask, self.next_position, self.rows = self.mask[keep], self.next_position[keep], self.rows[keep]

    def advance(self, model: nn.Module, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed each row's step-`step` token; the next-token logits [B, V] float32."""
        out = model(input_ids=tokens[:, None], attention_mask=self.mask[..., :self.prompt_width + step + 1],
                    position_ids=self.next_position[:, None], use_cache=True, **{self.cache_kw: self.cache})
        self.cache = _output_cache(out)
        self.next_position = self.next_position + 1
        return out.logits[:, -1].float()


class _StopCheck:
    """Which rows a step's tokens finish: EOS (or pad), or the stop string (the matcher flags candidates, the
    decode-based check on the last STOP_WINDOW tokens confirms them; module docstring)."""

    def __init__(self, tokenizer, stop: str, vocab: int, num_rows: int, device: torch.device) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.is_eos = torch.zeros(vocab, dtype=torch.bool, device=device)
        for token in {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}:
            if token < vocab:
                self.is_eos[token] = True
        self.matcher = stop_matcher(tokenizer, stop, vocab, device) if stop else None
        self.state = torch.zeros(num_rows, dtype=torch.long, device=device)  # per batch row

    def finished(self, tokens: torch.Tensor, live: torch.Tensor, generated: torch.Tensor, rows: torch.Tensor,
                 step: int) -> list[int]:
        """The live batch rows that `tokens` (this step's, [B]) finish; advances the stop automaton."""
        flagged = self.is_eos[tokens]  # EOS ends a row; a flagged stop is confirmed below
        if self.matcher is not None:
            flagged = flagged | self.matcher.completes[self.state, tokens]
            self.state = self.matcher.next_state[self.state, tokens]
        elif self.stop:  # no matcher for this tokenizer: the decode-based check on every row
            flagged = torch.ones_like(flagged)
        done = []
        for b in (flagged & live).nonzero()[:, 0].tolist():
            window = generated[int(rows[b]), max(0, step + 1 - STOP_WINDOW):step + 1].tolist()
            if bool(self.is_eos[int(tokens[b])]) or self.stop in self.tokenizer.decode(window):
                done.append(b)
        return done

    def keep(self, index: torch.Tensor) -> None:
        self.state = self.state[index]


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: list[list[int]],
    params: SamplingConfig,
    tokenizer,
    seeds: list[int] | None = None,
    vocab_limit: int | None = None,
    shared_prefill: bool = True,
    logprobs: list[list[float]] | None = None,
    compact_below: float = COMPACT_BELOW,
) -> list[list[int]]:
    """Sample a response for each prompt; returns the response token ids (stop string / EOS included).

    seeds: one per prompt; row i's t-th token uses the uniform counter_uniforms(key(seeds[i]), t)
    (None: torch's global RNG).
    vocab_limit: sample only among the first `vocab_limit` ids (embedding rows the tokenizer never
    produces); the scoring forward applies the same limit.
    shared_prefill: prefill each distinct prompt once (module docstring).
    logprobs: if given (an empty list), filled with each response token's log-probability under the
    sampling temperature (before top-k/top-p), row by row: the engine's side of the mismatch metrics.
    compact_below: finished rows leave the batch once the live share of its rows is below this (1.0: at
    every finish; 0: never). It changes no token, only the work.
    """
    device = next(model.parameters()).device
    batch, logits = _Batch.prefill(model, prompts, tokenizer.pad_token_id, shared_prefill, params.max_new_tokens)
    num_rows, vocab = len(prompts), logits.shape[-1]
    keys = seed_keys(seeds, device) if seeds is not None else None
    stops = _StopCheck(tokenizer, params.stop, vocab, num_rows, device)

    generated = torch.zeros((num_rows, params.max_new_tokens), dtype=torch.long, device=device)
    token_logprobs = torch.zeros((num_rows, params.max_new_tokens), device=device) if logprobs is not None else None
    lengths = [params.max_new_tokens] * num_rows  # until a row finishes
    live = torch.ones(num_rows, dtype=torch.bool, device=device)  # batch rows still generating
    live_count = num_rows
    for step in range(params.max_new_tokens):
        if vocab_limit is not None:
            logits = logits[:, :vocab_limit]
        uniforms = counter_uniforms(keys, step) if keys is not None else None
        tokens = sample_next(logits, params, uniforms, check=live)  # finished rows' samples are ignored
        rows = batch.rows
        generated[rows, step] = tokens
        if token_logprobs is not None:
            scaled = logits / params.temperature if params.temperature > 0 else logits
            token_logprobs[rows, step] = scaled.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        for b in stops.finished(tokens, live, generated, rows, step):
            live[b] = False
            live_count -= 1
            lengths[int(rows[b])] = step + 1
        if live_count == 0 or step + 1 == params.max_new_tokens:
            break
        if live_count < compact_below * len(rows):  # finished rows leave the batch, with their cache rows
            index = live.nonzero()[:, 0]
            batch.drop(index)
            stops.keep(index)
            tokens, live = tokens[index], live[index]
            if keys is not None:
                keys = keys[index]
        logits = batch.advance(model, tokens, step)

    tokens_of = generated.tolist()
    responses = [tokens_of[row][:lengths[row]] for row in range(num_rows)]
    if logprobs is not None:
        values = token_logprobs.tolist()
        logprobs[:] = [values[row][:lengths[row]] for row in range(num_rows)]
    return responses


def _distinct_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int] | None]:
    """The distinct prompts (first-seen order) and, per row, the index of its prompt among them; None for
    the index when every prompt is distinct (nothing to share)."""
    first: dict[tuple[int, ...], int] = {}
    row_of = [first.setdefault(tuple(p), len(first)) for p in prompts]
    if len(first) == len(prompts):
        return prompts, None
    return [list(p) for p in first], row_of
