"""Node facts: a self-contained script run with each node's own Python; prints one JSON object.

It is sent to the node as source (see `vpscluster.nodeside`), so it may import only the
standard library, plus torch when the node has it. Every measurement is bounded in time:

- CPU share actually available: cgroup v1 (`cpu.cfs_quota_us / cpu.cfs_period_us`, walking up
  the hierarchy, the tightest wins) or v2 (`cpu.max`), and `sched_getaffinity`.
- Sequential read speed of the work directory: write a bounded file, fsync, drop it from the
  page cache with posix_fadvise(DONTNEED), read it back, delete it.
- Compute: matmul FLOP/s in the training dtype (fp32 on CPU, bf16 on GPUs that support it),
  repeated for at least `compute_seconds` so that a CPU quota (enforced per 100 ms period) is
  really felt. CPU seconds per wall second during it give `cpu_share_measured`, used as the CPU
  share where no quota can be read (e.g. a mount namespace without the cgroup filesystem).

Usage: python facts.py '{"address": "10.0.0.2", "workdir": "~/vpscluster", ...}'
"""

import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time


def _read(path, default=None):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def _int(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def os_facts():
    pretty = None
    for line in (_read("/etc/os-release", "") or "").splitlines():
        if line.startswith("PRETTY_NAME="):
            pretty = line.split("=", 1)[1].strip().strip('"')
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    return {
        "hostname": socket.gethostname(),
        "os": pretty or platform.platform(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "glibc": libc.split()[-1] if libc else None,
    }


def _cgroup_v1_mount(controller):
    """Mount point and root of the v1 hierarchy that carries `controller`."""
    for line in (_read("/proc/self/mountinfo", "") or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) >= 3 and rfields[0] == "cgroup" and controller in rfields[2].split(","):
            return fields[4], fields[3]
    return None, None


def cpu_quota_cores():
    """The CPU quota of this process's cgroup in cores (None when unlimited or unknown)."""
    best = None
    for line in (_read("/proc/self/cgroup", "") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "cpu" in controllers.split(","):  # cgroup v1
            mount, root = _cgroup_v1_mount("cpu")
            if not mount:
                continue
            rel = path[len(root):] if root != "/" and path.startswith(root) else path
            cur = mount + rel.rstrip("/")
            # A quota anywhere up the hierarchy limits us; the tightest one wins.
            while cur.startswith(mount):
                quota = _int(_read(cur + "/cpu.cfs_quota_us"))
                period = _int(_read(cur + "/cpu.cfs_period_us"))
                if quota and quota > 0 and period:
                    best = min(best or 1e9, quota / period)
                if cur == mount:
                    break
                cur = os.path.dirname(cur)
        elif controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):  # v2
            cur = "/sys/fs/cgroup" + path.rstrip("/")
            while cur.startswith("/sys/fs/cgroup"):
                text = _read(cur + "/cpu.max")
                if text:
                    quota, _, period = text.partition(" ")
                    if quota != "max" and _int(period):
                        best = min(best or 1e9, int(quota) / int(period))
                if cur == "/sys/fs/cgroup":
                    break
                cur = os.path.dirname(cur)
    return best


def cpu_model():
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows, else None.

    The one reader: the controller imports it from here too (calibration cache key, benchmark
    machine lines), since this file needs only the standard library.
    """
    for line in (_read("/proc/cpuinfo", "") or "").splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or None


def cpu_affinity():
    """CPUs this process may be scheduled on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def available_cpus():
    """Whole CPUs this process may really use: its affinity, capped by the cgroup CPU quota.

    A container or VPS slice limited to 0.45 of a core still shows every host core in
    os.cpu_count(); running that many threads only burns the quota faster and gets the process
    throttled mid-matmul, so the quota (rounded up) caps the count.
    """
    cpus = cpu_affinity()
    quota = cpu_quota_cores()
    if quota:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def cpu_facts():
    count = os.cpu_count() or 1
    affinity = cpu_affinity()
    quota = cpu_quota_cores()
    share = min(float(affinity), quota) if quota else float(affinity)
    return {"cpu_model": cpu_model(), "cpu_count": count,
            "cpu_affinity": affinity, "cpu_quota_cores": quota, "cpu_share": round(share, 3)}


def memory_facts():
    info = {}
    for line in (_read("/proc/meminfo", "") or "").splitlines():
        key, _, rest = line.partition(":")
        value = _int(rest.strip().split(" ")[0])
        if value is not None:
            info[key] = value * 1024
    total = info.get("MemTotal")
    # A cgroup memory limit below the machine's RAM is what this node really has.
    limit = None
    for line in (_read("/proc/self/cgroup", "") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            mount, root = _cgroup_v1_mount("memory")
            if mount:
                rel = parts[2][len(root):] if root != "/" and parts[2].startswith(root) else parts[2]
                limit = _int(_read(mount + rel.rstrip("/") + "/memory.limit_in_bytes"))
        elif len(parts) == 3 and parts[1] == "":
            text = _read("/sys/fs/cgroup" + parts[2].rstrip("/") + "/memory.max")
            limit = limit or (_int(text) if text and text != "max" else None)
    if limit and total and limit < total:
        total = limit
    return {"memory_bytes": total, "memory_available_bytes": info.get("MemAvailable")}


def tcp_facts():
    def triple(path):
        text = _read(path)
        return [int(x) for x in text.split()] if text else None

    return {
        "rmem_max": _int(_read("/proc/sys/net/core/rmem_max")),
        "wmem_max": _int(_read("/proc/sys/net/core/wmem_max")),
        "tcp_rmem": triple("/proc/sys/net/ipv4/tcp_rmem"),
        "tcp_wmem": triple("/proc/sys/net/ipv4/tcp_wmem"),
        "congestion_control": _read("/proc/sys/net/ipv4/tcp_congestion_control"),
        "available_congestion_control": (_read("/proc/sys/net/ipv4/tcp_available_congestion_control") or "").split() or None,
    }


def interface_for(address):
    """The network interface that carries `address` (what GLOO_SOCKET_IFNAME must name)."""
    if not address:
        return None
    try:
        out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        target = socket.gethostbyname(address)
    except OSError:
        target = address
    import ipaddress

    try:
        wanted = ipaddress.ip_address(target)
    except ValueError:
        return None
    # An exact address wins; else the interface whose subnet holds it (127.0.0.2 is on lo's /8).
    exact, containing = None, None
    for line in out.splitlines():
        m = re.match(r"\d+:\s+(\S+)\s+inet6?\s+(\S+)", line)
        if not m:
            continue
        name = m.group(1).split("@")[0]
        try:
            iface = ipaddress.ip_interface(m.group(2))
        except ValueError:
            continue
        if iface.ip == wanted:
            exact = exact or name
        elif wanted in iface.network and iface.network.prefixlen > 0:
            containing = containing or name
    return exact or containing


def parse_gpu_query(text):
    """`nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader,nounits`
    -> [{"name", "memory_bytes", "driver"}] (lines that do not parse are skipped)."""
    gpus = []
    for line in (text or "").strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            gpus.append({"name": parts[0], "memory_bytes": int(float(parts[1])) * 2**20, "driver": parts[2]})
        except ValueError:
            continue
    return gpus


def parse_nvidia_smi(text):
    """Plain `nvidia-smi` (its banner) or `nvidia-smi -q` -> {"driver", "driver_cuda"}: the driver
    version and the newest CUDA version that driver supports; None where absent."""
    driver = re.search(r"Driver Version\s*:?\s*([0-9][0-9.]*)", text or "")
    cuda = re.search(r"CUDA Version\s*:?\s*([0-9][0-9.]*)", text or "")
    return {"driver": driver.group(1) if driver else None, "driver_cuda": cuda.group(1) if cuda else None}


def _major_minor(version):
    m = re.match(r"(\d+)(?:\.(\d+))?", version or "")
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def cuda_pairing(smi, torch_version, torch_cuda, cuda_available, gpu_count):
    """Whether the installed torch's CUDA build fits this node's driver.

    smi: None (no nvidia-smi: no GPU), or parse_nvidia_smi's dict plus "error" when nvidia-smi
    failed. Returns {"gpu", "status", "driver", "driver_cuda", "torch_cuda", "message"}; status is
    "no GPU", "ok", "mismatch" (torch cannot use the GPU with this driver), "cpu build" (torch has
    no CUDA: the GPU sits idle), "no torch", or "driver error" (nvidia-smi cannot talk to the driver).
    A torch built for a newer CUDA minor of the same major runs on an older driver of that major
    (CUDA minor-version compatibility), so that is "ok" with a note.
    """
    out = {"gpu": smi is not None, "status": "no GPU", "driver": None, "driver_cuda": None, "torch_cuda": torch_cuda,
           "message": "no GPU (nvidia-smi not found)"}
    if smi is None:
        return out
    out.update(driver=smi.get("driver"), driver_cuda=smi.get("driver_cuda"))
    if smi.get("error") or not smi.get("driver"):
        out.update(status="driver error", message=f"nvidia-smi cannot talk to the driver: {smi.get('error') or 'no driver version'}; "
                   "install or load the NVIDIA driver")
        return out
    if not torch_version:
        out.update(status="no torch", message=f"driver {out['driver']} (CUDA {out['driver_cuda']}); torch is not installed")
        return out
    if not torch_cuda:
        out.update(status="cpu build", message=f"torch {torch_version} is a CPU build: the GPU goes unused; "
                   f"install a CUDA build of torch for CUDA <= {out['driver_cuda']}")
        return out
    have, want = _major_minor(out["driver_cuda"]), _major_minor(torch_cuda)
    if have is None or want is None:
        out.update(status="ok" if cuda_available else "mismatch",
                   message=f"driver {out['driver']}, torch built for CUDA {torch_cuda}")
    elif want[0] > have[0]:
        out.update(status="mismatch", message=f"torch {torch_version} is built for CUDA {torch_cuda} but driver "
                   f"{out['driver']} supports CUDA {out['driver_cuda']} at most: upgrade the driver, or install "
                   f"torch built for CUDA {have[0]}.x")
    elif want > have:
        out.update(status="ok", message=f"torch built for CUDA {torch_cuda} on driver {out['driver']} (CUDA "
                   f"{out['driver_cuda']}): works through CUDA minor-version compatibility (no PTX JIT)")
    else:
        out.update(status="ok", message=f"driver {out['driver']} (CUDA {out['driver_cuda']}) runs torch's CUDA {torch_cuda}")
    if out["status"] == "ok" and gpu_count and not cuda_available:
        out.update(status="mismatch", message=out["message"] + "; yet torch.cuda.is_available() is False "
                   "(driver not loaded for this user, or CUDA_VISIBLE_DEVICES hides the GPUs)")
    return out


def gpu_facts():
    gpus = []
    if shutil.which("nvidia-smi"):
        p = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"], 15)
        if p is not None and p.returncode == 0:
            gpus = parse_gpu_query(p.stdout)
    return gpus


def nvidia_smi():
    """parse_nvidia_smi of this node's `nvidia-smi`, with "error" when it fails; None: no nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None
    p = _run(["nvidia-smi"], 15)
    if p is None:
        return {"driver": None, "driver_cuda": None, "error": "nvidia-smi did not answer within 15 s"}
    found = parse_nvidia_smi(p.stdout)
    if p.returncode != 0:
        lines = (p.stdout + p.stderr).strip().splitlines()
        found["error"] = lines[0] if lines else f"exit status {p.returncode}"
    return found


def gpu_check(torch_info, gpu_count):
    return cuda_pairing(nvidia_smi(), torch_info.get("torch"), torch_info.get("cuda"),
                        bool(torch_info.get("cuda_available")), gpu_count)


TCP_SYSCTL_FILE = "/etc/sysctl.d/60-vpscluster-tcp.conf"  # what `vpscluster provision` (role tcp) writes
FIREWALL_TABLE = ("inet", "vpscluster")  # role firewall's nftables table


def _run(argv, timeout=5):
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return p


def parse_sysctl_conf(text):
    """`key = value` lines (comments skipped) -> {key: value with single spaces}."""
    out = {}
    for line in (text or "").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")) or "=" not in line:
            continue
        key, _, value = line.partition("=")
        out[key.strip()] = " ".join(value.split())
    return out


def provision_facts(workdir, overlay_interface):
    """What `vpscluster provision` left on this node: the env venv's hash (and drift from it when
    this Python is that venv), the tcp sysctls persisted vs live, the firewall table loaded, the
    overlay interface up with its address. None where it cannot be told (no permission)."""
    out = {"env_hash": None, "env_venv": None, "env_drift": None, "tcp_tuned": None, "tcp_differs": [],
           "firewall_up": None, "overlay_interface": overlay_interface, "overlay_up": False, "overlay_address": None}
    venv = os.path.join(os.path.abspath(os.path.expanduser(workdir)), "venv")
    marker = _read(os.path.join(venv, "vpscluster-env.json"))
    if marker:
        try:
            doc = json.loads(marker)
        except ValueError:
            doc = {}
        out["env_hash"], out["env_venv"] = doc.get("env_hash"), venv
        if os.path.realpath(sys.prefix) == os.path.realpath(venv):
            from importlib import metadata

            drift = []
            for name, version in sorted((doc.get("packages") or {}).items()):
                try:
                    have = metadata.version(name)
                except metadata.PackageNotFoundError:
                    have = None
                if have != version:
                    drift.append(f"{name} {have or 'missing'} (pinned {version})")
            out["env_drift"] = drift
    wanted = parse_sysctl_conf(_read(TCP_SYSCTL_FILE))
    if wanted:
        for key, value in wanted.items():
            live = _read("/proc/sys/" + key.replace(".", "/"))
            if live is None or " ".join(live.split()) != value:
                out["tcp_differs"].append(f"{key} = {live} (persisted {value})")
        out["tcp_tuned"] = not out["tcp_differs"]
    else:
        out["tcp_tuned"] = False
    if shutil.which("nft"):
        p = _run(["nft", "list", "table", *FIREWALL_TABLE])
        if p is not None:
            denied = "Operation not permitted" in (p.stderr or "")
            out["firewall_up"] = None if denied else p.returncode == 0
    else:
        out["firewall_up"] = False
    if overlay_interface:
        p = _run(["ip", "-o", "-4", "addr", "show", "dev", overlay_interface])
        if p is not None and p.returncode == 0:
            m = re.search(r"inet\s+(\S+)", p.stdout)
            out["overlay_address"] = m.group(1).split("/")[0] if m else None
            link = _run(["ip", "-o", "link", "show", "dev", overlay_interface])
            up = link is not None and link.returncode == 0 and ("state UP" in link.stdout or ",UP" in link.stdout)
            out["overlay_up"] = bool(up and out["overlay_address"])
    return out


def disk_facts(workdir, size_bytes, budget_s):
    path = os.path.abspath(os.path.expanduser(workdir))
    out = {"workdir": path, "disk_free_bytes": None, "disk_read_mb_s": None, "disk_error": None}
    try:
        os.makedirs(path, exist_ok=True)
        out["disk_free_bytes"] = shutil.disk_usage(path).free
    except OSError as e:
        out["disk_error"] = f"cannot use work directory {path}: {e.strerror}"
        return out
    name = os.path.join(path, f".vpscluster-probe-{os.getpid()}.tmp")
    block = os.urandom(1 << 20)
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written, start = 0, time.monotonic()
            while written < size_bytes and time.monotonic() - start < budget_s:
                written += os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(name, os.O_RDONLY)
        try:
            # The page cache would otherwise serve the read from memory.
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            got, start = 0, time.perf_counter()
            while time.perf_counter() - start < budget_s:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                got += len(chunk)
            seconds = time.perf_counter() - start
        finally:
            os.close(fd)
        out["disk_read_mb_s"] = round(got / 1e6 / max(seconds, 1e-6), 1)
    except OSError as e:
        out["disk_error"] = f"read test in {path} failed: {e.strerror}"
    finally:
        try:
            os.unlink(name)
        except OSError:
            pass
    return out


def torch_facts(compute_seconds):
    out = {"torch": None, "cuda": None, "cuda_available": False, "nccl": None, "gloo_available": False,
           "nccl_available": False, "flops": None, "flops_dtype": None, "flops_device": None, "torch_error": None}
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # ImportError, or a broken install
        out["torch_error"] = f"{type(e).__name__}: {e}"
        return out, []
    out["torch"] = torch.__version__.split("+")[0]
    out["torch_build"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["gloo_available"] = bool(dist.is_available() and dist.is_gloo_available())
    out["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
    gpus = []
    if torch.cuda.is_available():
        out["cuda_available"] = True
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_bytes": int(p.total_memory)})
    out.update(_matmul_flops(torch, compute_seconds))
    return out, gpus


def _matmul_flops(torch, seconds):
    if torch.cuda.is_available():
        device = "cuda"
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        n = 4096
    else:
        device, dtype, n = "cpu", torch.float32, 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.matmul(a, b)
    sync()
    done, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while True:
        torch.matmul(a, b)
        done += 1
        if done % 4 == 0 or device == "cpu":
            sync()
            if time.perf_counter() - start >= seconds:
                break
    elapsed = time.perf_counter() - start
    out = {"flops": 2.0 * n ** 3 * done / elapsed, "flops_dtype": str(dtype).replace("torch.", ""),
           "flops_device": device, "torch_threads": torch.get_num_threads()}
    if device == "cpu":
        # CPU seconds per wall second while all torch threads were busy: the share this node
        # really gets (a cgroup quota, or neighbours), also where the cgroup fs is not visible.
        out["cpu_share_measured"] = round((time.process_time() - cpu_start) / elapsed, 3)
    return out


def main(argv):
    if argv[1:2] == ["--gpu-check"]:  # only the CUDA/driver pairing (vpscluster provision asks for it)
        info = {"torch": None, "cuda": None, "cuda_available": False}
        try:
            import torch

            info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
        except Exception:
            pass
        count = len(gpu_facts())
        sys.stdout.write(json.dumps(gpu_check(info, count)) + "\n")
        return 0
    opts = json.loads(argv[1]) if len(argv) > 1 else {}
    started = time.time()
    facts = {"python": platform.python_version(), "python_executable": sys.executable}
    facts.update(os_facts())
    facts.update(cpu_facts())
    facts.update(memory_facts())
    facts["tcp"] = tcp_facts()
    facts["interface"] = interface_for(opts.get("address"))
    facts.update(disk_facts(opts.get("workdir", "~/vpscluster"), int(opts.get("disk_bytes", 64 << 20)),
                            float(opts.get("disk_budget_s", 3.0))))
    tfacts, torch_gpus = torch_facts(float(opts.get("compute_seconds", 1.0)))
    facts.update(tfacts)
    measured = facts.get("cpu_share_measured")
    if facts["cpu_quota_cores"] is None and measured is not None and measured < 0.9 * facts["cpu_share"]:
        # No quota visible (e.g. no cgroup fs in this mount namespace) yet less CPU than cores:
        # the measurement is the best estimate of what this node gets.
        facts["cpu_share"], facts["cpu_share_source"] = measured, "measured"
    else:
        facts["cpu_share_source"] = "cgroup" if facts["cpu_quota_cores"] else "affinity"
    gpus = gpu_facts()
    facts["gpus"] = gpus or torch_gpus
    facts["driver"] = gpus[0]["driver"] if gpus else None
    facts["gpu_check"] = gpu_check(tfacts, len(facts["gpus"]))
    facts["provision"] = provision_facts(opts.get("workdir", "~/vpscluster"), opts.get("overlay_interface"))
    facts["probe_seconds"] = round(time.time() - started, 3)
    sys.stdout.write(json.dumps(facts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
