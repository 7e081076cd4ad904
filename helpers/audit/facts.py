"""Facts about this machine, collected quickly and without initialising CUDA in the caller.

``collect_facts()`` starts a short child process that imports torch and asks CUDA (the only slow
part), reads everything else meanwhile (OS, limits, network, package versions from metadata,
NVML through pynvml in ``helpers.audit.gpu``, the environment, the accelerate config file),
then waits for the child.
Every value is plain JSON; secrets are redacted before anything leaves this module.

The NVML module can be injected (``nvml=``) so that GPU code paths are testable without a GPU.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from helpers import cuda_watch, redact
from helpers.audit import gpu, mpi, render

SCHEMA = 1
DEFAULT_RENDEZVOUS_PORT = 29500  # torchrun's and accelerate launch's default MASTER_PORT
PACKAGES = ("torch", "accelerate", "transformers", "deepspeed", "numpy", "nvidia-ml-py",
            "nvidia-nccl-cu12", "nvidia-nccl-cu13", "triton", "datasets", "peft", "safetensors")
# variables that shape distributed runs; nothing else from the environment is collected
ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "ACCELERATE_", "OMP_", "MASTER_", "PYTORCH_", "HF_",
                "TRANSFORMERS_", "NVIDIA_", "GLOO_", "TP_SOCKET", "FI_", "UCX_", "MKL_", "KMP_",
                "DS_", "DEEPSPEED_", "TORCHELASTIC_")
ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
             "ROLE_RANK", "GROUP_WORLD_SIZE", "LD_LIBRARY_PATH", "LD_PRELOAD",
             "TOKENIZERS_PARALLELISM")
PROBE_TIMEOUT_S = 30.0
RESOLVE_TIMEOUT_S = 1.0

# The child: imports torch and asks CUDA; prints one JSON line. CUDA is initialised only here.
TORCH_PROBE = r"""
import json, time
start = time.perf_counter()
out = {}
try:
    import torch
    out["version"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["hip"] = getattr(torch.version, "hip", None)
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        out["cudnn"] = None
    out["nccl"] = None
    if torch.version.cuda:
        try:
            out["nccl"] = ".".join(str(p) for p in torch.cuda.nccl.version())
        except Exception:
            pass
    dist = torch.distributed
    out["distributed"] = {"available": dist.is_available(),
                          "nccl": dist.is_available() and dist.is_nccl_available(),
                          "gloo": dist.is_available() and dist.is_gloo_available()}
    out["cuda_available"] = torch.cuda.is_available()
    devices = []
    for index in range(torch.cuda.device_count() if out["cuda_available"] else 0):
        props = torch.cuda.get_device_properties(index)
        devices.append({"index": index, "name": props.name, "memory_bytes": props.total_memory,
                        "capability": f"{props.major}.{props.minor}", "bf16": props.major >= 8})
    out["devices"] = devices
except BaseException as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["seconds"] = round(time.perf_counter() - start, 3)
print(json.dumps(out))
"""


class Facts(dict):
    """The facts as a plain dict (JSON as it is), with an HTML summary for notebooks."""

    def __repr__(self) -> str:
        torch = self.get("torch") or {}
        return (f"Facts(host={self.get('hostname')!r}, {len(self.get('gpus') or [])} GPU(s), "
                f"torch {torch.get('version')}, {len(self.get('env') or {})} variables)")

    def _repr_html_(self) -> str:
        return render.facts_html(self)


# ---------------------------------------------------------------------------------------------
# the entry point


def utc_now() -> str:
    """The time now, UTC, ISO 8601 to the second."""
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())


def collect_facts(anonymize: bool = False, nvml: Any = None,
                  probe_timeout_s: float = PROBE_TIMEOUT_S, hostfile: str | None = None) -> Facts:
    """Collect this machine's facts (see the module docstring); never initialises CUDA here.

    ``nvml`` replaces the pynvml module (tests pass a fake). ``anonymize`` replaces host names,
    user names and home folders. Secrets are always redacted. ``hostfile`` (an MPI hostfile)
    makes the MPI facts relevant (``helpers.audit.mpi``; also relevant when mpirun is on PATH or
    the accelerate config asks for MULTI_CPU).
    """
    probe = _start_torch_probe()
    smi = gpu.start_nvidia_smi_topo()
    resolver = _start_hostname_resolution()
    facts: dict[str, Any] = {
        "schema": SCHEMA,
        "collected_at": utc_now(),
        "hostname": socket.gethostname(),
        "anonymized": anonymize,
        "python": {"version": platform.python_version(), "implementation":
                   platform.python_implementation(), "executable": sys.executable},
        "os": os_facts(),
        **cpu_memory_facts(),
        "packages": package_versions(),
        "env": redact.redact_env(relevant_env()),
    }
    facts.update(accelerate_config_facts())
    facts["mpi"] = mpi.mpi_facts(facts["accelerate_config"], hostfile)
    facts.update(gpu.gpu_facts(nvml))
    facts["topology"] = gpu.finish_topology(facts, smi)
    facts["network"] = network_facts(resolver)
    facts["torch"] = torch_facts(probe, probe_timeout_s)
    facts = redact.redact_data(facts)
    if anonymize:
        identity = redact.local_identity()
        facts = redact.anonymize_data(facts, **identity)
        facts["hostname"] = "<host>"
    return Facts(facts)


# ---------------------------------------------------------------------------------------------
# torch, in a child started first


class _Probe:
    def __init__(self, process: subprocess.Popen | None, error: str | None, started: float):
        self.process, self.error, self.started = process, error, started


def _start_torch_probe() -> _Probe:
    started = time.monotonic()
    try:
        process = subprocess.Popen([sys.executable, "-c", TORCH_PROBE], stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        return _Probe(None, f"could not start {sys.executable}: {exc}", started)
    return _Probe(process, None, started)


def _finish_probe(probe: _Probe, timeout_s: float) -> dict[str, Any]:
    if probe.process is None:
        return {"error": probe.error}
    try:
        out, err = probe.process.communicate(timeout=max(0.1, timeout_s - (time.monotonic()
                                                                           - probe.started)))
    except subprocess.TimeoutExpired:
        probe.process.kill()
        probe.process.communicate()
        return {"error": f"importing torch and asking CUDA took longer than {timeout_s:g} s "
                         "(a hung driver or a very slow file system?)"}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if probe.process.returncode != 0 or not lines:
        tail = (err or out).strip().splitlines()[-3:]
        return {"error": f"the torch probe exited with code {probe.process.returncode}: "
                         + " | ".join(tail)}
    return json.loads(lines[-1])


def torch_facts(probe: _Probe, timeout_s: float) -> dict[str, Any]:
    """torch's versions and CUDA state: from the child, plus what is true in *this* process."""
    result = _finish_probe(probe, timeout_s)
    static = _static_torch_version()
    facts: dict[str, Any] = {
        "version": result.get("version", static.get("__version__")),
        "cuda": result.get("cuda", static.get("cuda")),
        "hip": result.get("hip", static.get("hip")),
        "cudnn": _cudnn_text(result.get("cudnn")),
        "nccl": result.get("nccl"),
        "cuda_available": result.get("cuda_available"),
        "devices": result.get("devices", []),
        "distributed": result.get("distributed"),
        "probe": {"ok": "error" not in result, "error": result.get("error"),
                  "seconds": result.get("seconds")},
    }
    facts.update(cuda_state_here())
    return facts


def cuda_state_here() -> dict[str, Any]:
    """Whether CUDA is already initialised in this process, and by which call (helpers.cuda_watch)."""
    try:
        cuda_watch.check_cuda_not_initialized()
    except cuda_watch.CudaInitializedError:
        return {"initialized_here": True, "init_site": cuda_watch.cuda_init_site()}
    return {"initialized_here": False, "init_site": None}


def _cudnn_text(version: Any) -> str | None:
    """cuDNN's integer version as text: 8902 -> '8.9.2' (cuDNN 8), 90100 -> '9.1.0' (cuDNN 9+)."""
    if not isinstance(version, int) or version <= 0:
        return None
    major, rest = divmod(version, 10000) if version >= 90000 else divmod(version, 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _static_torch_version() -> dict[str, Any]:
    """torch/version.py's literal assignments, read without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return {}
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return {}
    values = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and node.value is not None:
            try:
                values[target.id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return values


# ---------------------------------------------------------------------------------------------
# OS, CPU, memory


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def os_facts() -> dict[str, Any]:
    """Kernel, distribution, container and gVisor hints, /dev/shm size, ulimits."""
    release = platform.release()
    cgroup = _read("/proc/1/cgroup") or ""
    container = {
        "docker": os.path.exists("/.dockerenv"),
        "podman": os.path.exists("/run/.containerenv"),
        "kubernetes": "KUBERNETES_SERVICE_HOST" in os.environ,
        "cgroup_hint": next((word for word in ("kubepods", "docker", "containerd", "lxc", "libpod")
                             if word in cgroup), None),
    }
    container["any"] = bool(container["docker"] or container["podman"] or container["kubernetes"]
                            or container["cgroup_hint"])
    return {
        "system": platform.system(),
        "kernel": release,
        "machine": platform.machine(),
        "distro": _distro(),
        "container": container,
        "gvisor": release == "4.4.0" or "gvisor" in (_read("/proc/version") or "").lower(),
        "shm_bytes": _shm_bytes(),
        "ulimits": {"nofile": _limit(resource.RLIMIT_NOFILE),
                    "memlock": _limit(resource.RLIMIT_MEMLOCK)},
    }


def _distro() -> str | None:
    text = _read("/etc/os-release") or ""
    match = re.search(r'^PRETTY_NAME="?([^"\n]*)"?', text, re.M)
    return match.group(1) if match else None


def _shm_bytes() -> int | None:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_frsize * stat.f_blocks


def _limit(kind: int) -> dict[str, int | None]:
    """A resource limit; None means unlimited."""
    soft, hard = resource.getrlimit(kind)
    return {"soft": None if soft == resource.RLIM_INFINITY else soft,
            "hard": None if hard == resource.RLIM_INFINITY else hard}


def cpu_memory_facts() -> dict[str, Any]:
    """Usable CPUs (affinity and cgroup quota), RAM (and the cgroup limit), NUMA nodes."""
    total = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = total
    quota = _cgroup_cpu_quota()
    if quota is not None:
        usable = max(1, min(usable, int(quota + 0.999)))
    meminfo = _read("/proc/meminfo") or ""
    match = re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M)
    nodes = [p for p in Path("/sys/devices/system/node").glob("node[0-9]*")]
    return {
        "cpu_count": usable,
        "cpu_count_total": total,
        "cpu_quota": quota,
        "memory_bytes": int(match.group(1)) * 1024 if match else None,
        "memory_limit_bytes": _cgroup_memory_limit(),
        "numa_nodes": len(nodes) or None,
    }


def _cgroup_cpu_quota() -> float | None:
    text = _read("/sys/fs/cgroup/cpu.max")
    if text:
        quota, _, period = text.strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period or 100000)
    quota_v1 = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    period_v1 = _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    if quota_v1 and period_v1 and int(quota_v1) > 0:
        return int(quota_v1) / int(period_v1)
    return None


def _cgroup_memory_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = (_read(path) or "").strip()
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
    return None


# ---------------------------------------------------------------------------------------------
# packages, environment, accelerate config


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed versions from package metadata (nothing is imported); absent ones are left out."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def relevant_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that shape distributed runs (see ENV_PREFIXES, ENV_NAMES), unredacted."""
    environ = dict(os.environ if environ is None else environ)
    return {name: value for name, value in sorted(environ.items())
            if name.startswith(ENV_PREFIXES) or name in ENV_NAMES}


def accelerate_config_path(environ: dict[str, str] | None = None) -> tuple[Path, str]:
    """Where accelerate's default config lives (as accelerate computes it), or the override.

    accelerate itself reads ``--config_file`` or ``$HF_HOME/accelerate/default_config.yaml``
    (HF_HOME defaulting to ``$XDG_CACHE_HOME/huggingface``, then ``~/.cache/huggingface``);
    ``ACCELERATE_CONFIG_FILE`` is honoured here so an audit can be pointed at another file.
    """
    environ = os.environ if environ is None else environ
    if environ.get("ACCELERATE_CONFIG_FILE"):
        return Path(environ["ACCELERATE_CONFIG_FILE"]).expanduser(), "ACCELERATE_CONFIG_FILE"
    cache = environ.get("XDG_CACHE_HOME", "~/.cache")
    hf_home = environ.get("HF_HOME", os.path.join(cache, "huggingface"))
    return Path(hf_home).expanduser() / "accelerate" / "default_config.yaml", "default location"


def accelerate_config_facts() -> dict[str, Any]:
    """The accelerate config file, parsed (YAML or JSON), or null when there is none."""
    path, source = accelerate_config_path()
    facts: dict[str, Any] = {"accelerate_config": None, "accelerate_config_path": str(path),
                             "accelerate_config_source": source, "accelerate_config_error": None}
    if not path.is_file():
        return facts
    try:
        text = path.read_text()
        if path.suffix == ".json":
            config = json.loads(text)
        else:
            import yaml

            config = yaml.safe_load(text)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a fact, not a crash
        facts["accelerate_config_error"] = f"{type(exc).__name__}: {exc}"
        return facts
    if not isinstance(config, dict):
        facts["accelerate_config_error"] = f"expected a mapping, found {type(config).__name__}"
        return facts
    facts["accelerate_config"] = config
    return facts


# ---------------------------------------------------------------------------------------------
# network


def _start_hostname_resolution() -> dict[str, Any]:
    """Resolve this host's name in a daemon thread (a broken DNS must not stall the audit)."""
    state: dict[str, Any] = {"hostname": socket.gethostname(), "done": threading.Event()}

    def resolve() -> None:
        try:
            infos = socket.getaddrinfo(state["hostname"], None)
            state["addresses"] = sorted({info[4][0] for info in infos})
        except OSError as exc:
            state["error"] = str(exc)
        state["done"].set()

    threading.Thread(target=resolve, name="helpers-audit-resolve", daemon=True).start()
    return state


def network_facts(resolver: dict[str, Any]) -> dict[str, Any]:
    """Host name resolution, interfaces, InfiniBand devices and the rendezvous port."""
    finished = resolver["done"].wait(RESOLVE_TIMEOUT_S)
    try:
        interfaces = sorted(name for _, name in socket.if_nameindex())
    except OSError:
        interfaces = []
    ib = Path("/sys/class/infiniband")
    return {
        "hostname": resolver["hostname"],
        "hostname_resolves": (not resolver.get("error")) if finished else None,
        "resolve_error": resolver.get("error") if finished else
        f"no answer within {RESOLVE_TIMEOUT_S:g} s",
        "addresses": resolver.get("addresses", []),
        "interfaces": interfaces,
        "infiniband": sorted(p.name for p in ib.iterdir()) if ib.is_dir() else [],
        "rendezvous_port": rendezvous_port_facts(),
    }


def rendezvous_port_facts(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Is MASTER_PORT (or torchrun's default 29500) free here? Who holds it if not?"""
    environ = os.environ if environ is None else environ
    text = environ.get("MASTER_PORT", "")
    port = int(text) if text.isdigit() and 0 < int(text) < 65536 else DEFAULT_RENDEZVOUS_PORT
    facts: dict[str, Any] = {"port": port, "source": "MASTER_PORT" if text.isdigit() else "default",
                             "in_job": any(name in environ for name in
                                           ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")),
                             "free": None, "holder": None}
    if facts["in_job"]:
        return facts  # the port belongs to the job this audit runs in
    facts["free"] = port_is_free(port)
    if not facts["free"]:
        facts["holder"] = port_holder(port)
    return facts


def port_is_free(port: int) -> bool:
    """Can a server bind ``port`` on all interfaces now (as torch's TCPStore would)?"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def port_holder(port: int) -> str | None:
    """'pid 123 (python)' for the process listening on ``port``, when it can be seen."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                name = psutil.Process(conn.pid).name() if conn.pid else "?"
                return f"pid {conn.pid} ({name})"
    except Exception:  # noqa: BLE001 - permissions, races: the holder is a nicety
        return None
    return None


# ---------------------------------------------------------------------------------------------
# facts written by hand or by an older version

# a kernel release with a distribution's suffix (5.4.0-150-generic, 4.18.0-513.el8.x86_64,
# 5.15.133.1-microsoft-standard-WSL2) is Linux's; a bare 23.1.0 could be Darwin's
LINUX_RELEASE = re.compile(r"\d+(?:\.\d+)+(?=[-+_~]|\.[A-Za-z])")
LINUX_DISTROS = ("Ubuntu", "Debian", "CentOS", "Red Hat", "Rocky", "AlmaLinux", "Fedora",
                 "Amazon Linux", "SUSE", "openSUSE", "Arch Linux", "Oracle Linux", "Alpine")
MAPPINGS = ("os", "torch", "driver", "python", "network", "packages", "env")


def normalise(facts: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Facts as the rules read them, from facts written by hand or by an older version, and notes
    saying what was inferred. Pure; idempotent; nothing is guessed.

    Missing keys get their meaning only where it is unambiguous: a GPU list without ``index`` is in
    index order (as NVML and ``nvidia-smi -L`` list them); a kernel release with a distribution
    suffix, or a Linux distribution, means ``os.system`` Linux; numbers in ``env`` are the same text.
    Everything else missing stays missing, and the rules call it unknown. Raises ValueError naming
    the key when a value has the wrong type.
    """
    if not isinstance(facts, dict):
        raise ValueError(f"the facts must be a JSON object; found {type(facts).__name__}")
    facts = dict(facts)
    notes: list[str] = []
    for key in MAPPINGS:
        if key in facts and facts[key] is not None and not isinstance(facts[key], dict):
            raise ValueError(f"key {key!r} must be an object; found {type(facts[key]).__name__}")
    config = facts.get("accelerate_config")
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"key 'accelerate_config' must be an object or null; found "
                         f"{type(config).__name__}")
    if "gpus" in facts:
        facts["gpus"] = _normalise_gpus(facts["gpus"], notes)
    if isinstance(facts.get("env"), dict):
        facts["env"] = _normalise_env(facts["env"], notes)
    if isinstance(facts.get("os"), dict):
        facts["os"] = _normalise_os(facts["os"], notes)
    return facts, notes


def _normalise_gpus(gpus: Any, notes: list[str]) -> list[Any]:
    if gpus is None:
        return []
    if not isinstance(gpus, list):
        raise ValueError(f"key 'gpus' must be a list of GPU objects; found {type(gpus).__name__}")
    for position, entry in enumerate(gpus):
        if not isinstance(entry, dict):
            raise ValueError(f"key 'gpus[{position}]' must be an object; found {type(entry).__name__}")
        index = entry.get("index")
        if isinstance(index, str) and index.strip().isdigit():
            notes.append(f"gpus[{position}].index: the text {index!r} read as the number {int(index)}")
            gpus = [*gpus[:position], {**entry, "index": int(index)}, *gpus[position + 1:]]
        elif index is not None and (not isinstance(index, int) or isinstance(index, bool)):
            raise ValueError(f"key 'gpus[{position}].index' must be an integer; found {index!r}")
    missing = [p for p, entry in enumerate(gpus) if entry.get("index") is None]
    if not missing:
        return gpus
    if len(missing) < len(gpus):
        raise ValueError(f"key 'gpus[{missing[0]}].index' is missing while other GPUs have one: "
                         "their order is ambiguous")
    notes.append(f"gpus: {len(gpus)} GPU(s) without 'index', taken in list order (0-{len(gpus) - 1})")
    return [{**entry, "index": position} for position, entry in enumerate(gpus)]


def _normalise_env(env: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    fixed = {}
    for name, value in env.items():
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"key 'env.{name}' must be text; found {value!r}")
        if not isinstance(value, str):
            notes.append(f"env.{name}: the number {value!r} read as the text {str(value)!r}")
            value = str(value)
        fixed[name] = value
    return fixed


def _normalise_os(os_facts_: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    if os_facts_.get("system"):
        return os_facts_
    release, distro = os_facts_.get("kernel"), os_facts_.get("distro")
    why = None
    if isinstance(release, str) and LINUX_RELEASE.match(release):
        why = f"kernel release {release!r} has a Linux distribution's suffix"
    elif isinstance(distro, str) and distro.startswith(LINUX_DISTROS):
        why = f"distribution {distro!r}"
    if why is None:
        return os_facts_
    notes.append(f"os.system: Linux ({why})")
    return {**os_facts_, "system": "Linux"}
