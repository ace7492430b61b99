"""Fetch Debian packages without installing them and unpack them into a cache, as a
source of real text for the ``corpus`` data set.

Nothing is installed and no root change is made: a package is downloaded as a ``.deb``
file (``apt-get download NAME``; without apt-get, from the mirror named in
``/etc/apt/sources.list*`` through ``urllib``, checked against the index's SHA256) and
unpacked with ``dpkg-deb -x`` (without dpkg, by reading the ``ar`` archive and its
``data.tar.*`` member in Python). Layout under ``cache_dir`` (see ``default_cache_dir``)::

    debs/NAME_VERSION_ARCH.deb           the downloaded package
    extracted/KEY/...                    its files, as they would be installed
    extracted/KEY/.ds_xc-extracted.json  written last: package, deb file, sha256

Every step is idempotent: a present ``.deb`` is not downloaded again and a folder with
its marker is not unpacked again; both are written to temporary names and moved into
place, so an interrupted run leaves nothing half-done behind.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import logging
import lzma
import os
import re
import shutil
import subprocess
import tarfile
import urllib.request
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = ".ds_xc-extracted.json"
SOURCES_FILES = ("/etc/apt/sources.list", "/etc/apt/sources.list.d/*.list",
                 "/etc/apt/sources.list.d/*.sources")


@dataclasses.dataclass(frozen=True)
class PackageSpec:
    """A package to fetch: ``pattern`` is a full-match regex of acceptable package
    names; when several match (versioned names such as ``linux-doc-6.1``), the one
    with the highest version numbers in its name is taken."""

    key: str
    pattern: str
    description: str


PACKAGES: dict[str, PackageSpec] = {spec.key: spec for spec in (
    PackageSpec("gcide", r"dict-gcide", "GNU Collaborative International Dictionary of English"),
    # "linux-doc" itself is an empty meta-package depending on linux-doc-X.Y.
    PackageSpec("linux-doc", r"linux-doc-[0-9]+(\.[0-9]+)*", "Linux kernel documentation"),
    PackageSpec("python-doc", r"python3\.[0-9]+-doc", "Python documentation"),
)}


@dataclasses.dataclass(frozen=True)
class FetchedPackage:
    """Where one fetched package lies: its name, .deb file and unpacked folder."""

    key: str
    name: str
    deb: Path
    root: Path


def default_cache_dir() -> Path:
    """``$DS_XC_CACHE/debian``, else ``$XDG_CACHE_HOME/ds_xc/debian`` or ``~/.cache/ds_xc/debian``."""
    if os.environ.get("DS_XC_CACHE"):
        return Path(os.environ["DS_XC_CACHE"]) / "debian"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ds_xc" / "debian"


def _version_key(name: str) -> tuple:
    """Numbers in a package name, for picking the newest versioned name."""
    return tuple(int(n) for n in re.findall(r"[0-9]+", name))


def pick_package(spec: PackageSpec, names: list[str]) -> str:
    """The newest name matching ``spec.pattern``; ValueError naming the pattern if none."""
    matching = sorted({n for n in names if re.fullmatch(spec.pattern, n)}, key=_version_key)
    if not matching:
        raise ValueError(f"package {spec.key!r}: no package name matches {spec.pattern!r} in the "
                         "package index (run `apt-get update`, or check /etc/apt/sources.list*)")
    return matching[-1]


# ------------------------------------------------------------------ apt-get route
def _apt_names(spec: PackageSpec) -> list[str]:
    """Package names apt-cache knows that match the spec's pattern."""
    out = subprocess.run(["apt-cache", "search", "--names-only", f"^{spec.pattern}$"],
                         capture_output=True, text=True, check=True).stdout
    return [line.split(" - ", 1)[0].strip() for line in out.splitlines() if line.strip()]


def _apt_download(name: str, folder: Path) -> Path:
    """``apt-get download name`` into a fresh folder; the path of the .deb."""
    folder.mkdir(parents=True)
    res = subprocess.run(["apt-get", "download", name], cwd=folder, capture_output=True, text=True)
    debs = sorted(folder.glob("*.deb"))
    if res.returncode != 0 or len(debs) != 1:
        raise RuntimeError(f"`apt-get download {name}` failed (exit {res.returncode}): "
                           f"{res.stderr.strip()[-500:]}")
    return debs[0]


