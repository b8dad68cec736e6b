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


def launch(script: str, out_dir, args: list, world: int = 2, timeout: int = 600):
    """`accelerate launch` of a driver `script` (a test file run as one) on `world` CPU
    processes with the FSDP2 layout, its arguments `out_dir` and `args`; the finished process,
    and each rank's JSON report (out_dir/rank<i>.json) when it succeeded."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from support.runs import DATA_DIR, ROOT
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, FP8TRAIN_DATA_DIR=DATA_DIR, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                        "accelerate_configs/fsdp_8xh100.yaml", "--num_processes", str(world),
                        "--main_process_port", str(port), script, str(out_dir), *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r, [json.loads((Path(out_dir) / f"rank{i}.json").read_text()) for i in range(world)]
