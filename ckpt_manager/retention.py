"""Retention as configuration: one `keep_*` key per parameter of each registered policy.

A public module, imported explicitly (its names are not in `ckpt_manager.__all__`), and
torch-free. A tool with a configuration file offers `config_keys()` as its keys (trainingd's
`[checkpoint] keep_last`, `keep_every`, `keep_interval_s`, `keep_best`, `keep_best_metric`,
`keep_best_mode`, ...), keeps their values in a `RetentionOptions` (checked when built: a
`ValueError` whose message starts with `key=value` of the key to fix) and passes
`options.policy()` as `CheckpointConfig(retention=...)`. A policy added to the registry
(`_retention/policies/`) becomes a key here with no change to the tool.
"""

from __future__ import annotations

from ckpt_manager._retention.options import ConfigKey, RetentionOptions, config_keys

__all__ = ["ConfigKey", "RetentionOptions", "config_keys"]