# ------------------------------------------------------------------- mirror route
def parse_sources(texts: list[str]) -> list[tuple[str, str, str]]:
    """(uri, suite, component) of every ``deb`` entry, from one-line ``.list`` and
    deb822 ``.sources`` texts (``deb-src`` entries and commented lines are skipped)."""
    entries = []
    for text in texts:
        # Comment lines go entirely: left blank they would split a deb822 stanza.
        lines = [re.sub(r"#.*", "", line).rstrip() for line in text.splitlines()
                 if not line.lstrip().startswith("#")]
        for line in lines:  # one-line style: deb [opts] uri suite comp...
            m = re.match(r"\s*deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s+(.+)", line)
            if m:
                entries += [(m.group(2), m.group(3), c) for c in m.group(4).split()]
        for stanza in re.split(r"\n\s*\n", "\n".join(lines)):  # deb822 style
            fields = dict(re.findall(r"^([A-Za-z-]+):\s*(.*)$", stanza, flags=re.M))
            if "deb" not in fields.get("Types", "").split() or fields.get("Enabled", "yes") == "no":
                continue
            entries += [(u, s, c) for u in fields.get("URIs", "").split()
                        for s in fields.get("Suites", "").split()
                        for c in fields.get("Components", "").split()]
    return entries


def parse_packages_index(text: str) -> dict[str, dict[str, str]]:
    """Package name -> {Version, Filename, SHA256} from a Debian ``Packages`` index."""
    index = {}
    for stanza in text.split("\n\n"):
        fields = dict(re.findall(r"^(Package|Version|Filename|SHA256):\s*(\S+)", stanza, flags=re.M))
        if "Package" in fields and "Filename" in fields:
            index[fields["Package"]] = fields
    return index


def _mirror_index() -> list[tuple[str, dict]]:
    """(uri, Packages index) of the arch-independent packages of every configured source."""
    texts = [Path(p).read_text() for pattern in SOURCES_FILES for p in sorted(glob.glob(pattern))]
    entries = parse_sources(texts)
    if not entries:
        raise RuntimeError(f"no `deb` entry in {', '.join(SOURCES_FILES)}: cannot find a mirror")
    indexes = []
    for uri, suite, comp in entries:
        url = f"{uri.rstrip('/')}/dists/{suite}/{comp}/binary-all/Packages.xz"
        try:
            with urllib.request.urlopen(url, timeout=60) as resp:
                indexes.append((uri, parse_packages_index(lzma.decompress(resp.read()).decode())))
            logger.info("read the package index %s", url)
        except OSError as err:
            logger.warning("skipping package index %s: %s", url, err)
    return indexes


def _mirror_download(name: str, indexes: list[tuple[str, dict]], folder: Path) -> Path:
    """Download ``name`` from the first index that has it and check its SHA256."""
    for uri, index in indexes:
        if name in index:
            entry = index[name]
            url = f"{uri.rstrip('/')}/{entry['Filename']}"
            folder.mkdir(parents=True)
            deb = folder / os.path.basename(entry["Filename"])
            logger.info("downloading %s", url)
            with urllib.request.urlopen(url, timeout=600) as resp, open(deb, "wb") as f:
                shutil.copyfileobj(resp, f, 1 << 20)
            if "SHA256" in entry and sha256_file(deb) != entry["SHA256"]:
                raise RuntimeError(f"{url}: SHA256 differs from the package index's {entry['SHA256']}")
            return deb
    raise RuntimeError(f"package {name!r} is in no package index of the configured mirrors")


