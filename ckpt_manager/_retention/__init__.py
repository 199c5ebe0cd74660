"""Retention: which committed steps to keep, and the background thread that deletes the rest.

base.py         the seam: StepInfo, RetentionPolicy, AnyOf, plan_deletions (invariants:
                newest/pinned/restored/in-flight kept).
registry.py     Param, PolicySpec, register: each policy declared once (its parameters, their
                flags and configuration keys, its label, its record entry).
policies/       the policies, one module each, registered when imported: KeepLast,
                KeepEvery, KeepInterval, KeepBest (+ MetricMode).
options.py      policies from `ckptctl` flags and from configuration keys (`RetentionOptions`,
                public as `ckpt_manager.retention`).
record.py       the run's policy recorded in the root (`_RETENTION.json`) so `ckptctl
                list` can give each step's reason.
deleter.py      background retention + GC of uncommitted leftovers (coordinator only);
                learns this run's commits from the finalizer (note_committed), reads the
                manifests of the others.

Adding a policy is one module in `policies/` and its test ([Note: a policy is one module] in
`registry.py`).
"""
