"""The documentation's references hold: raw results cited by the docs exist and every kept raw
result is cited; docs paths named in the code and the docs exist; decision records carry their
fields and the index lists them all. Plain file reads, no jax."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
DECISIONS = DOCS / "decisions"
CODE_DIRS = ("ddtree_jax", "pallas_kernels", "converters", "scripts", "tests")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".sh"}

# A docs path as written in prose or code: docs/ followed by path characters; a trailing "." or
# ":" ends a sentence, not the path. "*" is allowed (a glob such as docs/kernels_*.md).
DOCS_PATH = re.compile(r"docs/[A-Za-z0-9_./*-]*[A-Za-z0-9_*]")
RESULT_PATH = re.compile(r"docs/results/[A-Za-z0-9_.-]*[A-Za-z0-9_]")
DECISION_NAME = re.compile(r"\b(\d{4})-[a-z0-9]+(?:-[a-z0-9]+)*\.md\b")
RECORD_FIELDS = ("**Question.**", "**Answer.**", "**Command", "**Result", "Date:", "Device:", "Status:")


def _doc_files() -> list[Path]:
    """The documents that may cite raw results: every Markdown file under docs/ and the README."""
    return sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]


def _code_files() -> list[Path]:
    files = []
    for d in CODE_DIRS:
        files += [p for p in sorted((ROOT / d).rglob("*")) if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts]
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _exists(ref: str) -> bool:
    """Whether a docs/... reference names an existing file or directory (globs: at least one match)."""
    if "*" in ref:
        return any(ROOT.glob(ref))
    return (ROOT / ref).exists()


def cited_results() -> dict[str, list[str]]:
    """docs/results/NAME -> the documents citing it."""
    cited: dict[str, list[str]] = {}
    for doc in _doc_files():
        for ref in RESULT_PATH.findall(_read(doc)):
            if ref.rstrip("/") != "docs/results":
                cited.setdefault(ref, []).append(str(doc.relative_to(ROOT)))
    return cited


def test_every_cited_result_exists():
    missing = {ref: docs for ref, docs in cited_results().items() if not (ROOT / ref).is_file()}
    assert not missing, "cited raw results that are not in docs/results/:\n" + "\n".join(
        f"  {ref} (cited in {', '.join(sorted(set(docs)))})" for ref, docs in sorted(missing.items()))


def test_every_kept_result_is_cited():
    cited = set(cited_results())
    kept = sorted(p for p in RESULTS.rglob("*") if p.is_file())
    uncited = [str(p.relative_to(ROOT)) for p in kept if str(p.relative_to(ROOT)) not in cited]
    assert not uncited, ("raw results no document in docs/ or README.md cites (cite them by their full "
                         "docs/results/... path, or delete them):\n  " + "\n  ".join(uncited))


@pytest.mark.parametrize("where", ["code", "docs"])
def test_docs_paths_named_exist(where):
    files = _code_files() if where == "code" else _doc_files()
    missing = {}
    for path in files:
        for ref in DOCS_PATH.findall(_read(path)):
            if where == "docs" and ref.startswith("docs/results/"):
                continue  # the two results tests above
            if not _exists(ref):
                missing.setdefault(ref, set()).add(str(path.relative_to(ROOT)))
    assert not missing, f"docs paths named in the {where} that do not exist:\n" + "\n".join(
        f"  {ref} (in {', '.join(sorted(files_))})" for ref, files_ in sorted(missing.items()))


def test_decision_records_named_exist():
    names = {p.name for p in DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md")}
    missing = {}
    for path in _doc_files() + _code_files():
        for m in DECISION_NAME.finditer(_read(path)):
            if m.group(0) not in names:
                missing.setdefault(m.group(0), set()).add(str(path.relative_to(ROOT)))
    assert not missing, "decision records named that do not exist:\n" + "\n".join(
        f"  {name} (in {', '.join(sorted(files))})" for name, files in sorted(missing.items()))


def test_decision_records_have_their_fields_and_are_indexed():
    records = sorted(DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert records, "docs/decisions/ holds no records"
    ids = [p.name[:4] for p in records]
    assert len(ids) == len(set(ids)), f"duplicate decision ids: {ids}"
    index = _read(DECISIONS / "README.md")
    problems = []
    for p in records:
        text = _read(p)
        if not text.startswith(f"# {p.name[:4]}. "):
            problems.append(f"{p.name}: the title line must start with '# {p.name[:4]}. '")
        problems += [f"{p.name}: no '{field}'" for field in RECORD_FIELDS if field not in text]
        if f"]({p.name})" not in index:
            problems.append(f"{p.name}: not linked from docs/decisions/README.md")
    assert not problems, "\n".join(problems)
