"""The CUDA/driver check (nodeside/facts.py) on captured nvidia-smi outputs in their real formats
(no GPU on this machine): the driver and its CUDA version parsed from the banner and from `-q`,
torch's CUDA build judged against them, the probe problem it raises, and the "no GPU" answer of
a CPU node — the very program `provision` runs on each node."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vpscluster.nodeside import facts as nf

BANNER_535 = """Thu Dec  3 20:55:01 2026
+---------------------------------------------------------------------------------------+
| NVIDIA-SMI 535.161.07             Driver Version: 535.161.07   CUDA Version: 12.2     |
|-----------------------------------------+----------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id        Disp.A | Volatile Uncorr. ECC |
| Fan  Temp   Perf          Pwr:Usage/Cap |         Memory-Usage | GPU-Util  Compute M. |
|                                         |                      |               MIG M. |
|=========================================+======================+======================|
|   0  NVIDIA A100-SXM4-80GB          On  | 00000000:07:00.0 Off |                    0 |
| N/A   32C    P0              62W / 400W |      4MiB / 81920MiB |      0%      Default |
|                                         |                      |             Disabled |
+-----------------------------------------+----------------------+----------------------+
"""
BANNER_470 = """+-----------------------------------------------------------------------------+
| NVIDIA-SMI 470.182.03   Driver Version: 470.182.03   CUDA Version: 11.4     |
|-------------------------------+----------------------+----------------------+
| GPU  Name        Persistence-M| Bus-Id        Disp.A | Volatile Uncorr. ECC |
|   0  Tesla T4            Off  | 00000000:00:1E.0 Off |                    0 |
| N/A   41C    P8     9W /  70W |      0MiB / 15109MiB |      0%      Default |
+-------------------------------+----------------------+----------------------+
"""
QUERY_Q = """
==============NVSMI LOG==============

Timestamp                                 : Thu Dec  3 20:55:01 2026
Driver Version                            : 550.54.15
CUDA Version                              : 12.4

Attached GPUs                             : 1
GPU 00000000:07:00.0
    Product Name                          : NVIDIA H100 80GB HBM3
"""
NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the "
             "latest NVIDIA driver is installed and running.\n")
QUERY_CSV = "NVIDIA A100-SXM4-80GB, 81920, 535.161.07\nNVIDIA A100-SXM4-80GB, 81920, 535.161.07\n"


@pytest.mark.parametrize("text,driver,cuda", [
    (BANNER_535, "535.161.07", "12.2"), (BANNER_470, "470.182.03", "11.4"), (QUERY_Q, "550.54.15", "12.4"),
    (NO_DRIVER, None, None), ("", None, None),
])
def test_parse_nvidia_smi(text, driver, cuda):
    assert nf.parse_nvidia_smi(text) == {"driver": driver, "driver_cuda": cuda}


def test_parse_gpu_query():
    gpus = nf.parse_gpu_query(QUERY_CSV + "garbage line\n")
    assert gpus == [{"name": "NVIDIA A100-SXM4-80GB", "memory_bytes": 81920 * 2**20, "driver": "535.161.07"}] * 2


def pairing(text, torch="2.4.1+cu121", cuda="12.1", available=True, gpus=1, error=None):
    smi = nf.parse_nvidia_smi(text)
    if error:
        smi["error"] = error
    return nf.cuda_pairing(smi, torch, cuda, available, gpus)


def test_pairings():
    ok = pairing(BANNER_535)
    assert ok["status"] == "ok" and ok["driver"] == "535.161.07" and ok["driver_cuda"] == "12.2" and ok["torch_cuda"] == "12.1"
    minor = pairing(BANNER_535, cuda="12.4")  # newer minor of the same major: minor-version compatibility
    assert minor["status"] == "ok" and "minor-version compatibility" in minor["message"]
    old = pairing(BANNER_470)  # driver 470 (CUDA 11.4) cannot run a cu121 build
    assert old["status"] == "mismatch" and "upgrade the driver" in old["message"] and "CUDA 11.x" in old["message"]
    assert pairing(BANNER_470, torch="2.0.1+cu117", cuda="11.7")["status"] == "ok"
    cpu = pairing(QUERY_Q, torch="2.4.1+cpu", cuda=None, available=False)
    assert cpu["status"] == "cpu build" and "CUDA <= 12.4" in cpu["message"]
    assert pairing(QUERY_Q, torch=None, cuda=None, available=False)["status"] == "no torch"
    hidden = pairing(QUERY_Q, available=False)
    assert hidden["status"] == "mismatch" and "is_available() is False" in hidden["message"]
    broken = pairing(NO_DRIVER, error=NO_DRIVER.strip())
    assert broken["status"] == "driver error" and "couldn't communicate" in broken["message"]
    none = nf.cuda_pairing(None, "2.4.1+cpu", None, False, 0)
    assert none == {"gpu": False, "status": "no GPU", "driver": None, "driver_cuda": None, "torch_cuda": None,
                    "message": "no GPU (nvidia-smi not found)"}


def test_probe_problems_from_the_check():
    from vpscluster.probe.problems import find_problems

    node = {"reachable": True, "torch": "2.4.1", "gloo_available": True, "python": "3.11.7", "cuda": "12.1"}
    probe = {"nodes": [dict(node, name="a", gpu_check=pairing(BANNER_470)),
                       dict(node, name="b", gpu_check=pairing(BANNER_535)),
                       dict(node, name="c", gpu_check=pairing(QUERY_Q, torch="2.4.1+cpu", cuda=None, available=False))],
             "links": []}
    codes = {(p["code"], tuple(p["nodes"]), p["severity"]) for p in find_problems(probe)}
    assert ("cuda_driver_mismatch", ("a",), "error") in codes and ("gpu_unused", ("c",), "warning") in codes
    assert not any("b" in n for _, n, _ in codes if _ in ("cuda_driver_mismatch", "gpu_unused"))


def test_a_cpu_node_says_no_gpu_through_the_command_provision_runs(tmp_path):
    from vpscluster.cluster.node import Node
    from vpscluster.provision import gpu_check_command

    node = Node(name="n", host="127.0.0.1", workdir=str(tmp_path), python=sys.executable)
    r = subprocess.run(["bash", "-c", gpu_check_command(node)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    if doc["gpu"]:  # a GPU machine: the driver is read and judged
        assert doc["driver"] and doc["status"] in ("ok", "mismatch", "cpu build", "no torch", "driver error"), doc
    else:
        assert doc["status"] == "no GPU" and doc["message"] == "no GPU (nvidia-smi not found)"
