"""The demo model's training text: Python's documentation as plain prose, and question/answer
pairs made from it.

Source: the reStructuredText sources of the Python 3.11 documentation as Debian ships them
(package ``python3.11-doc``, ``/usr/share/doc/python3.11/html/_sources``), under the PSF
License Agreement (the documentation's licence; its code examples are under Zero-Clause
BSD): permissive, and the text is shipped compressed in ``moeserve/data`` with the licence
named in ``docs/demo_model.md``. Modern, plain English prose about one subject, which suits a
model of a few million parameters trained in two hours.

What it keeps: the prose paragraphs and section titles of the tutorial, the library and
language references, the how-tos, the FAQ, the glossary, "using", "what's new", the C API,
"extending" and the (distutils-era) installing and distributing guides; markup is reduced to
its text (``:func:`len``` -> ``len()``, ``:ref:`text <target>``` -> ``text``, ````x```` ->
``x``). What it drops: code (literal blocks, doctests), tables, comments, index entries,
version notes and every directive's body but the admonitions' (so the C API's per-function
entries). The question/answer pairs:

- the glossary: "What is a <term>?" -> the first paragraph of its definition;
- each documented function, method and class: "What does <name>() do?" (a class: "What is
  <name>?") -> the first paragraph of its description.

Deterministic (files in sorted order). Writes ``moeserve/data/demo_text.txt.xz`` (paragraphs
separated by blank lines) and ``moeserve/data/demo_qa.jsonl.xz`` (``{"q": ..., "a": ...}``).

    apt-get install python3.11-doc     # scripts/install_system_deps.sh does not: only here
    python scripts/demo_corpus.py [--sources DIR] [--out-dir moeserve/data]
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
from pathlib import Path

SOURCES = Path("/usr/share/doc/python3.11/html/_sources")
PARTS = (
    "tutorial",
    "library",
    "reference",
    "howto",
    "faq",
    "using",
    "glossary.rst.txt",
    "whatsnew",
    "c-api",
    "extending",
    "install",
    "installing",
    "distributing",
    "distutils",
)
OUT_DIR = Path(__file__).resolve().parent.parent / "moeserve" / "data"

API = re.compile(r"^\.\. (function|method|class|exception|classmethod|staticmethod)::\s*(.+)$")
ROLE = re.compile(r":[a-z:]+:`([^`<]*?)(?:\s*<[^`>]*>)?`")
LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`_+")
UNDERLINE = re.compile(r"^([=\-~^\"'*#+`:.])\1{2,}\s*$")


def inline(text: str) -> str:
    """reST inline markup reduced to its text."""

    def role(m: re.Match) -> str:
        word = m.group(1)
        if word.startswith("~"):  # Sphinx: show the last dotted part only
            word = word.rsplit(".", 1)[-1]
        word = word.lstrip("~!.")
        kind = m.group(0)[1 : m.group(0).index("`") - 1]
        if kind in ("func", "meth") and word and not word.endswith(")"):
            word += "()"
        return word

    text = ROLE.sub(role, text)
    text = LINK.sub(r"\1", text)
    text = re.sub(r"``(.+?)``", r"\1", text)
    text = re.sub(r"\*\*(.+?)\*\*", r"\1", text)
    text = re.sub(r"(?<![\w*])\*(\S.*?)\*(?!\w)", r"\1", text)
    text = re.sub(r"`([^`]+)`_*", r"\1", text)
    text = re.sub(r"\|([\w-]+)\|", r"\1", text)  # substitutions
    text = re.sub(r"\s*\[(?:#\w*|\d+)\]_", "", text)  # footnote references
    return re.sub(r"\s+", " ", text).strip()


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def blocks(lines: list[str]):
    """(kind, indent, text) for each paragraph, title and API directive of one file, code
    and other directives skipped."""
    i, n = 0, len(lines)
    skip_code_after = False
    while i < n:
        line = lines[i].rstrip("\n")
        stripped = line.strip()
        if not stripped:
            i += 1
            continue
        ind = indent_of(line)
        if skip_code_after and ind > 0:  # the literal block after "::"
            while i < n and (not lines[i].strip() or indent_of(lines[i]) >= ind):
                i += 1
            skip_code_after = False
            continue
        skip_code_after = False
        api = API.match(stripped)
        if api:
            yield "api", ind, (api.group(1), api.group(2))
            i += 1
            while i < n and lines[i].strip().startswith(":"):  # its options
                i += 1
            continue
        if stripped.startswith(".. "):  # any other directive or comment: skip its body,
            keep = re.match(r"^\.\. (note|warning|tip|important|seealso|attention)::", stripped)
            i += 1
            if keep:  # admonitions are prose
                continue
            while i < n and (not lines[i].strip() or indent_of(lines[i]) > ind):
                i += 1
            continue
        if stripped.startswith((">>>", "+-", "===", "|")) or UNDERLINE.match(stripped):
            while i < n and lines[i].strip():
                i += 1
            continue
        # a title: one line, then an underline
        if i + 1 < n and UNDERLINE.match(lines[i + 1].strip()) and ind == 0:
            yield "title", 0, inline(stripped)
            i += 2
            continue
        para = []
        while i < n and lines[i].strip() and not UNDERLINE.match(lines[i].strip()):
            if lines[i].strip().startswith(">>>"):
                break
            para.append(lines[i].strip())
            i += 1
        text = " ".join(para)
        if text.endswith("::"):
            skip_code_after = True
            text = text[:-2].rstrip()
            text = text + ":" if text and text[-1] not in ".:;!?" else text
        text = inline(text.lstrip("*-#0123456789.) ") if para[0][:2] in ("* ", "- ") else text)
        if text:
            yield "para", ind, text


def prose(text: str) -> bool:
    """A paragraph of sentences, not a list of names or a signature."""
    words = text.split()
    return len(words) >= 6 and sum(w[0].isalpha() for w in words) >= 0.7 * len(words)


def first_paragraph(items, j: int, ind: int) -> str | None:
    """The first prose paragraph after item j indented deeper than ind (its body)."""
    for kind, k, text in items[j + 1 : j + 6]:
        if k <= ind:
            return None
        if kind == "para" and prose(text):
            return text
    return None


def article(term: str) -> str:
    return "an" if term[:1].lower() in "aeiou" else "a"


def read_file(path: Path, qa: list[dict], glossary: bool) -> list[str]:
    items = list(blocks(path.read_text(encoding="utf-8").splitlines()))
    out = []
    for j, (kind, ind, text) in enumerate(items):
        if kind == "title":
            out.append(text)
        elif kind == "para" and prose(text):
            out.append(text)
            if glossary and ind == 3 and j > 0:  # the term is the indented line before
                continue
        elif kind == "api":
            what, sig = text
            name = sig.split("(")[0].split(".")[-1].strip()
            body = first_paragraph(items, j, ind)
            if body and name.isidentifier():
                q = (
                    f"What is {name}?"
                    if what in ("class", "exception")
                    else f"What does {name}() do?"
                )
                qa.append({"q": q, "a": body})
    if glossary:  # term lines: a short para at indent 3 followed by its definition at 6
        for j, (kind, ind, text) in enumerate(items):
            if kind == "para" and ind == 3 and len(text.split()) <= 5:
                body = first_paragraph(items, j, ind)
                if body:
                    term = text.strip()
                    qa.append({"q": f"What is {article(term)} {term}?", "a": body})
    return out


def build(sources: Path) -> tuple[list[str], list[dict]]:
    files = []
    for part in PARTS:
        p = sources / part
        files += [p] if p.is_file() else sorted(p.rglob("*.rst.txt"))
    paragraphs, qa = [], []
    for f in files:
        paragraphs += read_file(f, qa, glossary=f.name == "glossary.rst.txt")
    return paragraphs, qa


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", type=Path, default=SOURCES)
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args()
    if not args.sources.is_dir():
        raise SystemExit(f"{args.sources}: not found (apt-get install python3.11-doc)")
    paragraphs, qa = build(args.sources)
    text = "\n\n".join(paragraphs) + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # fixed xz settings: the same text gives the same bytes
    (args.out_dir / "demo_text.txt.xz").write_bytes(lzma.compress(text.encode(), preset=9))
    lines = "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in qa)
    (args.out_dir / "demo_qa.jsonl.xz").write_bytes(lzma.compress(lines.encode(), preset=9))
    words = len(text.split())
    print(f"{len(paragraphs)} paragraphs, {words} words, {len(text) / 1e6:.1f} MB; {len(qa)} Q/A")


if __name__ == "__main__":
    main()
