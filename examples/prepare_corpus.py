"""Build the English training corpus of `ouro-tiny` from Debian packages, reproducibly.

    python examples/prepare_corpus.py --out .out/corpus

Every source is a Debian main package, fetched with `apt-get download` and unpacked with `dpkg -x`
(nothing is installed); `SOURCES` below lists them with their licences:
- `fortunes`, `fortunes-min`: the fortune-mod cookie files (quotations, jokes, poems, riddles),
  one document per cookie; `ascii-art` (pictures) and `ethnic` (ethnic jokes) are left out.
- `bible-kjv-text` (+ `bible-kjv`, whose `bible` program decodes it): the King James Bible, public
  domain, one document per chapter, one verse per line, verse numbers dropped.
- documentation written as English prose, one document per page or file, markup turned into plain
  text by `corpus_text.py`: the Linux kernel's Documentation/ (reStructuredText; translations,
  device-tree bindings and feature tables left out), the Python 3.11 manuals (their Sphinx
  sources), Perl's pod pages, the PostgreSQL 15 and Django manuals (HTML), Git's manual pages
  (AsciiDoc), the Debian Administrator's Handbook (English), the Debian Reference, the Debian
  Policy, the GNU coding and maintainer standards, SQLite's documentation, the GIMP User Manual,
  Vim's help files, the Advanced Bash-Scripting Guide, the Zsh manual, the Apache HTTP Server
  manual (English), the SQLAlchemy, Sphinx, CMake and Node.js manuals, Rust's books, the GNU Octave,
  Maxima and pandas manuals, and Erlang/OTP's guides and references.

Documents are de-duplicated across all sources (same text up to whitespace), then split: a document
goes to `valid.txt` when its SHA-256 says so, about 5%, else to `train.txt` (documents separated by a
line `<|endoftext|>`), so the split depends on content alone. `corpus.json` records the package
names, versions and .deb SHA-256, documents and bytes per source, the licences and the output
files' SHA-256. Needs a Debian-like machine with apt-get and dpkg (and libreadline8, which `bible`
links); the versions recorded are those of the machine's apt sources (Debian 12 here).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

from corpus_text import asciidoc_to_text, html_to_text, pod_to_text, rst_to_text, vimhelp_to_text

DOC_SEPARATOR = "<|endoftext|>"
SKIPPED_FORTUNE_FILES = {"ascii-art", "ethnic"}
VALID_PER_MILLE = 50
MIN_DOC_CHARS = 200            # shorter pages (stubs, redirects, empty indexes) are left out; cookies are kept
BIBLE_RANGE = "Gen1:1-Rev22:21"
CHAPTER_HEADING = re.compile(r"^(\S.*) (\d+)$")
VERSE_START = re.compile(r"^\s+\d+ (.*)$")


def fetch_packages(names: tuple[str, ...], workdir: Path) -> tuple[Path, list[dict[str, str]]]:
    """`apt-get download` each package into `workdir`, unpack all into `workdir/root`; returns the
    root and, per package, its name, version and the .deb's SHA-256."""
    workdir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", "download", *names], cwd=workdir, check=True, capture_output=True)
    root, records = workdir / "root", []
    for name in names:
        (deb,) = workdir.glob(f"{name}_*.deb")
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
        version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True,
                                 text=True).stdout.strip()
        records.append({"package": name, "version": version, "deb_sha256": sha256_file(deb)})
    return root, records


def read_text(path: Path) -> str:
    """A file's text, gunzipped where its name ends in .gz (Debian compresses large docs)."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="replace")


def page_documents(folder: Path, patterns: tuple[str, ...], convert: Callable[[str], str],
                   skip: Callable[[str], bool] = lambda rel: False) -> list[str]:
    """One document per file under `folder` matching `patterns` (sorted, so the order is fixed),
    converted to text; `skip` gets the path relative to `folder`."""
    paths = sorted({p for pattern in patterns for p in folder.glob(pattern) if p.is_file() and not p.is_symlink()})
    docs = [convert(read_text(p)) for p in paths if not skip(p.relative_to(folder).as_posix())]
    return [d for d in docs if len(d) >= MIN_DOC_CHARS]


def fortune_documents(root: Path) -> list[str]:
    """Every cookie of the English fortune files (cookies are separated by lines holding `%`)."""
    folder = root / "usr/share/games/fortunes"
    docs = []
    for path in sorted(folder.iterdir()):
        if path.is_symlink() or path.suffix in (".dat", ".u8") or path.name in SKIPPED_FORTUNE_FILES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        docs += [cookie.strip("\n") for cookie in re.split(r"^%$", text, flags=re.M)]
    return [d for d in docs if d.strip()]


def bible_documents(root: Path) -> list[str]:
    """The King James Bible decoded by the package's own `bible` program, one document per chapter."""
    program = root / "usr/bin/bible"
    try:
        raw = subprocess.run([str(program), "-p", str(root / "usr/lib"), BIBLE_RANGE], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"could not run {program} ({exc}); it links libreadline8: apt-get install libreadline8")
    return parse_bible(raw)


