"""Stop detection on token ids: the automaton table flags exactly the tokens where the stop string ends, and the
stops `generate` makes are the decode-based check's (`stop in tokenizer.decode(response[-8:])`), on many
random responses of the tiny model's tokenizer."""

from __future__ import annotations

import random

import pytest
import torch

from epo_cli.rollout.generation import STOP_WINDOW, SamplingConfig, generate, stop_matcher, token_texts

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok(tiny_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_folder)


@pytest.fixture(scope="module")
def model(tiny_folder):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_folder).eval()


def decode_stop(tok, response: list[int], stop: str, eos_ids: set[int]) -> int | None:
    """The old per-token check: the length at which the response stops (None: it never does)."""
    for t in range(len(response)):
        if response[t] in eos_ids or stop in tok.decode(response[:t + 1][-STOP_WINDOW:]):
            return t + 1
    return None


def matcher_stop(tok, response: list[int], stop: str, eos_ids: set[int]) -> tuple[int | None, int]:
    """generate's check: the automaton flags tokens, the decode check confirms them. Returns the stop length
    and how many tokens were flagged (the decode calls made)."""
    matcher = stop_matcher(tok, stop, len(tok), CPU)
    state, flagged = 0, 0
    for t, token in enumerate(response):
        hit = bool(matcher.completes[state, token])
        state = int(matcher.next_state[state, token])
        if token in eos_ids:
            return t + 1, flagged
        if hit:
            flagged += 1
            if stop in tok.decode(response[:t + 1][-STOP_WINDOW:]):
                return t + 1, flagged
    return None, flagged


def random_responses(tok, stop: str, count: int, seed: int) -> list[list[int]]:
    """Responses that hold the stop string in many tokenizations: random tokens around pieces of text cut at
    random places (each piece encoded alone, so the stop string's tokens differ from response to response),
    some spelled a character at a time (over 8 tokens: the decode check misses those)."""
    rng = random.Random(seed)
    words = ["look", "open", "cabinet", "<action>", "</", "act", "ion", ">", "</action", "</action>", " the",
             "<think>", "go to desk 1", "\n", "é", "</actio", "n>"]
    responses = []
    vocab = len(tok)
    for _ in range(count):
        text = "".join(rng.choice(words) for _ in range(rng.randrange(1, 6)))
        text += stop if rng.random() < 0.7 else ""
        text += "".join(rng.choice(words) for _ in range(rng.randrange(0, 3)))
        ids: list[int] = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
        pos = 0
        while pos < len(text):
            size = 1 if rng.random() < 0.2 else rng.randrange(1, 8)
            ids += tok.encode(text[pos:pos + size], add_special_tokens=False)
            pos += size
        ids += [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
        responses.append(ids)
    return responses


def occurrence_ends(tok, response: list[int], stop: str) -> list[bool]:
    """Per token: does an occurrence of the stop string end inside its text (the token texts laid end to end)?
    The automaton's table must say exactly this."""
    texts = token_texts(tok, len(tok))
    flags, text = [], ""
    for token in response:
        start = len(text)
        text += texts[token]
        first = max(0, start - len(stop) + 1)  # occurrences that end inside this token's text
        flags.append(any(text.startswith(stop, i) for i in range(first, len(text) - len(stop) + 1)))
    return flags


@pytest.mark.parametrize("stop", ["</action>", "act", ">", "n>\n"])
def test_stops_are_the_decode_checks_on_random_responses(tok, stop: str) -> None:
    eos_ids = {tok.eos_token_id, tok.pad_token_id} - {None}
    responses = random_responses(tok, stop, 600, seed=len(stop))
    stopped = missed_by_window = decode_calls = tokens = 0
    matcher = stop_matcher(tok, stop, len(tok), CPU)
    assert matcher is not None  # the tiny tokenizer's token texts lay end to end: the fast path runs
    for response in responses:
        expected = decode_stop(tok, response, stop, eos_ids)
        got, flagged = matcher_stop(tok, response, stop, eos_ids)
        assert got == expected, (tok.convert_ids_to_tokens(response), expected, got)
        # the automaton flags exactly the tokens in which an occurrence ends (checked on the whole response)
        state, flags = 0, []
        for token in response:
            flags.append(bool(matcher.completes[state, token]))
            state = int(matcher.next_state[state, token])
        assert flags == occurrence_ends(tok, response, stop)
        stopped += expected is not None
        missed_by_window += expected is None and any(flags)
        decode_calls += flagged
        tokens += len(response) if got is None else got
    assert stopped > 150  # the sample exercises real stops
    assert decode_calls < 0.25 * tokens  # the decode check runs on flagged tokens only
    if stop == "</action>":
        assert missed_by_window > 0  # spelled over > 8 tokens: flagged, rejected by the decode check, as before


def test_the_matcher_is_built_once_per_tokenizer_and_stop(tok) -> None:
    first = stop_matcher(tok, "</action>", len(tok), CPU)
    assert stop_matcher(tok, "</action>", len(tok), CPU) is first
    assert stop_matcher(tok, "act", len(tok), CPU) is not first
    # ids past the tokenizer (a padded vocabulary) have no text: never flagged, state reset
    wide = stop_matcher(tok, "</action>", len(tok) + 5, CPU)
    assert wide.completes.shape[1] == len(tok) + 5 and not bool(wide.completes[:, len(tok):].any())


def test_generate_stops_where_the_decode_check_does(tok, model) -> None:
    """Through generate, with a stop string the random model writes often (rows finish at many lengths) and one
    with no fast path (non-ASCII: the decode check runs on every row): every response ends at the decode
    check's first stop or at the token limit."""
    eos_ids = {tok.eos_token_id, tok.pad_token_id} - {None}
    prompts = [tok.encode(f"Task {i}: put a mug in desk {i}.") for i in range(12)]
    for stop in ("e", "é"):
        assert (stop_matcher(tok, stop, len(tok), CPU) is None) == (stop == "é")
        params = SamplingConfig(max_new_tokens=24, temperature=1.0, stop=stop)
        responses = generate(model, prompts, params, tok, seeds=list(range(12)), vocab_limit=len(tok))
        for response in responses:
            expected = decode_stop(tok, response, stop, eos_ids)
            assert expected == len(response) or (expected is None and len(response) == 24)
        if stop == "e":
            assert len({len(r) for r in responses}) > 3

