"""`--data` / `--val-data`: the job's model trains (validates) on token files; the files must fit
its vocabulary."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon._config_load import load_config
from daemon.data import TokenDataset, write_token_file
from daemon.errors import ConfigError, JobError
from daemon.jobs.default_job import MODEL, build
from daemon.jobs.job import JobContext
from daemon.rank.token_data import with_token_data

_CTX = JobContext(rank=0, world_size=1, seed=0)


def test_data_replaces_the_jobs_dataset_with_samples_of_its_length(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    write_token_file(a, [np.arange(1000) % 256], vocab_size=256)
    write_token_file(b, [np.full(1000, 7)], vocab_size=256)
    job = build(_CTX)
    assert with_token_data(load_config({}, env={}), job) is job
    cfg = load_config({"data": f"{a},{b}", "data_weights": "1,3"}, env={})
    data = with_token_data(cfg, job).train_data
    assert isinstance(data, TokenDataset)
    x, y = data[0]
    assert x.shape == (MODEL.seq_len,)
    assert torch.equal(x[1:], y[:-1])


def test_val_data_replaces_the_jobs_val_data_only(tmp_path: Path) -> None:
    path = str(tmp_path / "val.bin")
    write_token_file(path, [np.arange(1000) % 256], vocab_size=256)
    job = build(_CTX)
    validated = with_token_data(load_config({"val_data": path}, env={}), job)
    assert validated.train_data is job.train_data
    assert isinstance(validated.val_data, TokenDataset)
    x, y = validated.val_data[1]
    assert x.shape == (MODEL.seq_len,)
    assert torch.equal(x[1:], y[:-1])
    big = str(tmp_path / "big.bin")
    write_token_file(big, [np.arange(1000)], vocab_size=50_257)
    with pytest.raises(JobError, match="--val-data files have a vocabulary of 50257 tokens"):
        with_token_data(load_config({"val_data": big}, env={}), job)


def test_files_with_a_larger_vocabulary_than_the_model_are_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "big.bin")
    write_token_file(path, [np.arange(1000)], vocab_size=50_257)
    cfg = load_config({"data": path}, env={})
    with pytest.raises(JobError, match="vocabulary of 50257 tokens but the job's model embeds 256"):
        with_token_data(cfg, build(_CTX))


def test_a_job_without_a_loss_fn_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "a.bin")
    write_token_file(path, [np.arange(1000) % 256], vocab_size=256)
    job = dataclasses.replace(build(_CTX), loss_fn=None)  # as a job of dict samples may be
    with pytest.raises(JobError, match="has no loss_fn"):
        with_token_data(load_config({"data": path}, env={}), job)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"data_weights": "1"}, "without data"),
        ({"data": "a.bin,b.bin", "data_weights": "1"}, "one weight > 0 per data file"),
        ({"data": "a.bin", "data_weights": "x"}, "comma-separated numbers"),
    ],
)
def test_bad_weights_are_config_errors(flags: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(flags, env={})


def test_the_job_is_otherwise_unchanged(tmp_path: Path) -> None:
    path = str(tmp_path / "a.bin")
    write_token_file(path, [np.arange(500) % 256], vocab_size=256)
    job = build(_CTX)
    swapped = with_token_data(load_config({"data": path}, env={}), job)
    for field in dataclasses.fields(job):
        if field.name != "train_data":
            assert getattr(swapped, field.name) is getattr(job, field.name)
