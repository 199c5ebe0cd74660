"""trainingd's checkpoint manager: asynchronous, coordinated, atomic checkpoints.

Saves and restores nested state dicts of tensors and plain values to local disk, S3 or any
fsspec filesystem. It never imports `sharding` or `daemon`: the daemon hands it state dicts.

Module plan (filled in as the manager lands):
    cli.py  `ckptctl` console script: list, show, verify, restore, prune, pin checkpoints.
"""

__all__: list[str] = []
