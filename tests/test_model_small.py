"""model=small: the tiny model's offline builder at a few million parameters (docs/learning.md, "Long horizon")."""

from __future__ import annotations


def test_small_builds_offline_with_its_sizes(epo_cache) -> None:
    from transformers import AutoModelForCausalLM

    from epo_cli.compose import compose
    from epo_cli.envs import make_suite
    from epo_cli.models.tiny import build_tiny

    tiny, small = compose([]), compose(["model=small"])
    assert small.model.name == "small" and small.model.path is None  # built locally, like tiny
    folder = build_tiny(small.model, make_suite(small.env))
    model = AutoModelForCausalLM.from_pretrained(folder)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (256, 4, 8, 4)
    # a few million parameters: 4 layers x (attention 256x(256+128+128+256) + MLP 3x256x1024) + 1024x256 tied
    params = sum(p.numel() for p in model.parameters())
    layer = 256 * (256 + 128 + 128 + 256) + (256 + 128 + 128) + 3 * 256 * 1024 + 2 * 256  # + q/k/v biases, norms
    assert params == 4 * layer + cfg.vocab_size * 256 + 256  # + the final norm
    assert 3_000_000 < params < 6_000_000
    assert folder != build_tiny(tiny.model, make_suite(tiny.env))  # its own cache entry, not tiny's
