"""Build the English training corpus of `ouro-tiny` from Debian packages, reproducibly.

    python examples/prepare_corpus.py --out .out/corpus

Sources (Debian main, fetched with `apt-get download`, unpacked with `dpkg -x`; nothing is installed):
- `fortunes`, `fortunes-min`: the fortune-mod cookie files (quotations, jokes, poems, riddles),
  one document per cookie; `ascii-art` (pictures) and `ethnic` (ethnic jokes) are left out.
- `bible-kjv-text` (+ `bible-kjv`, whose `bible` program decodes it): the King James Bible, public
  domain, one document per chapter, one verse per line, verse numbers dropped.

Writes `train.txt` and `valid.txt` (documents separated by a line `<|endoftext|>`; a document goes to
`valid` when its SHA-256 says so, about 5%, so the split does not depend on order) and
`corpus.json` (package names, versions and .deb SHA-256, document and byte counts, output SHA-256).
Needs a Debian-like machine with apt-get and dpkg (and libreadline8, which `bible` links).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import tempfile
from pathlib import Path

DOC_SEPARATOR = "<|endoftext|>"
FORTUNE_PACKAGES = ("fortunes", "fortunes-min")
BIBLE_PACKAGES = ("bible-kjv-text", "bible-kjv")
SKIPPED_FORTUNE_FILES = {"ascii-art", "ethnic"}
VALID_PER_MILLE = 50
BIBLE_RANGE = "Gen1:1-Rev22:21"
CHAPTER_HEADING = re.compile(r"^(\S.*) (\d+)$")
VERSE_START = re.compile(r"^\s+\d+ (.*)$")


def fetch_packages(names: tuple[str, ...], workdir: Path) -> tuple[Path, list[dict[str, str]]]:
    """`apt-get download` each package into `workdir`, unpack all into `workdir/root`; returns the
    root and, per package, its name, version and the .deb's SHA-256."""
    subprocess.run(["apt-get", "download", *names], cwd=workdir, check=True, capture_output=True)
    root, records = workdir / "root", []
    for name in names:
        (deb,) = workdir.glob(f"{name}_*.deb")
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
        version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True,
                                 text=True).stdout.strip()
        records.append({"package": name, "version": version, "deb_sha256": sha256_file(deb)})
    return root, records


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


def dedupe(docs: list[str]) -> list[str]:
    """Drop repeated documents (the same cookie sits in several files), so none is in both splits."""
    seen, unique = set(), []
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


def build(out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        fortunes_root, fortune_records = fetch_packages(FORTUNE_PACKAGES, Path(tmp))
        bible_dir = Path(tmp) / "bible"
        bible_dir.mkdir()
        bible_root, bible_records = fetch_packages(BIBLE_PACKAGES, bible_dir)
        sources = {"fortunes": dedupe(fortune_documents(fortunes_root)), "bible": bible_documents(bible_root)}
    manifest: dict = {"packages": fortune_records + bible_records, "documents": {}, "files": {}}
    train, valid = [], []
    for name, docs in sources.items():
        held = [d for d in docs if is_valid(d)]
        train += [d for d in docs if not is_valid(d)]
        valid += held
        manifest["documents"][name] = {"total": len(docs), "valid": len(held),
                                       "bytes": sum(len(d.encode("utf-8")) for d in docs)}
    for split, docs in (("train", train), ("valid", valid)):
        path = out / f"{split}.txt"
        write_split(path, docs)
        manifest["files"][path.name] = {"documents": len(docs), "bytes": path.stat().st_size,
                                        "sha256": sha256_file(path)}
    manifest["separator"] = DOC_SEPARATOR
    manifest["licences"] = {
        "fortunes": "fortune-mod cookie files as shipped in Debian main (BSD-licensed program; quotations "
                    "of many authors, see /usr/share/doc/fortunes/copyright)",
        "bible": "King James Version text: public domain (the bible-kjv packaging is GPL)"}
    (out / "corpus.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".out/corpus", help="folder for train.txt, valid.txt, corpus.json")
    manifest = build(Path(parser.parse_args().out))
    print(json.dumps(manifest["files"], indent=2))


if __name__ == "__main__":
    main()
