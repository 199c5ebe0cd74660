"""Retention: which committed steps to keep, and the background thread that deletes the rest.

policies.py     StepInfo, RetentionPolicy, KeepLast, KeepEvery, KeepInterval, KeepBest,
                AnyOf, plan_deletions (invariants: newest/pinned/restored/in-flight kept).
record.py       the run's policy recorded in the root (`_RETENTION.json`) so `ckptctl
                list` can give each step's reason.
deleter.py      background retention + GC of uncommitted leftovers (coordinator only).
"""
