"""W&B's offline run as the tests read it back: the run's environment, its records decoded from
the .wandb file (exactly what `wandb sync` would upload), its history, config and summary."""
import glob
import json
import os
import struct
import subprocess
import sys

from support.runs import DATA_DIR, ROOT

from fp8train.observe.metrics_file import read_rows


def wandb_env(tmp_path, **extra):
    """No key, no netrc, no settings from the machine's user: only what the test says."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), NETRC=str(tmp_path / "home" / "netrc"),
               WANDB_CONFIG_DIR=str(tmp_path / "home" / ".wandb"), **extra)
    return env


def run_with_env(args, env):
    env = dict(env, FP8TRAIN_DATA_DIR=DATA_DIR, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "train_fp8.py", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


def wandb_records(run_dir):
    """The records of an offline run's .wandb file: W&B's framing (a 7-byte header, then 32 KiB
    blocks of [crc32c, length, type] chunks, as in LevelDB's log format) around protobuf
    Records."""
    from wandb.proto import wandb_internal_pb2 as pb
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:                      # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:                     # full
            records.append(chunk)
        elif kind == 2:                   # first
            pending = chunk
        elif kind == 3:                   # middle
            pending += chunk
        elif kind == 4:                   # last
            records.append(pending + chunk)
    out = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        out.append(rec)
    return out


def history_and_config(run_dir):
    history, config = [], {}
    for rec in wandb_records(run_dir):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                            for i in rec.history.item})
        elif kind in ("config", "run"):
            items = rec.config.update if kind == "config" else rec.run.config.update
            for i in items:
                config[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return history, config


def wandb_summary(run_dir):
    """The run summary as the .wandb file records it (the last value of each key)."""
    out = {}
    for rec in wandb_records(run_dir):
        if rec.WhichOneof("record_type") == "summary":
            for i in rec.summary.update:
                out[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return out


def wandb_console_lines(r):
    return [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("wandb:")]


def offline_runs(out):
    return sorted(glob.glob(str(out / "wandb" / "offline-run-*")))


def metrics_rows(out):
    return read_rows(out, strict=True)
