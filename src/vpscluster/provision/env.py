"""The `env` role's controller side: the exact package set to pin, and its wheelhouse.

    pinned_requirements(root="vpscluster") -> {name: version}   vpscluster's runtime closure, as
                                                                  installed here (exact versions)
    env_hash(reqs) -> str                                        one hash per environment
    build_wheelhouse(reqs, directory) -> Path                    one wheel per package, made once

Nodes often have no internet (or scarce international egress), so the controller fetches every
wheel once — `pip download` of the exact version, or, where no index has it (a local build, a
`+cpu` torch from another index, an editable vpscluster), a wheel built from the source or
re-packed from the files installed here — and the playbook pushes that wheelhouse to every node,
where pip installs with `--no-index`. The wheelhouse is kept under ~/.cache/vpscluster so later
runs push without fetching again.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from vpscluster.errors import UserError

DOWNLOAD_TIMEOUT_S = 600.0
WORKERS = 4  # pip downloads and re-packs at once


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_requirements(root: str = "vpscluster") -> dict[str, str]:
    """`root` and everything it needs at run time (no extras), at the versions installed here."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = default_environment()
    env["extra"] = ""
    found: dict[str, str] = {}
    todo = [root]
    while todo:
        name = canonical(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise UserError(f"provision env: {name} is required but not installed on this machine; "
                            f"install it here first (pip install {name})") from None
        found[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return dict(sorted(found.items()))


def env_hash(reqs: dict[str, str]) -> str:
    text = "\n".join(f"{canonical(n)}=={v}" for n, v in sorted(reqs.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def default_wheelhouse() -> Path:
    return Path("~/.cache/vpscluster/wheelhouse").expanduser() / f"py{python_version()}"


def _have_wheel(directory: Path, name: str, version: str) -> Path | None:
    for p in directory.glob("*.whl"):
        parts = p.name.split("-")
        if len(parts) >= 5 and canonical(parts[0]) == canonical(name) and parts[1] == version:
            return p
    return None


def build_wheelhouse(reqs: dict[str, str], directory: Path | None = None, say=lambda _m: None,
                     download: bool = True) -> Path:
    """One wheel per requirement in `directory` (made only where missing); returns the directory.

    Missing wheels are fetched with one `pip download` of the exact versions (one resolver run;
    pip's configured indexes and find-links, so a `+cpu` torch is found where the user's pip finds
    it). Where that fails, each one is fetched alone, and a wheel no index has is re-packed from
    the files installed here. `download=False`: no index is asked; every wheel is built from
    source or re-packed here.
    """
    directory = directory or default_wheelhouse()
    directory.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, str] = {}
    for name, version in reqs.items():
        source = _editable_source(metadata.distribution(name))
        if source:  # a working tree: its version number does not change with its code
            digest = _tree_hash(source)
            stamp = directory / f"{canonical(name)}-{version}.source-hash"
            old = _have_wheel(directory, name, version)
            if old and stamp.is_file() and stamp.read_text() == digest:
                continue
            if old:
                old.unlink()
            say(f"building {name} {version} from {source}")
            _pip(["wheel", "--no-deps", "--no-build-isolation", "-w", str(directory), str(source)])
            stamp.write_text(digest)
        elif not _have_wheel(directory, name, version):
            wanted[name] = version
    if wanted and download:
        say(f"downloading {len(wanted)} wheels")
        get = ["download", "--no-deps", "--only-binary=:all:", "-d", str(directory)]
        if not _pip([*get, *(f"{n}=={v}" for n, v in wanted.items())], check=False):
            # Something is on no index. Usually a local version (`+cpu`, `+cu121`) from an index
            # pip here does not know: fetch the rest in one go, then each local version alone.
            local = [n for n, v in wanted.items() if "+" in v]
            rest = [n for n in wanted if n not in local]
            lone = local if rest and _pip([*get, *(f"{n}=={wanted[n]}" for n in rest)], check=False) else list(wanted)
            # One pip each, a few at a time: each is mostly pip's own start-up (offline, one per
            # package of the closure: 21 s one after another on 2 cores).
            _concurrently(lambda n: _pip([*get, f"{n}=={wanted[n]}"], check=False), lone)
    missing = [name for name, version in wanted.items() if not _have_wheel(directory, name, version)]
    for name in missing:
        say(f"re-packing {name} {wanted[name]} as installed here")
    _concurrently(lambda name: repack(metadata.distribution(name), directory), missing)  # zlib runs without the GIL
    return directory


def _concurrently(fn, items: list) -> list:
    """fn(item) for every item, WORKERS at a time; the first exception is raised."""
    from concurrent.futures import ThreadPoolExecutor

    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(WORKERS, len(items))) as pool:
        return list(pool.map(fn, items))


def _pip(args: list[str], check: bool = True) -> bool:
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                              capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        if check:
            raise UserError(f"provision env: `pip {' '.join(args[:2])}` did not finish within {DOWNLOAD_TIMEOUT_S:.0f} s") from None
        return False
    if proc.returncode != 0 and check:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise UserError(f"provision env: `pip {' '.join(args)}` failed: {said[-1] if said else proc.returncode}")
    return proc.returncode == 0


def _tree_hash(root: Path) -> str:
    """A hash of a source tree's package files (what a wheel built from it would hold)."""
    h = hashlib.sha256()
    for p in sorted((root / "src").rglob("*") if (root / "src").is_dir() else root.rglob("*.py")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    for extra in ("pyproject.toml", "setup.py", "setup.cfg"):
        if (root / extra).is_file():
            h.update((root / extra).read_bytes())
    return h.hexdigest()


def _editable_source(dist) -> Path | None:
    try:
        info = json.loads(dist.read_text("direct_url.json") or "null")
    except json.JSONDecodeError:
        return None
    if not info or not info.get("url", "").startswith("file://"):
        return None
    path = Path(info["url"][len("file://"):])
    return path if (path / "pyproject.toml").is_file() or (path / "setup.py").is_file() else None


def wheel_tag(tags: list[str]) -> str:
    """The file-name tag of a wheel with these WHEEL `Tag:` lines: the compressed set
    (`py2.py3-none-any`) where they are every combination of their parts, else the first one
    this interpreter supports (a wheel named by one of its tags that pip here would skip is never
    installed on a node of the same Python)."""
    if not tags:
        return "py3-none-any"
    parts = [t.split("-") for t in tags]
    if all(len(p) == 3 for p in parts):
        uniq = [list(dict.fromkeys(p[i] for p in parts)) for i in range(3)]
        if len(uniq[0]) * len(uniq[1]) * len(uniq[2]) == len(set(tags)):
            return "-".join(".".join(u) for u in uniq)
    from packaging.tags import sys_tags

    here = {str(t) for t in sys_tags()}
    return next((t for t in tags if t in here), tags[0])


def repack(dist, directory: Path) -> Path:
    """A wheel of an installed distribution, from the files its RECORD lists (inside site-packages).

    Console scripts are not copied (pip writes them anew from entry_points.txt on install).
    """
    wheel_meta = dist.read_text("WHEEL") or ""
    tag = wheel_tag([line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")])
    name = canonical(dist.metadata["Name"]).replace("-", "_")
    path = directory / f"{name}-{dist.version}-{tag}.whl"
    base = Path(dist.locate_file(""))
    records = []
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files or []:
            rel = str(f)
            if rel.startswith("..") or rel.endswith(".pyc") or "__pycache__" in rel or rel.endswith("/RECORD") \
                    or rel.endswith("/INSTALLER") or rel.endswith("/direct_url.json"):
                continue
            src = base / rel
            if not src.is_file():
                continue
            data = src.read_bytes()
            z.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append((rel, f"sha256={digest}", str(len(data))))
        info_dir = next((str(f).split("/")[0] for f in dist.files or [] if str(f).endswith(".dist-info/METADATA")), None)
        if info_dir is None:
            raise UserError(f"provision env: cannot re-pack {name} {dist.version}: no METADATA in its RECORD")
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerows(records + [(f"{info_dir}/RECORD", "", "")])
        z.writestr(f"{info_dir}/RECORD", buf.getvalue())
    tmp.replace(path)
    return path
