"""generate's batch handling: finished rows staying in the batch (or leaving it) change no one's tokens, a row's
tokens do not depend on its company, and the in-place KV cache gives the log-probabilities of a plain forward."""

from __future__ import annotations

import pytest
import torch

from epo_cli.rollout.generation import SamplingConfig, generate

#: the random tiny model writes an "e" every few tokens: rows finish at many different lengths
PARAMS = SamplingConfig(max_new_tokens=20, temperature=1.0, stop="e")


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    return AutoTokenizer.from_pretrained(tiny_folder), AutoModelForCausalLM.from_pretrained(tiny_folder).eval()


def prompts_of(tok, n: int) -> list[list[int]]:
    texts = ["Task: put a mug in desk.", "Observation: You arrive at cabinet 1. The cabinet 1 is closed.",
             "look", "Task: heat some egg and put it in garbagecan 1. You are in the middle of a room."]
    return [tok.encode(f"{texts[i % 4]} {i}") for i in range(n)]


def test_finished_rows_in_the_batch_change_no_tokens(tiny) -> None:
    tok, model = tiny
    prompts, seeds = prompts_of(tok, 10), list(range(100, 110))
    runs = {}
    for compact in (1.0, 0.5, 0.0):  # leave at every finish / below half live / never
        logprobs: list[list[float]] = []
        runs[compact] = (generate(model, prompts, PARAMS, tok, seeds, len(tok), logprobs=logprobs,
                                  compact_below=compact), logprobs)
    responses = runs[1.0][0]
    assert len({len(r) for r in responses}) >= 4  # rows finished at many lengths
    for compact in (0.5, 0.0):
        assert runs[compact][0] == responses
        for a, b in zip(runs[compact][1], runs[1.0][1]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_a_row_samples_the_same_alone_or_among_rows_that_finish_early(tiny) -> None:
    tok, model = tiny
    prompts, seeds = prompts_of(tok, 9), [7 * i + 1 for i in range(9)]
    together = generate(model, prompts, PARAMS, tok, seeds, len(tok))
    for i in (0, 4, 8):
        assert generate(model, [prompts[i]], PARAMS, tok, [seeds[i]], len(tok))[0] == together[i]
    # and in another order with other company: the same tokens
    reordered = generate(model, prompts[::-1] + prompts_of(tok, 3), PARAMS, tok, seeds[::-1] + [1, 2, 3], len(tok))
    assert reordered[:9][::-1] == together


def test_logprobs_equal_a_full_forward_over_prompt_and_response(tiny) -> None:
    """The KV cache written in place (and re-indexed when rows leave) holds what a plain forward computes."""
    tok, model = tiny
    prompts, seeds = prompts_of(tok, 6), list(range(6))
    params = SamplingConfig(max_new_tokens=30, temperature=0.8, stop="e")
    logprobs: list[list[float]] = []
    responses = generate(model, prompts, params, tok, seeds, len(tok), logprobs=logprobs, compact_below=0.9)
    for prompt, response, got in zip(prompts, responses, logprobs):
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1, :len(tok)].float() / 0.8
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(got), expected, atol=1e-4)
