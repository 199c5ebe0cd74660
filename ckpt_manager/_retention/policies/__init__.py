"""The retention policies, one module each; importing a module registers its `PolicySpec`.

keep_last.py      KeepLast: the newest N steps (`--keep-last`, `keep_last`).
keep_every.py     KeepEvery: multiples of N (`--keep-every`, `keep_every`).
keep_interval.py  KeepInterval: one step per interval of commit time (`--keep-interval`,
                  `keep_interval_s`).
keep_best.py      KeepBest, MetricMode: the best N by a saved metric (`--keep-best`,
                  `--metric`, `--mode`; `keep_best`, `keep_best_metric`, `keep_best_mode`).

This package imports every module it holds: the built-ins above first, in the order `ckptctl`
shows their flags and labels, then any other module by name. A new policy is one new module
here and nothing else ([Note: a policy is one module] in `registry.py`).
"""

from __future__ import annotations

import importlib
import pkgutil

# Registration order is the order `ckptctl` shows flags and labels in: not alphabetical.
# isort: off
from ckpt_manager._retention.policies.keep_last import KeepLast
from ckpt_manager._retention.policies.keep_every import KeepEvery
from ckpt_manager._retention.policies.keep_interval import KeepInterval
from ckpt_manager._retention.policies.keep_best import KeepBest, MetricMode

# isort: on

__all__ = ["KeepBest", "KeepEvery", "KeepInterval", "KeepLast", "MetricMode"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
