"""What is trained: the job seam, the default job and its model, the weights a job starts from.

Module plan:
    job.py          the job seam: `JobSpec`, `JobContext`, `Dataset`, `load_job`.
    default_job.py  the embedded default job: byte-level GPT on a generated corpus, and the
                    sample of text it writes at the end of a completed run (its documented
                    name is `daemon.default_job:build`).
    gpt.py          the default job's byte-level GPT and `generate` (also used by tests and
                    benchmarks, as `daemon.GPT` ...).
    init_from.py    `--init-from` / `JobSpec.init_from`: Hugging Face safetensors (sharded with
                    an index, or one file) checked against the model, then each rank reads
                    only its shards' byte ranges before step 0.
    model_files.py  the init source's `config.json` / `generation_config.json`, recorded with
                    every step so a safetensors export loads with `from_pretrained`.

Both processes import it: ranks build and train the job, the daemon builds it on the meta
device at start-up to check `--init-from` against it (`daemon/agent/preflight.py`).
"""