def parse_bible(raw: str) -> list[str]:
    """`bible` output (a heading "Book N" after a blank line, verses "  N text" wrapped at 80
    columns) -> "Book N\\n\\nverse\\nverse..." per chapter."""
    chapters: list[tuple[str, list[str]]] = []
    previous = ""
    for line in raw.splitlines():
        verse = VERSE_START.match(line)
        if not previous.strip() and CHAPTER_HEADING.match(line):
            chapters.append((line.strip(), []))
        elif verse and chapters:
            chapters[-1][1].append(verse.group(1).strip())
        elif line.strip() and chapters and chapters[-1][1]:
            chapters[-1][1][-1] += " " + line.strip()          # a wrapped verse continues
        previous = line
    return [heading + "\n\n" + "\n".join(verses) for heading, verses in chapters if verses]


def linux_documents(root: Path) -> list[str]:
    """The kernel's Documentation/ sources in English (translations/ is other languages; device-tree
    bindings and the per-architecture feature tables are data, not prose)."""
    skipped = ("translations/", "devicetree/bindings/", "features/")
    return page_documents(root / "usr/share/doc/linux-doc-6.1/Documentation", ("**/*.rst.gz", "**/*.txt.gz"),
                          rst_to_text, lambda rel: rel.startswith(skipped))


def python_documents(root: Path) -> list[str]:
    return page_documents(root / "usr/share/doc/python3.11/html/_sources", ("**/*.rst.txt",), rst_to_text)


def perl_documents(root: Path) -> list[str]:
    return page_documents(root / "usr/share/perl/5.36.0/pod", ("*.pod",), pod_to_text)


def postgresql_documents(root: Path) -> list[str]:
    return page_documents(root / "usr/share/doc/postgresql-doc-15/html", ("*.html",), html_to_text,
                          lambda rel: rel == "bookindex.html")


def django_documents(root: Path) -> list[str]:
    """The Django manual's pages (not its highlighted source code under _modules/ nor the indexes)."""
    skipped = ("_modules/", "_static/", "_images/", "genindex", "py-modindex", "search")
    return page_documents(root / "usr/share/doc/python-django-doc/html", ("**/*.html",), html_to_text,
                          lambda rel: rel.startswith(skipped))


def debian_documents(root: Path) -> list[str]:
    """The Debian Administrator's Handbook (English pages), the Debian Reference (English), the
    Debian Policy (Sphinx sources) and the GNU standards (their plain-text editions)."""
    return (page_documents(root / "usr/share/doc/debian-handbook/html/en-US", ("*.html",), html_to_text,
                           lambda rel: rel in ("index.html", "ix01.html"))
            + page_documents(root / "usr/share/debian-reference", ("*.en.html",), html_to_text,
                             lambda rel: rel == "index.en.html")
            + page_documents(root / "usr/share/doc/debian-policy", ("**/_sources/*.rst.txt",), rst_to_text)
            + page_documents(root / "usr/share/doc/gnu-standards", ("*.text.gz",), lambda text: text.strip()))


def git_documents(root: Path) -> list[str]:
    return page_documents(root / "usr/share/doc/git-doc", ("*.txt", "howto/*.txt", "technical/*.txt"),
                          asciidoc_to_text)


def sqlite_documents(root: Path) -> list[str]:
    """SQLite's documentation pages (its site as packaged), without the search and index pages."""
    return page_documents(root / "usr/share/doc/sqlite3", ("**/*.html",), html_to_text,
                          lambda rel: rel.startswith(("search", "toc.html", "sitemap", "keyword_index", "docs.html")))


def gimp_documents(root: Path) -> list[str]:
    return page_documents(root / "usr/share/gimp/2.0/help/en", ("*.html",), html_to_text,
                          lambda rel: rel in ("index.html", "ix01.html"))


def vim_documents(root: Path) -> list[str]:
    return page_documents(root / "usr/share/vim/vim90/doc", ("*.txt",), vimhelp_to_text)


