"""Where a run executes, decided without importing torch at module level: the device rule (device.py) and
DeepSpeed's config with the ranks' port (deepspeed_config.py). The launcher checks a job against them
before any rank starts; the Trainer's engine (training/engine.py) builds on them."""