# --------------------------------------------------------------------- extraction
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_ar(data: bytes) -> dict[str, bytes]:
    """Members of a (System V / GNU) ``ar`` archive, the container of a ``.deb``."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (a .deb starts with '!<arch>\\n')")
    members, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        if header[58:60] != b"`\n":
            raise ValueError(f"corrupt ar member header at byte {pos}")
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii"))
        members[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)  # members are 2-byte aligned
    return members


def extract_deb_python(deb: Path, dest: Path) -> None:
    """Unpack the ``data.tar.*`` member of a .deb into ``dest`` without dpkg.

    gzip, xz, bzip2 and plain tar come from the standard library; zstd (used by some
    distributions) needs the ``zstandard`` module. Only what tarfile's ``data``
    filter allows is written (no absolute paths, no links out of ``dest``).
    """
    members = read_ar(deb.read_bytes())
    names = [n for n in members if n.startswith("data.tar")]
    if not names:
        raise ValueError(f"{deb}: no data.tar member (members: {sorted(members)})")
    payload = members[names[0]]
    if names[0].endswith(".zst"):
        try:
            import zstandard
        except ImportError as err:
            raise RuntimeError(f"{deb}: data.tar.zst needs dpkg-deb or the zstandard module") from err
        payload = zstandard.ZstdDecompressor().decompressobj().decompress(payload)
    with tarfile.open(fileobj=io.BytesIO(payload), mode="r:*") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:  # older Python: regular files and folders inside dest only
            safe = [m for m in tar.getmembers() if (m.isfile() or m.isdir())
                    and not os.path.isabs(m.name) and ".." not in Path(m.name).parts]
            tar.extractall(dest, members=safe)


def extract_deb(deb: Path, dest: Path) -> None:
    """``dpkg-deb -x deb dest``, or ``dpkg -x``, or the Python fallback."""
    dest.mkdir(parents=True, exist_ok=True)
    for tool in (["dpkg-deb", "-x"], ["dpkg", "-x"]):
        if shutil.which(tool[0]):
            subprocess.run(tool + [str(deb), str(dest)], check=True, capture_output=True)
            return
    logger.info("dpkg-deb and dpkg not found: unpacking %s in Python", deb.name)
    extract_deb_python(deb, dest)


# ------------------------------------------------------------------------ driver
def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def fetch_package(spec: PackageSpec, cache_dir: Path, use_apt: bool | None = None,
                  mirror_indexes: list | None = None) -> FetchedPackage:
    """Resolve, download and unpack one package into ``cache_dir`` (idempotent).

    ``mirror_indexes``: a list filled with the mirrors' package indexes on first use
    (mirror route only), so that several packages read them once.
    """
    root = cache_dir / "extracted" / spec.key
    if (root / MARKER).is_file():
        info = json.loads((root / MARKER).read_text())
        logger.info("%s: %s already unpacked in %s", spec.key, info["package"], root)
        return FetchedPackage(spec.key, info["package"], cache_dir / "debs" / info["deb"], root)
    use_apt = shutil.which("apt-get") is not None if use_apt is None else use_apt
    if use_apt:
        name = pick_package(spec, _apt_names(spec))
    else:
        mirror_indexes = [] if mirror_indexes is None else mirror_indexes
        if not mirror_indexes:  # read once, shared by the packages of one fetch
            mirror_indexes.extend(_mirror_index())
        name = pick_package(spec, [n for _, index in mirror_indexes for n in index])
    debs = cache_dir / "debs"
    found = sorted(debs.glob(f"{name}_*.deb"))
    if found:
        deb = found[-1]
    else:
        logger.info("%s: downloading %s (%s)", spec.key, name, "apt-get" if use_apt else "mirror")
        tmp = _tmp_name(debs / name)
        try:
            got = _apt_download(name, tmp) if use_apt else _mirror_download(name, mirror_indexes, tmp)
            deb = debs / got.name
            os.replace(got, deb)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("%s: unpacking %s (%.1f MB)", spec.key, deb.name, deb.stat().st_size / 1e6)
    tmp = _tmp_name(root)
    try:
        extract_deb(deb, tmp)
        (tmp / MARKER).write_text(json.dumps(
            {"package": name, "deb": deb.name, "sha256": sha256_file(deb)}, indent=1))
        shutil.rmtree(root, ignore_errors=True)  # an unmarked, partial folder
        os.replace(tmp, root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return FetchedPackage(spec.key, name, deb, root)


def fetch_packages(keys: list[str], cache_dir: str | os.PathLike | None = None,
                   use_apt: bool | None = None) -> dict[str, FetchedPackage]:
    """Fetch and unpack the packages ``keys`` (names in ``PACKAGES``); see the module doc.

    ``use_apt`` None: apt-get when it is on PATH, else the mirror route.
    """
    unknown = [k for k in keys if k not in PACKAGES]
    if unknown:
        raise ValueError(f"package keys {unknown} are invalid: allowed {sorted(PACKAGES)}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    (cache / "debs").mkdir(parents=True, exist_ok=True)
    indexes: list = []
    return {key: fetch_package(PACKAGES[key], cache, use_apt, indexes) for key in keys}


def read_marker(root: Path) -> dict | None:
    """The marker of an unpacked package folder, or None when it is not complete."""
    path = Path(root) / MARKER
    return json.loads(path.read_text()) if path.is_file() else None
