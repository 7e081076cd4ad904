"""MPI facts for accelerate's MULTI_CPU launches: mpirun, the hostfile, passwordless SSH.

accelerate's troubleshooting guide (MPI section): hangs under ``accelerate launch`` with
``mpirun_hostfile`` are commonly missing passwordless SSH between the hosts of the hostfile, and
``mpirun -f hostfile -n <hosts> -ppn 1 hostname`` is the sanity check. accelerate picks the flags
by the MPI it finds (utils/launch.py ``_get_mpirun_args``): Open MPI takes ``--hostfile``,
``-n``, ``--npernode``; Intel MPI, MPICH and MVAPICH take ``-f``, ``-n``, ``-ppn``. So do we.

Collected only when relevant (``mpirun``/``mpiexec`` on PATH, or a config asking for MULTI_CPU or
naming a hostfile). SSH checks run in parallel, each bounded (``ssh -o BatchMode=yes -o
ConnectTimeout=5 HOST true`` under a deadline that kills it); the sanity run happens only when
asked (``run_sanity``), with a deadline, and leaves no process (``helpers.procs.run_process``).
"""

from __future__ import annotations

import os
import shutil
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from helpers import procs

SSH_CONNECT_TIMEOUT_S = 5
SSH_DEADLINE_S = SSH_CONNECT_TIMEOUT_S + 5  # connect, then `true`; a hung login is killed here
SSH_PARALLEL = 16
VERSION_TIMEOUT_S = 5.0
SANITY_TIMEOUT_S = 60.0
MPI_APPS = ("mpirun", "mpiexec")  # accelerate's order


def hostfile_from_config(config: Any) -> str | None:
    """The hostfile an accelerate config names (``mpirun_config.mpirun_hostfile``; the
    ``mpirun_hostfile`` of ``accelerate launch`` flags written flat also counts)."""
    if not isinstance(config, dict):
        return None
    nested = config.get("mpirun_config")
    value = nested.get("mpirun_hostfile") if isinstance(nested, dict) else None
    value = value or config.get("mpirun_hostfile")
    return str(value) if value else None


def relevant(config: Any, hostfile: str | None = None, path: str | None = None) -> str | None:
    """Why MPI facts are worth collecting here, or None when they are not."""
    if hostfile:
        return "a hostfile was given"
    if hostfile_from_config(config):
        return "the accelerate config names mpirun_hostfile"
    if isinstance(config, dict) and str(config.get("distributed_type")) == "MULTI_CPU":
        return "the accelerate config asks for MULTI_CPU"
    app = _mpi_app(path)
    return f"{app} is on PATH" if app else None


def mpi_facts(config: Any = None, hostfile: str | None = None, path: str | None = None,
              ssh_deadline_s: float = SSH_DEADLINE_S) -> dict[str, Any] | None:
    """mpirun, its version, the hostfile and SSH to each host; None when MPI is not relevant."""
    why = relevant(config, hostfile, path)
    if why is None:
        return None
    app = _mpi_app(path)
    version = _version(app) if app else None
    flavour = None if version is None else "Open MPI" if "Open MPI" in version else \
        "Intel MPI / MPICH / MVAPICH"
    facts: dict[str, Any] = {"relevant": why, "mpirun": app, "version": version,
                             "flavour": flavour, "hostfile": None, "ssh": None,
                             "sanity_command": None}
    source = "--hostfile" if hostfile else "accelerate config mpirun_hostfile"
    hostfile = hostfile or hostfile_from_config(config)
    if hostfile:
        facts["hostfile"] = read_hostfile(hostfile, source)
        hosts = facts["hostfile"]["hosts"]
        if hosts:
            facts["ssh"] = check_ssh(hosts, deadline_s=ssh_deadline_s, path=path)
            facts["sanity_command"] = sanity_command(app or "mpirun", flavour, hostfile, len(hosts))
    return facts


def _mpi_app(path: str | None = None) -> str | None:
    for name in MPI_APPS:
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


def _version(app: str) -> str | None:
    """The first line of ``mpirun --version`` (Open MPI: "mpirun (Open MPI) 4.1.4")."""
    try:
        code, output, _ = procs.run_process([app, "--version"], VERSION_TIMEOUT_S)
    except OSError:
        return None
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if code is None:
        return f"(no answer to --version within {VERSION_TIMEOUT_S:g} s)"
    return lines[0] if lines else None


