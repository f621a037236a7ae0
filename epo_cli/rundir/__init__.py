"""Run directories on disk: what a run leaves, who may write it, and reading it back without trusting it.

    folder.py            the run folder: config.yaml, status.json, its lock (one writer), name/path checks
    checkpoint_paths.py  which checkpoints exist and are complete, what trainer.resume= names (no torch)
    saved_state.py       a saved config, trainer state or model folder checked whole before it is used
    trust.py             settings that can run code, honoured only from this invocation's command line
    safe_load.py         torch.load with the restricted unpickler: nothing in a file runs
    writable.py          folders a command writes its results into, checked before any work; the one writer
                         of files in a folder epo owns (never through a symlink, FIFO, device or hard link)
    received.py          the one reader of received files: regular files only, symlinks inside the folder,
                         a size cap per kind, a JSON nesting cap

Nothing is imported here: each module is imported by name (`epo config show` and the launchers load no torch).
"""
