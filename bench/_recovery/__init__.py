"""Helpers of `bench/recovery.py` (issue 29's recovery measurements), one job per module.

- `job`: the job the bench trains (the default job, or it with a large extra parameter so a
  rank's state has a chosen size), whose ranks write when each step completes;
- `progress`: reads those files and the ranks' `restored` lines back into per-kill samples
  (steps lost, SIGKILL to the first step completed after it, restore source) and step times;
- `stats`: spreads (median, min, max, bootstrap interval) and the verdict of each target;
- `s3count`: moto's S3 server behind a counter of the object bytes it serves (the durable
  root of the node-loss rounds: what a restore read from storage, counted by the storage);
- `machine`: the machine's memcpy rate and a plain TCP copy on loopback;
- `host`: what the host did during a measured stretch (the ranks' user and system CPU, their
  page faults, the memory a guest handed back to its hypervisor);
- `rounds`: drives `trainingd run` daemons from outside (start, kill, replace, stop).
"""