def shell_documents(root: Path) -> list[str]:
    """The Advanced Bash-Scripting Guide and the Zsh manual (HTML)."""
    return (page_documents(root / "usr/share/doc/abs-guide/html", ("*.html",), html_to_text,
                           lambda rel: rel == "index.html")
            + page_documents(root / "usr/share/doc/zsh-doc/html", ("*.html",), html_to_text,
                             lambda rel: "Index" in rel or rel == "index.html"))


def apache_documents(root: Path) -> list[str]:
    """The Apache HTTP Server manual in English (the other language folders are translations)."""
    return page_documents(root / "usr/share/doc/apache2-doc/manual/en", ("**/*.html",), html_to_text,
                          lambda rel: rel.endswith(("index.html", "sitemap.html", "quickreference.html")))


def tools_documents(root: Path) -> list[str]:
    """The manuals of SQLAlchemy (its reStructuredText), Sphinx and CMake (their Sphinx sources)
    and Node.js (HTML pages, one per module; `all.html` repeats them)."""
    return (page_documents(root / "usr/share/doc/python-sqlalchemy-doc/rst", ("**/*.rst",), rst_to_text)
            + page_documents(root / "usr/share/doc/sphinx-doc/html/_sources", ("**/*.rst.txt",), rst_to_text)
            + page_documents(root / "usr/share/doc/cmake-data/html/_sources", ("**/*.rst.txt",), rst_to_text)
            + page_documents(root / "usr/share/doc/nodejs/api", ("*.html",), html_to_text,
                             lambda rel: rel in ("all.html", "index.html")))


def rust_documents(root: Path) -> list[str]:
    """Rust's books (The Rust Programming Language, the Reference, the Rustonomicon, Rust by Example,
    the edition, embedded, rustc and rustdoc guides); not the API reference nor print.html, which
    repeats each book whole."""
    books = ("book", "reference", "nomicon", "rust-by-example", "edition-guide", "embedded-book", "rustc", "rustdoc")
    return page_documents(root / "usr/share/doc/rust-doc/html", tuple(f"{b}/**/*.html" for b in books),
                          html_to_text, lambda rel: rel.endswith(("print.html", "toc.html")))


def math_documents(root: Path) -> list[str]:
    """The GNU Octave and Maxima manuals (texi2any HTML, one page per node) and the pandas user
    guide and reference (its Sphinx sources)."""
    return (page_documents(root / "usr/share/doc/octave/octave.html", ("*.html",), html_to_text,
                           lambda rel: "Index" in rel or rel == "index.html")
            + page_documents(root / "usr/share/doc/maxima-doc/html", ("*.html",), html_to_text,
                             lambda rel: "Index" in rel or rel in ("index.html", "maxima_toc.html"))
            + page_documents(root / "usr/share/doc/python-pandas-doc/html/_sources", ("**/*.rst.txt",),
                             rst_to_text))


def erlang_documents(root: Path) -> list[str]:
    """Erlang/OTP's guides (system documentation) and each application's user guide and reference."""
    folder = root / "usr/share/doc/erlang-doc"
    return (page_documents(folder / "doc", ("**/*.html",), html_to_text,
                           lambda rel: rel.endswith(("index.html", "man_index.html", "applications.html")))
            + page_documents(folder / "lib", ("*/doc/html/*.html",), html_to_text,
                             lambda rel: rel.endswith(("index.html", "_toc.html", "release_notes.html"))))


class Source(NamedTuple):
    name: str
    packages: tuple[str, ...]        # unpacked into one root, so that bible-kjv finds its text
    documents: Callable[[Path], list[str]]
    licence: str


