"""Accelerate's FSDP2 on a CPU, for the tests that run the real trainer under it over gloo.

Mocked, because it cannot exist here: Accelerate shards with FSDP only on CUDA. On a CPU it
keeps the launch config's FSDP plugin out of its state and runs DDP. `install` puts back, right
after `Accelerator()` returns, what Accelerate keeps on CUDA: the plugin built from the
launcher's FSDP_* variables, and the distributed type FSDP. Everything else is real:
Accelerate's FSDP2 prepare (fully_shard per Block), the gloo collectives, the training loop."""


def install(active=lambda: True) -> None:
    """From now on every Accelerator of this process is FSDP2 while `active()` is true."""
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    init = accelerate.Accelerator.__init__

    def fsdp2_init(self, *args, **kw):
        init(self, *args, **kw)
        if active():
            self.state.fsdp_plugin = FullyShardedDataParallelPlugin()
            self.state.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    accelerate.Accelerator.__init__ = fsdp2_init
