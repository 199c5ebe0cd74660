"""trainingd's fully sharded data-parallel engine.

Four strategies (`no_shard`, `optim`, `optim_grads`, `optim_grads_params`) over
`torch.distributed`, designed after Megatron-Core's custom FSDP. It never imports `ckpt_manager`
or `daemon`; it exposes plain stats objects that the daemon turns into metrics.
"""

__all__: list[str] = []
