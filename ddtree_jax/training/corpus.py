"""A Python-source training corpus gathered from the machine it runs on.

Sources:
  * the standard library (`sysconfig.get_paths()["stdlib"]`, PSF licence), and
  * installed distributions whose licence metadata (importlib.metadata) is permissive:
    MIT / BSD / Apache-2.0 / PSF / ISC style only. Evidence is read in this order:
    `License-Expression` (SPDX, PEP 639), then a short `License` field, then the
    `License :: ...` classifiers. Every distribution is recorded in the manifest with its
    version, the evidence used and why it was accepted or rejected.

Files inside vendored / third-party directories are skipped (their licence is not the
distribution's). Files that are not UTF-8, contain NUL bytes or very long lines, are tiny or
bigger than `max_file_bytes` are skipped; byte-identical duplicates are kept once.

Selection and split are deterministic functions of the relative paths only:
  * when the candidates exceed `max_bytes`, files are taken in the order of
    sha256("select:" + relpath) until the cap is reached (a uniform, seed-free sample), and
    no single distribution takes more than `max_source_fraction` of it (large, internally
    repetitive packages such as transformers would otherwise dominate; stdlib is not capped);
  * a file is held out iff sha256("split:" + relpath) maps below `heldout_fraction`.
The manifest lists every file (path, size, sha256, split, source) and a hash of the whole corpus.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata as md
import os
import platform
import re
import sys
import sysconfig
from typing import Iterable

STDLIB = "stdlib"
MANIFEST_VERSION = 1

# SPDX ids accepted (MIT / BSD / Apache / PSF / ISC families). Everything else is rejected.
PERMISSIVE_SPDX = {
    "mit", "mit-0", "bsd-2-clause", "bsd-3-clause", "0bsd", "apache-2.0", "psf-2.0", "python-2.0", "isc",
}
# SPDX exceptions that do not restrict use (Apache-2.0 WITH LLVM-exception).
PERMISSIVE_EXCEPTIONS = {"llvm-exception"}
# Free-text aliases seen in `License` fields -> SPDX id.
LICENSE_ALIASES = {
    "mit": "mit", "mit license": "mit", "the mit license": "mit", "mit license (mit)": "mit", "expat": "mit",
    "bsd": "bsd-3-clause", "bsd license": "bsd-3-clause", "new bsd license": "bsd-3-clause",
    "3-clause bsd license": "bsd-3-clause", "bsd 3-clause": "bsd-3-clause", "bsd-3": "bsd-3-clause",
    "modified bsd": "bsd-3-clause", "simplified bsd": "bsd-2-clause", "bsd 2-clause": "bsd-2-clause",
    "apache": "apache-2.0", "apache 2.0": "apache-2.0", "apache 2": "apache-2.0", "apache-2": "apache-2.0",
    "apache license 2.0": "apache-2.0", "apache license, version 2.0": "apache-2.0",
    "apache 2.0 license": "apache-2.0", "apache software license": "apache-2.0", "apache license": "apache-2.0",
    "apache software license 2.0": "apache-2.0", "apache license version 2.0": "apache-2.0",
    "isc license": "isc", "isc license (iscl)": "isc", "iscl": "isc",
    "psf": "psf-2.0", "psf license": "psf-2.0", "python software foundation license": "psf-2.0",
}
PERMISSIVE_CLASSIFIERS = {
    "License :: OSI Approved :: MIT License",
    "License :: OSI Approved :: MIT No Attribution License (MIT-0)",
    "License :: OSI Approved :: BSD License",
    "License :: OSI Approved :: Apache Software License",
    "License :: OSI Approved :: ISC License (ISCL)",
    "License :: OSI Approved :: Python Software Foundation License",
}
# Distributions never used even when permissive: this project itself (it changes under us).
EXCLUDED_DISTRIBUTIONS = {"ddtree-jax"}
# Directories whose files belong to someone else (vendored copies) or are not source.
SKIP_DIR_NAMES = {
    "__pycache__", "site-packages", "dist-packages", "_vendor", "vendor", "vendored", "_vendored",
    "third_party", "thirdparty", "third-party", "_bundled", "externals",
}
MIN_FILE_BYTES = 64
MAX_LINE_CHARS = 2000


# ---- licences -------------------------------------------------------------------------
def _spdx_permissive(expr: str) -> tuple[bool, str]:
    """Is an SPDX expression permissive under our allowlist? (OR: any branch; AND: all terms)."""
    text = expr.strip()
    if not text:
        return False, "empty licence expression"
    if "(" in text or ")" in text:
        # Conservative: with parentheses, every id must be permissive.
        ids = [t for t in re.split(r"[\s()]+", text) if t and t.upper() not in ("AND", "OR", "WITH")]
        bad = [t for t in ids if t.lower() not in PERMISSIVE_SPDX | PERMISSIVE_EXCEPTIONS]
        return (not bad), ("all terms permissive" if not bad else f"non-permissive terms {bad}")
    branches = re.split(r"\s+OR\s+", text, flags=re.I)
    reasons = []
    for branch in branches:
        terms = re.split(r"\s+AND\s+", branch, flags=re.I)
        bad = []
        for term in terms:
            parts = re.split(r"\s+WITH\s+", term, flags=re.I)
            lic = parts[0].strip().lower()
            lic = LICENSE_ALIASES.get(lic, lic)
            exc = parts[1].strip().lower() if len(parts) > 1 else None
            if lic not in PERMISSIVE_SPDX or (exc is not None and exc not in PERMISSIVE_EXCEPTIONS):
                bad.append(term.strip())
        if not bad:
            return True, f"permissive branch '{branch.strip()}'"
        reasons.append(f"non-permissive terms {bad}")
    return False, "; ".join(reasons)


def license_decision(metadata) -> tuple[bool, str, str]:
    """(accepted, licence as declared, evidence/reason) for one distribution's metadata."""
    expr = metadata.get("License-Expression")
    if expr:
        ok, why = _spdx_permissive(expr)
        return ok, expr, f"License-Expression '{expr}': {why}"
    field = (metadata.get("License") or "").strip()
    if field and len(field) <= 80 and "\n" not in field:
        low = field.lower().rstrip(".")
        if low in LICENSE_ALIASES:
            return True, field, f"License field '{field}' = {LICENSE_ALIASES[low]}"
        if re.search(r"\b(and|or|with)\b", low) or re.fullmatch(r"[a-z0-9.\-+]+", low):
            ok, why = _spdx_permissive(field)
            return ok, field, f"License field '{field}' read as SPDX: {why}"
    classifiers = [c for c in (metadata.get_all("Classifier") or []) if c.startswith("License ::")]
    if classifiers:
        bad = [c for c in classifiers if c not in PERMISSIVE_CLASSIFIERS]
        declared = "; ".join(classifiers)
        if bad:
            return False, declared, f"licence classifiers not all permissive: {bad}"
        return True, declared, f"licence classifiers {classifiers}"
    if field:
        return False, field[:80], "License field not recognised and no licence classifiers"
    return False, "", "no licence metadata"


