"""A real SLURM on the test machine: one node posing as one 8x B200 and one 4x RTX PRO 6000 node,
and two more 8x B200 nodes (partition ``pair``) for jobs over several nodes.

Debian's slurm-wlm 22.05 and munge (installed with apt when missing: these machines run tests as
root). GPUs are character devices cloned from /dev/null: Slurm drops a GPU without a device file.
``SlurmdParameters=config_overrides`` makes slurmd trust the NodeName lines, so a 2-core machine
offers 224 CPUs, 2 TB and 12 GPUs; the CI overlay profile keeps the jobs' real demands small.
Every daemon runs its jobs on this machine, so the working tree is the shared file system: three
slurmd, one per node name (``slurmd -N``), each on its own port, as SLURM's multiple-slurmd set-up.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
ETC = Path("/etc/slurm")
STATE = Path("/var/spool/slurmctld"), Path("/var/spool/slurmd")
LOGS = Path("/var/log/slurm")
DEVICES = Path("/tmp/dflash-fake-gpus")
# (gres.conf type, count, partition): the names profiles/site.yaml ships with
GPUS = [("b200", 8, "b200"), ("rtx_pro_6000", 4, "rtxpro6000")]
PAIR = ["pair1", "pair2"]  # partition pair: two nodes of 8 B200s each
NODES = ["main", *PAIR]
# the single slurmd of an older set-up first: its pid file had no node name
PIDS = [Path("/run/slurmd.pid"), *(Path(f"/run/slurmd-{n}.pid") for n in NODES), Path("/run/slurmctld.pid"),
        Path("/run/munge/munged.pid")]
PARTITIONS = ["gpu", "cpu", *(p for _, _, p in GPUS), "pair"]
DOWN = ("down", "drain", "fail", "inval", "unk", "future")  # node states sinfo shows; a trailing * is "not responding"


class SlurmUnavailable(RuntimeError):
    pass


def _run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def install() -> None:
    if all(shutil.which(b) or Path(f"/usr/sbin/{b}").exists() for b in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("the SLURM tests need Debian's " + " ".join(PACKAGES) + " (apt-get install as root); "
                               "this machine has neither the packages nor root with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    r = _run("apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES, env=env)
    if r.returncode:
        _run("apt-get", "update", "-q", env=env)
        r = _run("apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES, env=env)
    if r.returncode:
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {r.stderr.strip()[-800:]}")


def _config(host: str) -> str:
    gres = ",".join(f"gpu:{t}:{n}" for t, n, _ in GPUS)
    node = f"NodeHostname={host} NodeAddr=127.0.0.1 CPUs=224 SocketsPerBoard=2 CoresPerSocket=112 ThreadsPerCore=1 " \
           f"RealMemory=2000000 State=UNKNOWN"
    return "\n".join([
        "ClusterName=ci", "SlurmctldHost=localhost", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        f"StateSaveLocation={STATE[0]}", f"SlurmdSpoolDir={STATE[1]}/%n",
        f"SlurmctldPidFile={PIDS[-2]}", "SlurmdPidFile=/run/slurmd-%n.pid",
        f"SlurmctldLogFile={LOGS}/slurmctld.log", f"SlurmdLogFile={LOGS}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory", "ReturnToService=2",
        "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "GresTypes=gpu", "SlurmdParameters=config_overrides",
        "SchedulerParameters=sched_interval=1", "KillWait=5",
        f"NodeName=main Port=6818 Gres={gres} {node}",
        *[f"NodeName={n} Port={6830 + i} Gres=gpu:b200:8 {node}" for i, n in enumerate(PAIR)],
        *[f"PartitionName={p} Nodes=main Default={'YES' if p == 'gpu' else 'NO'} MaxTime=INFINITE State=UP"
          for p in PARTITIONS[:-1]],
        f"PartitionName=pair Nodes={','.join(PAIR)} Default=NO MaxTime=INFINITE State=UP", ""])


def running() -> bool:
    """Whether this set-up answers: every node up, every partition there (a cluster an older set-up
    started lacks some)."""
    if not shutil.which("sinfo"):
        return False
    r = _run("sinfo", "-h", "-N", "-o", "%N %P %T")
    rows = [line.split() for line in r.stdout.splitlines()]
    return (r.returncode == 0 and {n for n, _, _ in rows} == set(NODES)
            and {p.rstrip("*") for _, p, _ in rows} == set(PARTITIONS)
            and not any(state.endswith("*") or state.startswith(DOWN) for _, _, state in rows))


def start(timeout_s: float = 60) -> bool:
    """Configure and start munged, slurmctld and slurmd unless a cluster already answers; True when
    this call started them. One caller at a time: pytest-xdist's workers each ask as they start."""
    with open("/tmp/dflash-slurm-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _start(timeout_s)


def _start(timeout_s: float) -> bool:
    install()
    if running():
        return False
    stop()
    for d in (*STATE, LOGS):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    for n in NODES:
        (STATE[1] / n).mkdir()
    DEVICES.mkdir(exist_ok=True)
    files = []
    for node, gtype, n in [*(("main", t, n) for t, n, _ in GPUS), *((p, "b200", 8) for p in PAIR)]:
        prefix = gtype if node == "main" else f"{node}_{gtype}"
        for i in range(n):
            dev = DEVICES / f"{prefix}{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
        files.append(f"NodeName={node} Name=gpu Type={gtype} File={DEVICES}/{prefix}[0-{n - 1}]")
    ETC.mkdir(parents=True, exist_ok=True)
    (ETC / "slurm.conf").write_text(_config(socket.gethostname().split(".")[0]))
    (ETC / "gres.conf").write_text("\n".join(files) + "\n")
    munge_run = Path("/run/munge")
    munge_run.mkdir(exist_ok=True)
    shutil.chown(munge_run, "munge", "munge")
    for cmd in (["runuser", "-u", "munge", "--", "/usr/sbin/munged"], ["/usr/sbin/slurmctld"],
                *(["/usr/sbin/slurmd", "-N", n] for n in NODES)):
        r = _run(*cmd)
        if r.returncode:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed: {r.stderr.strip()[-500:]}")
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        r = _run("sinfo", "-h", "-o", "%T")
        if running():
            return True
        if "inval" in r.stdout or "down" in r.stdout or "drain" in r.stdout:
            _run("scontrol", "update", f"nodename={','.join(NODES)}", "state=resume")
        time.sleep(0.5)
    raise SlurmUnavailable(f"the SLURM node never became idle (sinfo: {r.stdout.strip()!r}); "
                           f"see {LOGS}/slurmctld.log and slurmd.log")


def stop() -> None:
    for pid_file in PIDS:
        try:
            os.kill(int(pid_file.read_text().strip()), 15)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            pass
    deadline = time.time() + 15
    while time.time() < deadline and any(_alive(p) for p in PIDS):
        time.sleep(0.2)


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
        return True
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return False


if __name__ == "__main__":  # python -m tests.slurm_cluster: start it by hand
    start()
    print(_run("sinfo").stdout)