SOURCES = (
    Source("fortunes", ("fortunes", "fortunes-min"), fortune_documents,
           "fortune-mod cookie files as shipped in Debian main (BSD-licensed program; quotations of many "
           "authors, see /usr/share/doc/fortunes/copyright)"),
    Source("bible", ("bible-kjv-text", "bible-kjv"), bible_documents,
           "King James Version text: public domain (the bible-kjv packaging is GPL)"),
    Source("linux", ("linux-doc-6.1",), linux_documents, "GPL-2 (the kernel's documentation; a few files "
           "dual-licensed, see /usr/share/doc/linux-doc-6.1/copyright)"),
    Source("python", ("python3.11-doc",), python_documents, "PSF License Agreement for Python 3.11 (the "
           "documentation's licence, see /usr/share/doc/python3.11-doc/copyright)"),
    Source("perl", ("perl-doc",), perl_documents, "GPL-1+ or Artistic (Perl's own terms)"),
    Source("postgresql", ("postgresql-doc-15",), postgresql_documents, "PostgreSQL Licence (BSD-like)"),
    Source("django", ("python-django-doc",), django_documents, "BSD-3-Clause (Django)"),
    Source("debian", ("debian-handbook", "debian-reference-en", "debian-policy", "gnu-standards"),
           debian_documents, "GPL-2+ or CC-BY-SA-3.0 (Handbook), GPL-2+ (Reference), GPL-2+ with parts "
           "BSD-3-Clause and FHS (Policy), GFDL-1.3+ without invariant sections (GNU standards)"),
    Source("git", ("git-doc",), git_documents, "GPL-2 (Git's documentation)"),
    Source("sqlite", ("sqlite3-doc",), sqlite_documents, "public domain (SQLite and its documentation)"),
    Source("gimp", ("gimp-help-en",), gimp_documents, "GFDL-1.2+ with no invariant sections (GIMP User "
           "Manual; the notice is in gimp-help-common's copyright file)"),
    Source("vim", ("vim-runtime",), vim_documents, "Vim licence (GPL-compatible; the help files are "
           "part of Vim's runtime, see /usr/share/doc/vim-runtime/copyright)"),
    Source("shell", ("abs-guide", "zsh-doc"), shell_documents, "public domain (Advanced Bash-Scripting "
           "Guide); Zsh licence, MIT-like (Zsh manual; the notice is in zsh-common's copyright file)"),
    Source("apache", ("apache2-doc",), apache_documents, "Apache-2.0 (Apache HTTP Server documentation)"),
    Source("tools", ("python-sqlalchemy-doc", "sphinx-doc", "cmake-doc", "nodejs-doc"), tools_documents,
           "Expat (SQLAlchemy, Node.js), BSD-2-Clause (Sphinx), BSD-3-Clause (CMake; the notice is in "
           "cmake-data's copyright file)"),
    Source("rust", ("rust-doc",), rust_documents, "MIT or Apache-2.0 (Rust's documentation)"),
    Source("math", ("octave-doc", "maxima-doc", "python-pandas-doc"), math_documents,
           "GPL-3+ (Octave manual), GPL-2 (Maxima manual), BSD-3-Clause (pandas)"),
    Source("erlang", ("erlang-doc",), erlang_documents, "Apache-2.0 (Erlang/OTP documentation)"),
)


def dedupe(docs: list[str], seen: set[str] | None = None) -> list[str]:
    """Drop repeated documents (the same cookie sits in several files, the same page in two
    manuals), so none is in both splits. `seen` carries the texts of earlier sources."""
    seen, unique = set() if seen is None else seen, []
    for doc in docs:
        key = " ".join(doc.split())
        if key not in seen:
            seen.add(key)
            unique.append(doc)
    return unique


def is_valid(doc: str) -> bool:
    digest = hashlib.sha256(doc.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 1000 < VALID_PER_MILLE


def write_split(path: Path, docs: list[str]) -> None:
    path.write_text("".join(f"{doc}\n{DOC_SEPARATOR}\n" for doc in docs), encoding="utf-8")


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, sources: tuple[Source, ...] = SOURCES) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"packages": [], "documents": {}, "files": {}, "licences": {}}
    train, valid, seen = [], [], set()
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources:
            root, records = fetch_packages(source.packages, Path(tmp) / source.name)
            # the separator line would split a document in two when read back
            docs = dedupe([d for d in source.documents(root) if DOC_SEPARATOR not in d], seen)
            held = [d for d in docs if is_valid(d)]
            train += [d for d in docs if not is_valid(d)]
            valid += held
            manifest["packages"] += records
            manifest["documents"][source.name] = {"total": len(docs), "valid": len(held),
                                                  "bytes": sum(len(d.encode("utf-8")) for d in docs)}
            manifest["licences"][source.name] = source.licence
            print(f"{source.name}: {len(docs)} documents, {manifest['documents'][source.name]['bytes']:,} bytes",
                  flush=True)
    for split, docs in (("train", train), ("valid", valid)):
        path = out / f"{split}.txt"
        write_split(path, docs)
        manifest["files"][path.name] = {"documents": len(docs), "bytes": path.stat().st_size,
                                        "sha256": sha256_file(path)}
    manifest["separator"] = DOC_SEPARATOR
    (out / "corpus.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".out/corpus", help="folder for train.txt, valid.txt, corpus.json")
    parser.add_argument("--sources", nargs="+", choices=[s.name for s in SOURCES], default=None,
                        help="only these sources (default: all)")
    args = parser.parse_args()
    sources = tuple(s for s in SOURCES if args.sources is None or s.name in args.sources)
    manifest = build(Path(args.out), sources)
    print(json.dumps(manifest["files"], indent=2))


if __name__ == "__main__":
    main()
