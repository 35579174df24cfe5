"""A real Slurm cluster on localhost, under a temporary prefix, for the job-script tests.

One node (this machine, by its hostname), one partition, munge authentication; every
file (munge key and socket, slurm.conf, state, spool, logs, pid files) lives under the
prefix, and the controller and node daemon listen on ports chosen free, so two clusters
(two test runs) on one machine do not clash. Needs root and the Debian packages that
``tests/slurm/install_slurm.sh`` installs; the recipe and the obstacles it works around
are in ``shared/notes/slurm-local.md``.

Usage::

    cluster = SlurmCluster(prefix)
    cluster.start()
    job = cluster.sbatch("examples/slurm/pretrain_gpt.sbatch", env={...},
                         output=prefix / "job-%j.out")
    info = cluster.wait(job, {"COMPLETED"}, timeout=120)
    cluster.stop()

Daemons run in the foreground as children of this process (so they are reaped) and are
stopped by the PIDs in their pid files; a process counts as dead once ``/proc/PID/stat``
says zombie or dead or is gone (this machine's PID 1 does not reap orphans promptly, so
``kill -0`` would call a zombie alive).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "srun", "scancel", "squeue")
# Job states after which a job does not run again by itself.
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                      "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


class SlurmError(RuntimeError):
    """A Slurm command or daemon failed; the message carries the daemons' log tails."""


def which(name: str) -> Optional[str]:
    """The path of a Slurm or munge program, also looking in /usr/sbin and /sbin."""
    return shutil.which(name, path=_SEARCH_PATH)


def missing_programs() -> List[str]:
    """The programs a local cluster needs that are not installed."""
    return [name for name in DAEMONS + CLIENTS if which(name) is None]


