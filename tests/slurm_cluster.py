"""A real single-node SLURM on the test machine, posing as one 8x B200 and one 4x RTX PRO 6000 node.

Debian's slurm-wlm 22.05 and munge (installed with apt when missing: these machines run tests as
root). GPUs are character devices cloned from /dev/null: Slurm drops a GPU without a device file.
``SlurmdParameters=config_overrides`` makes slurmd trust the NodeName lines, so a 2-core machine
offers 224 CPUs, 2 TB and 12 GPUs; the CI overlay profile keeps the jobs' real demands small.
Both daemons run the jobs on this machine, so the working tree is the shared file system.
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
PIDS = [Path("/run/slurmd.pid"), Path("/run/slurmctld.pid"), Path("/run/munge/munged.pid")]
# (gres.conf type, count, partition): the names profiles/site.yaml ships with
GPUS = [("b200", 8, "b200"), ("rtx_pro_6000", 4, "rtxpro6000")]


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
    parts = ["gpu", "cpu"] + [p for _, _, p in GPUS]
    return "\n".join([
        "ClusterName=ci", "SlurmctldHost=localhost", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        f"StateSaveLocation={STATE[0]}", f"SlurmdSpoolDir={STATE[1]}",
        f"SlurmctldPidFile={PIDS[1]}", f"SlurmdPidFile={PIDS[0]}",
        f"SlurmctldLogFile={LOGS}/slurmctld.log", f"SlurmdLogFile={LOGS}/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory", "ReturnToService=2",
        "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "GresTypes=gpu", "SlurmdParameters=config_overrides",
        "SchedulerParameters=sched_interval=1", "KillWait=5",
        f"NodeName=localhost NodeHostname={host} CPUs=224 SocketsPerBoard=2 CoresPerSocket=112 ThreadsPerCore=1 "
        f"RealMemory=2000000 Gres={gres} State=UNKNOWN",
        *[f"PartitionName={p} Nodes=localhost Default={'YES' if p == 'gpu' else 'NO'} MaxTime=INFINITE State=UP"
          for p in parts], ""])


def running() -> bool:
    if not shutil.which("sinfo"):
        return False
    r = _run("sinfo", "-h", "-o", "%T")
    return r.returncode == 0 and any(state in r.stdout for state in ("idle", "mix", "alloc"))


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
    DEVICES.mkdir(exist_ok=True)
    files = []
    for gtype, n, _ in GPUS:
        for i in range(n):
            dev = DEVICES / f"{gtype}{i}"
            if not dev.exists():
                os.mknod(dev, 0o666 | 0o020000, os.makedev(1, 3))  # a character device, like /dev/null
        files.append(f"NodeName=localhost Name=gpu Type={gtype} File={DEVICES}/{gtype}[0-{n - 1}]")
    ETC.mkdir(parents=True, exist_ok=True)
    (ETC / "slurm.conf").write_text(_config(socket.gethostname().split(".")[0]))
    (ETC / "gres.conf").write_text("\n".join(files) + "\n")
    munge_run = Path("/run/munge")
    munge_run.mkdir(exist_ok=True)
    shutil.chown(munge_run, "munge", "munge")
    for cmd in (["runuser", "-u", "munge", "--", "/usr/sbin/munged"], ["/usr/sbin/slurmctld"],
                ["/usr/sbin/slurmd", "-N", "localhost"]):
        r = _run(*cmd)
        if r.returncode:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed: {r.stderr.strip()[-500:]}")
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        r = _run("sinfo", "-h", "-o", "%T")
        if "idle" in r.stdout:
            return True
        if "inval" in r.stdout or "down" in r.stdout or "drain" in r.stdout:
            _run("scontrol", "update", "nodename=localhost", "state=resume")
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