def read_hostfile(path: str, source: str = "--hostfile") -> dict[str, Any]:
    """Hosts of an MPI hostfile: one per line, ``host``, ``host:slots`` (Hydra) or ``host
    slots=N`` (Open MPI); ``#`` starts a comment; a host listed twice counts once."""
    facts: dict[str, Any] = {"path": path, "source": source, "readable": False, "error": None,
                             "hosts": []}
    try:
        text = Path(path).expanduser().read_text(errors="replace")
    except OSError as exc:
        facts["error"] = f"{type(exc).__name__}: {exc.strerror or exc}"
        return facts
    facts["readable"] = True
    hosts: list[str] = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host = words[0].split(":", 1)[0]
        if host and host not in hosts:
            hosts.append(host)
    facts["hosts"] = hosts
    if not hosts:
        facts["error"] = "no host in it"
    return facts


def check_ssh(hosts: list[str], deadline_s: float = SSH_DEADLINE_S, path: str | None = None,
              extra_args: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """host -> {ok, code, error, seconds, local}: passwordless SSH to each host, in parallel.

    ``ssh -o BatchMode=yes`` never asks for a password: a host that needs one fails at once.
    """
    ssh = shutil.which("ssh", path=path)
    if ssh is None:
        return {host: {"ok": False, "code": None, "error": "no ssh client on PATH",
                       "seconds": 0.0, "local": _is_local(host)} for host in hosts}

    def one(host: str) -> dict[str, Any]:
        argv = [ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}",
                *extra_args, host, "true"]
        code, output, seconds = procs.run_process(argv, deadline_s)
        error = None
        if code is None:
            error = f"no answer within {deadline_s:g} s"
        elif code != 0:
            lines = [line.strip() for line in output.splitlines() if line.strip()]
            error = (lines[-1] if lines else f"ssh exited with code {code}")[:300]
        return {"ok": code == 0, "code": code, "error": error, "seconds": seconds,
                "local": _is_local(host)}

    with ThreadPoolExecutor(max_workers=max(1, min(SSH_PARALLEL, len(hosts)))) as pool:
        return dict(zip(hosts, pool.map(one, hosts), strict=True))


def _is_local(host: str) -> bool:
    return host in ("localhost", socket.gethostname()) or host.startswith("127.") or host == "::1"


def sanity_command(app: str, flavour: str | None, hostfile: str, hosts: int) -> list[str]:
    """The troubleshooting guide's ``mpirun -f hostfile -n <hosts> -ppn 1 hostname``, in the
    flags of the MPI found (as accelerate chooses them)."""
    if flavour == "Open MPI":
        argv = [app, "--hostfile", hostfile, "-n", str(hosts), "--npernode", "1"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            argv.append("--allow-run-as-root")  # Open MPI refuses root without it
        return [*argv, "hostname"]
    return [app, "-f", hostfile, "-n", str(hosts), "-ppn", "1", "hostname"]


def run_sanity(facts: dict[str, Any], timeout_s: float = SANITY_TIMEOUT_S) -> dict[str, Any]:
    """Run the sanity command under a deadline; ``ok`` when it exits 0 and prints one line per
    host. Every process it started is gone when this returns."""
    argv = facts.get("sanity_command")
    if not argv:
        why = "no mpirun on PATH" if not facts.get("mpirun") else "no hostfile with hosts"
        return {"ran": False, "ok": False, "command": None, "code": None, "output": "",
                "seconds": 0.0, "error": f"nothing to run: {why}"}
    try:
        code, output, seconds = procs.run_process(argv, timeout_s)
    except OSError as exc:
        return {"ran": False, "ok": False, "command": argv, "code": None, "output": "",
                "seconds": 0.0, "error": f"could not start {argv[0]}: {exc}"}
    hosts = len((facts.get("hostfile") or {}).get("hosts") or [])
    lines = [line for line in output.splitlines() if line.strip()]
    error = None
    if code is None:
        error = f"no end within {timeout_s:g} s (stopped): a host that does not answer?"
    elif code != 0:
        error = f"exited with code {code}"
    elif len(lines) != hosts:
        error = f"printed {len(lines)} line(s) for {hosts} host(s)"
    return {"ran": True, "ok": error is None, "command": argv, "code": code,
            "output": output[-4000:], "seconds": seconds, "error": error}