def process_alive(pid: int) -> bool:
    """Whether PID is a live process: present in /proc and neither zombie nor dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    # The state follows the command name, which is in parentheses and may hold spaces.
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X", "x")


def free_ports(count: int) -> List[int]:
    """COUNT distinct TCP ports that are free on 127.0.0.1 right now (mext_testing's)."""
    from mext_testing import free_ports as pick

    return pick(count)


def ensure_hostname_resolves(host: str) -> None:
    """Adds ``127.0.0.1 HOST`` to /etc/hosts when HOST does not resolve (Slurm needs it)."""
    try:
        socket.gethostbyname(host)
        return
    except OSError:
        pass
    with open("/etc/hosts", "a") as hosts:
        hosts.write(f"\n127.0.0.1 {host}\n")


def parse_show(line: str) -> Dict[str, str]:
    """``scontrol show ... -o`` output (``Key=Value Key=Value ...``) as a dict."""
    # A value runs up to the next ' Key=' (values such as Command or Reason may hold
    # spaces, keys never do).
    fields = {}
    for match in re.finditer(r"(?:^|\s)([A-Za-z][\w:/]*)=(.*?)(?=\s+[A-Za-z][\w:/]*=|\s*$)",
                             line.strip()):
        fields[match.group(1)] = match.group(2)
    return fields


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return f"({path} does not exist)"
    return "\n".join(text[-lines:])


class SlurmCluster:
    """munged + slurmctld + slurmd on this machine, configured under ``prefix``."""

    def __init__(self, prefix: Path, cpus: Optional[int] = None, kill_wait_s: int = 30):
        self.prefix = Path(prefix).resolve()
        self.host = socket.gethostname()
        self.cpus = cpus or os.cpu_count() or 1
        self.kill_wait_s = kill_wait_s
        self.conf = self.prefix / "etc" / "slurm.conf"
        self.log_dir = self.prefix / "log"
        self.run_dir = self.prefix / "run"
        self.munge_socket = self.prefix / "munge" / "run" / "munge.socket"
        self.ctld_port, self.slurmd_port = free_ports(2)
        self._procs: Dict[str, subprocess.Popen] = {}
        self.pid_files = {
            "munged": self.prefix / "munge" / "run" / "munged.pid",
            "slurmctld": self.run_dir / "slurmctld.pid",
            "slurmd": self.run_dir / "slurmd.pid",
        }

    # ---------------------------------------------------------------- setup

    def env(self, extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """The environment for Slurm clients: this cluster's SLURM_CONF, no outer job's
        SLURM_* variables (the tests themselves may run inside a Slurm job)."""
        env = {**os.environ, **(extra or {})}
        env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
        env["PATH"] = _SEARCH_PATH
        env["SLURM_CONF"] = str(self.conf)
        return env

    def _write_config(self) -> None:
        for sub in ("etc", "state", "spool", f"spool/slurmd-{self.host}", "log", "run"):
            (self.prefix / sub).mkdir(parents=True, exist_ok=True)
        self.prefix.chmod(0o755)
        state = self.prefix / "state"
        self.conf.write_text("\n".join([
            "# Written by tests/slurm/cluster.py: a one-node cluster on localhost.",
            "ClusterName=megatronext",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={self.prefix / 'spool'}/slurmd-%n",
            f"SlurmctldPidFile={self.pid_files['slurmctld']}",
            f"SlurmdPidFile={self.pid_files['slurmd']}",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log_dir / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            # Without it the scheduler waits 1-3 s before starting each batch job.
            "SchedulerParameters=batch_sched_delay=0",
            "MpiDefault=none",
            "ReturnToService=2",
            # Finished jobs stay visible to `scontrol show job` for 10 minutes.
            "MinJobAge=600",
            "MailProg=/bin/true",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.log_dir / 'jobcomp.txt'}",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "InactiveLimit=0",
            f"KillWait={self.kill_wait_s}",
            "SlurmdTimeout=300",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 "
            "State=UNKNOWN",
            f"PartitionName=local Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _start_munge(self) -> None:
        base = self.prefix / "munge"
        etc, run, lib = base / "etc", base / "run", base / "lib"
        for folder, mode in ((base, 0o755), (etc, 0o700), (run, 0o755), (lib, 0o700)):
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(mode)
        key = etc / "munge.key"
        self._run([which("mungekey"), "--create", f"--keyfile={key}"], what="mungekey")
        key.chmod(0o400)
        self._spawn("munged", [which("munged"), "--foreground", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={self.pid_files['munged']}",
                               f"--log-file={self.log_dir / 'munged.log'}",
                               f"--seed-file={lib / 'munged.seed'}"])
        self._wait_for(lambda: self.munge_socket.exists(), 20, "munged's socket")

    def _spawn(self, name: str, cmd: Sequence[str]) -> None:
        out = open(self.log_dir / f"{name}.out", "ab")
        # Own session: a Ctrl-C of the test run must not reach the daemons half-way.
        self._procs[name] = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=self.env(),
                                             start_new_session=True)
        out.close()

    def _run(self, cmd: Sequence[str], what: str, timeout: float = 60,
             check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise SlurmError(f"{what} failed ({result.returncode}): {' '.join(cmd)}\n"
                             f"{result.stdout}{result.stderr}\n{self.diagnostics()}")
        return result

    def _wait_for(self, predicate, timeout: float, what: str, period: float = 0.1) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited with {proc.returncode} while waiting for "
                                     f"{what}\n{self.diagnostics()}")
            time.sleep(period)
        raise SlurmError(f"timed out after {timeout} s waiting for {what}\n{self.diagnostics()}")

    def start(self, timeout: float = 60) -> "SlurmCluster":
        """Starts munged, slurmctld and slurmd; returns once the node is idle."""
        missing = missing_programs()
        if missing:
            raise SlurmError(f"not installed: {', '.join(missing)} "
                             "(bash tests/slurm/install_slurm.sh)")
        ensure_hostname_resolves(self.host)
        self._write_config()
        self._start_munge()
        # -D: stay in the foreground (this process reaps them); -i: ignore absent state.
        self._spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait_for(lambda: self._run([which("scontrol"), "ping"], "scontrol ping",
                                         check=False).returncode == 0, timeout, "slurmctld")
        self._spawn("slurmd", [which("slurmd"), "-D", "-f", str(self.conf), "-N", self.host])
        self._wait_for(self._node_idle, timeout, f"node {self.host} to be idle", period=0.2)
        return self

    def _node_idle(self) -> bool:
        out = self._run([which("scontrol"), "show", "node", "-o", self.host], "scontrol",
                        check=False).stdout
        return parse_show(out).get("State", "").startswith("IDLE")

    # ---------------------------------------------------------------- jobs

    def sbatch(self, script, env: Optional[Mapping[str, str]] = None,
               args: Iterable[str] = (), output=None, chdir=None) -> int:
        """Submits SCRIPT with ENV added to this process's environment; returns the job id.

        Args:
            script: path of the batch script.
            env: variables for the job (sbatch exports the whole environment to it).
            args: further sbatch options; they override the script's #SBATCH lines.
            output: the job's stdout+stderr file (``%j`` is the job id).
            chdir: the job's working directory (default: this process's).
        """
        cmd = [which("sbatch"), "--parsable"]
        if output is not None:
            cmd.append(f"--output={output}")
        cmd.append(f"--chdir={chdir or os.getcwd()}")
        cmd += [*args, str(script)]
        result = subprocess.run(cmd, env=self.env(env), capture_output=True, text=True,
                                timeout=60)
        if result.returncode != 0:
            raise SlurmError(f"sbatch failed ({result.returncode}): {' '.join(cmd)}\n"
                             f"{result.stdout}{result.stderr}\n{self.diagnostics()}")
        return int(result.stdout.strip().split(";")[0])

    def job_state(self, job_id: int) -> Dict[str, str]:
        """``scontrol show job -o ID`` as a dict (JobState, Restarts, StartTime, ...)."""
        cmd = [which("scontrol"), "show", "job", "-o", str(job_id)]
        for attempt in range(3):
            # A very busy machine can make a query time out now and then: ask again.
            out = self._run(cmd, "scontrol show job", check=attempt == 2)
            if out.returncode == 0:
                break
            time.sleep(1)
        return parse_show(out.stdout)

    def wait(self, job_id: int, states: Iterable[str], timeout: float,
             output=None, predicate=None) -> Dict[str, str]:
        """Polls the job until its JobState is one of STATES (and PREDICATE(info) holds).

        Raises:
            SlurmError: on timeout, or when the job reaches a terminal state not in
                STATES; the message holds the job's record, output and the daemon logs.
        """
        states = set(states)
        deadline = time.monotonic() + timeout
        info: Dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_state(job_id)
            state = info.get("JobState", "")
            if state in states and (predicate is None or predicate(info)):
                return info
            if state in TERMINAL and state not in states:
                raise SlurmError(f"job {job_id} ended {state}, expected {sorted(states)}\n"
                                 f"{self.diagnostics(job_id, output)}")
            time.sleep(0.2)
        raise SlurmError(f"job {job_id} still {info.get('JobState')} after {timeout} s, "
                         f"expected {sorted(states)}\n{self.diagnostics(job_id, output)}")

    def requeue(self, job_id: int) -> None:
        """``scontrol requeue``: Slurm ends the running job (SIGTERM, then SIGKILL after
        KillWait) and queues it again, held for a while (see :meth:`start_now`)."""
        self._run([which("scontrol"), "requeue", str(job_id)], "scontrol requeue")

    def start_now(self, job_id: int) -> None:
        """Lets a requeued (pending) job start at once instead of after its hold-off.

        The hold-off (about 2 minutes) protects against slurmd's revocation of the previous
        run's credential, which it checks with a resolution of one second: a new run
        launched within the second of the revocation is killed at once ("Job credential
        revoked"). Waiting 1.2 s after the job is pending again is enough.
        """
        time.sleep(1.2)
        self._run([which("scontrol"), "update", f"jobid={job_id}", "StartTime=now"],
                  "scontrol update StartTime=now")

    def signal(self, job_id: int, sig: str, batch: bool = True) -> None:
        """``scancel --signal=SIG [--batch] ID`` (batch: only the batch shell)."""
        cmd = [which("scancel"), f"--signal={sig}"] + (["--batch"] if batch else [])
        self._run(cmd + [str(job_id)], "scancel --signal")

    # ---------------------------------------------------------------- teardown

    def diagnostics(self, job_id: Optional[int] = None, output=None, lines: int = 60) -> str:
        """The job's record and output and the tails of the daemon logs, for failures."""
        parts = []
        if job_id is not None:
            res = subprocess.run([which("scontrol") or "scontrol", "show", "job", str(job_id)],
                                 env=self.env(), capture_output=True, text=True, timeout=30)
            parts.append(f"--- scontrol show job {job_id}\n{res.stdout}{res.stderr}")
        if output is not None:
            path = Path(str(output).replace("%j", str(job_id)))
            parts.append(f"--- job output {path} (last {2 * lines} lines)\n"
                         f"{_tail(path, 2 * lines)}")
        for name in ("slurmctld.log", "slurmd.log", "munged.log", "slurmctld.out",
                     "slurmd.out", "munged.out"):
            path = self.log_dir / name
            if path.exists() and path.stat().st_size:
                parts.append(f"--- {path}\n{_tail(path, lines)}")
        return "\n".join(parts)

    def _pid(self, name: str) -> Optional[int]:
        try:
            return int(self.pid_files[name].read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            proc = self._procs.get(name)
            return proc.pid if proc else None

    def _job_processes(self) -> List[int]:
        """PIDs of leftover processes of this cluster's jobs (their SLURM_CONF is ours)."""
        needle = f"SLURM_CONF={self.conf}".encode() + b"\0"
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if needle in environ and process_alive(int(entry.name)):
                pids.append(int(entry.name))
        return pids

    def stop(self, timeout: float = 15) -> None:
        """Cancels all jobs, stops the daemons by PID and kills leftover job processes."""
        if "slurmctld" in self._procs and which("scancel"):
            subprocess.run([which("scancel"), "--full", f"--user={os.getuid()}"],
                           env=self.env(), capture_output=True, timeout=30)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                out = subprocess.run([which("squeue"), "-h", "-t", "R,CG", "-o", "%i"],
                                     env=self.env(), capture_output=True, text=True,
                                     timeout=30)
                if out.returncode != 0 or not out.stdout.strip():
                    break
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self._pid(name)
            if pid is None:
                continue
            for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5)):
                if not process_alive(pid):
                    break
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait_s
                while process_alive(pid) and time.monotonic() < deadline:
                    proc = self._procs.get(name)
                    if proc is not None:
                        proc.poll()  # reap our child so it does not linger as a zombie
                    time.sleep(0.05)
            proc = self._procs.pop(name, None)
            if proc is not None:
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for pid in self._job_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
