"""The tiny offline model: build, save, reload through Auto* classes; the response-only loss layout."""

from __future__ import annotations

import torch

from epo_cli.rollout.batch import TurnBatch
from epo_cli.training.forward import collate, policy_forward


def test_tiny_round_trip_through_auto_classes(tiny_folder) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_folder)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 64
    text = "You arrive at cabinet 1. The cabinet 1 is closed. <think>x</think><action>open cabinet 1</action>"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level BPE: lossless
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.pad_token_id is not None and tok.eos_token == "<|im_end|>"
    # household words are whole tokens (the tokenizer was trained on the env's text)
    assert len(tok.tokenize(" countertop")) == 1


def test_tiny_is_cached_and_reused(tiny_folder, epo_cache) -> None:
    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.models.tiny import build_tiny

    before = (tiny_folder / "config.json").stat().st_mtime_ns
    cfg = compose([])
    assert build_tiny(cfg.model, make_suite(cfg.env)) == tiny_folder
    assert (tiny_folder / "config.json").stat().st_mtime_ns == before  # not rebuilt
    other = compose(["model.hidden_size=32", "model.intermediate_size=64"])
    assert build_tiny(other.model, make_suite(other.env)) != tiny_folder  # sizes are part of the key


def _two_samples() -> TurnBatch:
    z = torch.zeros(2)
    return TurnBatch(prompt_ids=[[5, 6, 7], [5]], response_ids=[[8, 9], [10, 11, 12]],
                     traj_id=torch.tensor([0, 1]), group_id=torch.tensor([0, 1]),
                     turn_index=torch.tensor([0, 0]), num_turns=torch.tensor([1, 1]), reward=z, outcome=z,
                     valid=torch.ones(2, dtype=torch.bool), won=z.bool(), task_type=["a", "b"])


def test_layout_and_response_only_mask() -> None:
    mb = collate(_two_samples(), [0, 1], pad_id=0, device=torch.device("cpu"))
    # P = 3 prompt columns (left-padded), R = 3 response columns (right-padded)
    assert mb.prompt_width == 3
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 5, 10, 11, 12]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]  # real tokens only
    assert mb.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert mb.response_ids.tolist() == [[8, 9, 0], [10, 11, 12]]


def test_logprobs_are_read_at_the_predicting_columns(tiny_folder) -> None:
    """logprob of response token r comes from the logits at column P-1+r; prompt tokens never count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    mb = collate(_two_samples(), [0, 1], pad_id=0, device=torch.device("cpu"))
    with torch.no_grad():
        out = policy_forward(model, mb)
        full = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                     position_ids=mb.position_ids).logits.log_softmax(-1)
    # row 0: response [8, 9] predicted at columns 2 and 3; its third response column is padding -> 0
    assert torch.allclose(out.logprobs[0, :2], torch.stack([full[0, 2, 8], full[0, 3, 9]]), atol=1e-5)
    assert out.logprobs[0, 2] == 0 and out.entropy[0, 2] == 0
    assert torch.allclose(out.logprobs[1], torch.stack([full[1, 2, 10], full[1, 3, 11], full[1, 4, 12]]), atol=1e-5)
    # entropy of the full next-token distribution at those columns
    p = full[1, 2].exp()
    assert torch.allclose(out.entropy[1, 0], -(p * full[1, 2]).sum(), atol=1e-5)