# ---- files ----------------------------------------------------------------------------
@dataclasses.dataclass
class CorpusFile:
    path: str  # relative path used for hashing / splitting: "stdlib/..." or "<dist>/<path>"
    source: str  # "stdlib" or the distribution name
    text: str
    size: int  # bytes (UTF-8)
    sha256: str
    split: str = "train"  # "train" | "heldout"


def _hash_unit(prefix: str, relpath: str) -> float:
    h = hashlib.sha256((prefix + relpath).encode("utf-8")).hexdigest()
    return int(h[:12], 16) / float(1 << 48)


def _read_source(abspath: str, max_file_bytes: int) -> tuple[str | None, bytes | None, str | None]:
    """(text, raw bytes, None) or (None, None, reason it was skipped)."""
    try:
        size = os.path.getsize(abspath)
    except OSError as e:
        return None, None, f"unreadable ({e.__class__.__name__})"
    if size < MIN_FILE_BYTES:
        return None, None, "too small"
    if size > max_file_bytes:
        return None, None, "too large"
    try:
        with open(abspath, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None, None, "not utf-8"
    if "\x00" in text:
        return None, None, "NUL byte"
    if max((len(line) for line in text.splitlines()), default=0) > MAX_LINE_CHARS:
        return None, None, "very long line"
    return text, raw, None


def _skip_dir(parts: Iterable[str]) -> bool:
    return any(p in SKIP_DIR_NAMES for p in parts)


def stdlib_candidates() -> list[tuple[str, str]]:
    """(relpath, abspath) of every .py file in the standard library, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIR_NAMES)
        if _skip_dir(parts):
            continue
        for name in sorted(filenames):
            if name.endswith(".py"):
                rel = "/".join(parts + [name])
                out.append((f"{STDLIB}/{rel}", os.path.join(dirpath, name)))
    return sorted(out)


def package_candidates() -> tuple[list[tuple[str, str, str]], list[dict]]:
    """Files of permissively licensed installed distributions, plus the record of every
    distribution examined. Returns ([(relpath, abspath, dist name)], [record])."""
    records: dict[str, dict] = {}
    files: list[tuple[str, str, str]] = []
    seen_paths: set[str] = set()
    dists = sorted(md.distributions(), key=lambda d: ((d.metadata.get("Name") or "").lower(), d.version or ""))
    for dist in dists:
        name = dist.metadata.get("Name") or "?"
        key = name.lower().replace("_", "-")
        if key in records:  # the same distribution seen twice on sys.path: keep the first
            continue
        accepted, declared, reason = license_decision(dist.metadata)
        rec = {"name": name, "version": dist.version, "license": declared, "accepted": accepted, "reason": reason}
        if key in EXCLUDED_DISTRIBUTIONS:
            rec.update(accepted=False, reason="excluded: this project itself")
        records[key] = rec
        if not rec["accepted"]:
            continue
        entries = dist.files
        if entries is None:
            rec.update(accepted=False, reason=rec["reason"] + "; no RECORD file list")
            continue
        for entry in entries:
            posix = str(entry).replace(os.sep, "/")
            if not posix.endswith(".py") or posix.startswith("..") or "/" not in posix and posix.startswith("."):
                continue
            parts = posix.split("/")
            if _skip_dir(parts[:-1]) or parts[0].endswith((".dist-info", ".egg-info", ".data")):
                continue
            abspath = os.path.realpath(str(dist.locate_file(entry)))
            if abspath in seen_paths or not os.path.isfile(abspath):
                continue
            seen_paths.add(abspath)
            files.append((f"{name}/{posix}", abspath, name))
    return sorted(files), [records[k] for k in sorted(records)]


@dataclasses.dataclass
class Corpus:
    files: list[CorpusFile]  # sorted by path
    sources: list[dict]  # stdlib + every distribution examined, with licence decisions
    settings: dict
    skipped: dict  # reason -> count

    def split(self, which: str) -> list[CorpusFile]:
        return [f for f in self.files if f.split == which]

    @property
    def sha256(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.path}\t{f.sha256}\t{f.split}\n".encode("utf-8"))
        return h.hexdigest()

    def manifest(self) -> dict:
        def stats(fs):
            return {"files": len(fs), "bytes": sum(f.size for f in fs)}

        return {
            "manifest_version": MANIFEST_VERSION,
            "corpus_sha256": self.sha256,
            "python": sys.version.split()[0],
            "implementation": platform.python_implementation(),
            "platform": platform.platform(terse=True),
            "settings": self.settings,
            "totals": {"all": stats(self.files), "train": stats(self.split("train")),
                       "heldout": stats(self.split("heldout"))},
            "skipped_files": dict(sorted(self.skipped.items())),
            "sources": self.sources,
            "files": [
                {"path": f.path, "size": f.size, "sha256": f.sha256, "split": f.split} for f in self.files
            ],
        }


def gather_corpus(
    max_bytes: int = 48 << 20,
    *,
    max_file_bytes: int = 200 << 10,
    heldout_fraction: float = 0.02,
    max_source_fraction: float = 0.25,
    include_packages: bool = True,
    include_stdlib: bool = True,
) -> Corpus:
    """Collect the corpus (see the module docstring). Deterministic for a given machine."""
    candidates: list[tuple[str, str, str]] = []
    sources: list[dict] = []
    if include_stdlib:
        std = stdlib_candidates()
        candidates += [(rel, path, STDLIB) for rel, path in std]
        sources.append({
            "name": STDLIB, "version": platform.python_version(), "license": "PSF-2.0", "accepted": True,
            "reason": "Python standard library (PSF License Agreement)", "root": sysconfig.get_paths()["stdlib"],
        })
    if include_packages:
        pkg_files, records = package_candidates()
        candidates += pkg_files
        sources += records
    # Uniform, path-determined selection order; ties impossible (paths are unique).
    order = sorted(candidates, key=lambda c: (_hash_unit("select:", c[0]), c[0]))
    chosen: list[CorpusFile] = []
    seen_sha: set[str] = set()
    skipped: dict[str, int] = {}
    total = 0
    per_source: dict[str, int] = {}
    source_cap = int(max_bytes * max_source_fraction)
    for rel, path, source in order:
        text, raw, why = _read_source(path, max_file_bytes)
        if why is None:
            digest = hashlib.sha256(raw).hexdigest()
            if digest in seen_sha:
                why = "duplicate content"
            elif total + len(raw) > max_bytes:
                why = "over the corpus size cap"
            elif source != STDLIB and per_source.get(source, 0) + len(raw) > source_cap:
                why = "over the per-source size cap"
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        seen_sha.add(digest)
        split = "heldout" if _hash_unit("split:", rel) < heldout_fraction else "train"
        chosen.append(CorpusFile(rel, source, text, len(raw), digest, split))
        total += len(raw)
        per_source[source] = per_source.get(source, 0) + len(raw)
        if total >= max_bytes - MIN_FILE_BYTES:
            break
    chosen.sort(key=lambda f: f.path)
    counts: dict[str, list[int]] = {}
    for f in chosen:
        c = counts.setdefault(f.source, [0, 0])
        c[0] += 1
        c[1] += f.size
    for rec in sources:
        n, b = counts.get(rec["name"], [0, 0])
        rec["files_used"], rec["bytes_used"] = n, b
    settings = {
        "max_bytes": max_bytes, "max_file_bytes": max_file_bytes, "heldout_fraction": heldout_fraction,
        "max_source_fraction": max_source_fraction,
        "include_packages": include_packages, "include_stdlib": include_stdlib,
        "min_file_bytes": MIN_FILE_BYTES, "max_line_chars": MAX_LINE_CHARS,
        "skip_dir_names": sorted(SKIP_DIR_NAMES), "permissive_spdx": sorted(PERMISSIVE_SPDX),
        "permissive_classifiers": sorted(PERMISSIVE_CLASSIFIERS),
        "selection": "files in order of sha256('select:' + path) until max_bytes",
        "split": "heldout iff sha256('split:' + path) < heldout_fraction",
    }
    return Corpus(chosen, sources, settings, skipped)
