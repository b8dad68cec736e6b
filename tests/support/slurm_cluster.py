"""A real SLURM cluster on this machine for the tests: Debian's Slurm 22.05 (slurmctld, slurmd,
munge), without systemd or cgroups, configured by its own slurm.conf in a scratch directory
(SLURM_CONF points the client commands at it; /etc/slurm is not touched). One node named
`hostname -s`, or two (a second slurmd for `<host>-2` on another port of the same machine).

    cluster = SlurmCluster.start(nodes=2)   # installs the packages first if root with apt-get
    job = cluster.sbatch([...], cwd=...); cluster.wait_job(job); cluster.job_info(job)
    cluster.stop()                          # stops, by pid, only the daemons it started

By hand: `python tests/support/slurm_cluster.py start|stop|status|env` (state in $FP8TRAIN_SLURM_DIR,
default /tmp/fp8train-slurm; $FP8TRAIN_SLURM_NODES nodes, default 1), then
`export SLURM_CONF=<dir>/slurm.conf` for sbatch, squeue, scontrol.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun",
            "munged"]
SBIN = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
MUNGE_SOCKET_DIR = Path("/run/munge")


class SlurmUnavailable(RuntimeError):
    """SLURM cannot run here (not root, no packages and no apt-get): a reason to skip."""


def which(name: str) -> Optional[str]:
    found = shutil.which(name)
    if found:
        return found
    for d in SBIN:
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return None


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if which(b) is None]


def ensure_installed(timeout: float = 900) -> None:
    """Install Debian's Slurm and munge when a binary is missing. Raises SlurmUnavailable when that
    cannot be done here (not root, or no apt-get), RuntimeError when apt-get fails."""
    if not missing_binaries():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"SLURM is not installed ({', '.join(missing_binaries())} missing) "
                               "and installing it needs root")
    if which("apt-get") is None:
        raise SlurmUnavailable(f"SLURM is not installed ({', '.join(missing_binaries())} "
                               "missing) and there is no apt-get to install it")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}"
                               f"\n{r.stderr[-2000:]}")
    if missing_binaries():
        raise RuntimeError(f"installed {PACKAGES} but {missing_binaries()} still missing")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _read_pid(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


SLURM_CONF = """\
ClusterName=fp8train
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits out its credential's life: 10 s instead of the default 120
AuthInfo=cred_expire=10
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
# look at pending jobs every 2 s (a requeued job starts again within seconds)
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=30
MinJobAge=300
{nodes}
PartitionName=debug Nodes={node_names} Default=YES MaxTime=INFINITE State=UP
"""
NODE_LINE = ("NodeName={name} NodeHostname={host} NodeAddr={addr} Port={port} CPUs={cpus} Boards=1 "
             "SocketsPerBoard=1 CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory={mem} "
             "State=UNKNOWN")


class SlurmCluster:
    """One slurmctld and `nodes` slurmd daemons, all on this machine, their state under `root`.
    The first node is this machine's `hostname -s`. With nodes=2 a second one, `<host>-2`, runs
    on the same machine (another port: Debian's slurmd supports several per host, `-N NAME`), and
    the CPUs are split between them, so that jobs can span two nodes."""

    def __init__(self, root: str | os.PathLike, nodes: int = 1):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.host = socket.gethostname().split(".")[0]
        self.nodes = [self.host] + [f"{self.host}-{i + 1}" for i in range(1, nodes)]
        self.pids: dict[str, int] = {}   # daemons started by this object, stopped by stop()

    # --- environment for the client commands -----------------------------------------------------
    @property
    def env(self) -> dict:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *cmd, check=True, timeout=60, **kw) -> subprocess.CompletedProcess:
        r = subprocess.run([which(cmd[0]) or cmd[0], *map(str, cmd[1:])],
                           env=kw.pop("env", self.env), capture_output=True, text=True,
                           timeout=timeout, **kw)
        if check and r.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, cmd))} -> {r.returncode}\n{r.stdout}{r.stderr}")
        return r

    # --- lifecycle --------------------------------------------------------------------------------
    @classmethod
    def start(cls, root: str | os.PathLike | None = None, nodes: int = 1,
              timeout: float = 60) -> "SlurmCluster":
        """Install if needed, write slurm.conf, start munged, slurmctld and the slurmd daemons
        (each only if not already running from this state directory) and wait until every node
        is idle."""
        ensure_installed()
        if root is None:
            root = tempfile.mkdtemp(prefix="fp8train-slurm-")
        cluster = cls(root, nodes)
        try:
            cluster._start(timeout)
        except BaseException:
            cluster.stop()   # what did start
            raise
        return cluster

    def responsive(self) -> bool:
        if not self.conf.is_file():
            return False
        try:
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return r.returncode == 0 and all(states.get(n) in ("idle", "mix", "alloc")
                                         for n in self.nodes)

    def _start(self, timeout: float) -> None:
        d = self.root
        for sub in ["state", "log"] + [f"spool/{n}" for n in self.nodes]:
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o755)
        pidfiles = {"slurmctld": d / "slurmctld.pid",
                    **{f"slurmd {n}": d / f"slurmd.{n}.pid" for n in self.nodes}}
        running = {name: _alive(_read_pid(f)) for name, f in pidfiles.items()}
        if self.conf.is_file() and all(running.values()) and self.responsive():
            return  # already running (idempotent); not ours to stop
        if not (self.conf.is_file() and any(running.values())):
            cpus = os.cpu_count() or 1
            per_node = max(1, cpus // len(self.nodes))
            mem_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
            mem = max(1000, mem_mb * 8 // 10 // len(self.nodes))
            lines = [NODE_LINE.format(name=n, host=self.host, addr=self.host if i == 0 else
                                      "127.0.0.1", port=_free_port(), cpus=per_node, mem=mem)
                     for i, n in enumerate(self.nodes)]
            self.conf.write_text(SLURM_CONF.format(
                host=self.host, d=d, ctld_port=_free_port(), nodes="\n".join(lines),
                node_names=",".join(self.nodes)))
        self._start_munge()
        # -D: stay in the foreground, so that the pid is ours and the daemon dies with a kill
        if not running["slurmctld"]:
            self._spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            if not running[f"slurmd {n}"]:
                self._spawn(f"slurmd {n}", [which("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.responsive():
                return
            for name, pid in self.pids.items():
                if not _alive(pid):
                    raise RuntimeError(f"{name} exited at start:\n{self.logs()}")
            time.sleep(0.2)
        raise RuntimeError(f"the SLURM nodes did not become idle within {timeout:.0f} s:\n"
                           f"{self.logs()}")

    def _start_munge(self) -> None:
        if (MUNGE_SOCKET_DIR / "munge.socket.2").exists() and \
                _alive(_read_pid(MUNGE_SOCKET_DIR / "munged.pid")):
            return  # one munged serves the machine; leave a running one alone
        MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
        key = Path("/etc/munge/munge.key")
        if not key.is_file():  # the package creates it; make one if it did not
            subprocess.run([which("mungekey") or "mungekey", "--create"], check=True)
            shutil.chown(key, "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", which("munged")], check=True,
                       capture_output=True, timeout=30)
        pid = _read_pid(MUNGE_SOCKET_DIR / "munged.pid")
        if pid:
            self.pids["munged"] = pid

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name.replace(' ', '.')}.out", "ab")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=self.env, start_new_session=True)
        out.close()
        self.pids[name] = proc.pid

    def stop(self, timeout: float = 30) -> None:
        """Stop the daemons this object started, by pid: slurmd, slurmctld, then munged."""
        for name in [f"slurmd {n}" for n in self.nodes] + ["slurmctld", "munged"]:
            pid = self.pids.pop(name, None)
            if not _alive(pid):
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.time() + timeout
            while _alive(pid) and time.time() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
            try:  # reap our own children (slurmctld, slurmd)
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def logs(self, tail: int = 3000) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)

    # --- jobs -------------------------------------------------------------------------------------
    def sbatch(self, args: list, cwd: str | os.PathLike, env: Optional[dict] = None) -> str:
        r = self.run("sbatch", "--parsable", *args, cwd=cwd, env=dict(self.env, **(env or {})))
        return r.stdout.strip().split(";")[0]

    def job_info(self, job_id: str) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...); {} once it is gone."""
        r = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if r.returncode != 0:
            return {}
        info = {}
        for tok in r.stdout.split():
            k, _, v = tok.partition("=")
            info.setdefault(k, v)
        return info

    def wait_job(self, job_id: str, timeout: float = 300, until=None) -> dict:
        """Poll until the job is finished (COMPLETED, FAILED, ...) or `until(info)` is true."""
        finished = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                    "BOOT_FAIL", "DEADLINE", "PREEMPTED")
        deadline = time.time() + timeout
        info: dict = {}
        while time.time() < deadline:
            info = self.job_info(job_id)
            if until is not None and until(info):
                return info
            if info.get("JobState") in finished:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not done after {timeout:.0f} s: {info}\n{self.logs()}")


def main(argv: list[str]) -> int:
    root = os.environ.get("FP8TRAIN_SLURM_DIR", "/tmp/fp8train-slurm")
    nodes = int(os.environ.get("FP8TRAIN_SLURM_NODES", "1"))
    cmd = argv[0] if argv else "status"
    cluster = SlurmCluster(root, nodes)
    if cmd == "start":
        cluster = SlurmCluster.start(root, nodes)
        print(f"SLURM up: nodes {','.join(cluster.nodes)}; export SLURM_CONF={cluster.conf}")
    elif cmd == "stop":
        for name in ["slurmctld"] + [f"slurmd.{n}" for n in cluster.nodes]:
            pid = _read_pid(Path(root) / f"{name}.pid")
            if _alive(pid):
                cluster.pids[name.replace(".", " ", 1)] = pid
        cluster.stop()
    elif cmd == "env":
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        print("up" if cluster.responsive() else "down")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
