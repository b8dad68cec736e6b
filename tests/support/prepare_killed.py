"""scripts/prepare_data.py, killed with SIGKILL after its N-th shard: the tests run

    python tests/support/prepare_killed.py N <prepare_data.py's arguments>

instead of scripts/prepare_data.py to interrupt a preparation as a killed job is. The shard
writer (fp8train.data.prepare.Splitter.flush) is wrapped from here, before the real script runs:
once the N-th shard (val and train together) is written and the progress saved, a half-written
temporary shard is left behind, as a real kill would, and the process kills itself.
fp8train itself knows nothing of this."""
import functools
import os
import runpy
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
sys.path.insert(0, ROOT)


def install(kill_after: int) -> None:
    from fp8train.data.prepare import Splitter
    flush = Splitter.flush

    @functools.wraps(flush)
    def flush_then_kill(self, *args, **kwargs):
        flush(self, *args, **kwargs)
        if self.shard + self.val_shards == kill_after:
            with open(os.path.join(self.a.output_dir, "train_999999.bin.tmp"), "wb") as fh:
                fh.write(b"half a shard")
            os.kill(os.getpid(), signal.SIGKILL)
    Splitter.flush = flush_then_kill


if __name__ == "__main__":
    install(int(sys.argv.pop(1)))
    script = os.path.join(ROOT, "scripts", "prepare_data.py")
    sys.argv[0] = script
    runpy.run_path(script, run_name="__main__")
