"""prepare_corpus.py's parsing, de-duplication and split (the apt download itself is not run here)."""
import prepare_corpus as pc
from looped_data import read_documents

BIBLE_OUTPUT = """
Genesis 1

  1 In the beginning God created the heaven and the earth.
  2 And the earth was without form, and void; and darkness was upon the face of
the deep. And the Spirit of God moved upon the face of the waters.

Song of Solomon 2

  1 I am the rose of Sharon, and the lily of the valleys.
"""


def test_bible_chapters_become_documents_with_wrapped_verses_joined():
    docs = pc.parse_bible(BIBLE_OUTPUT)
    assert docs == [
        "Genesis 1\n\nIn the beginning God created the heaven and the earth.\n"
        "And the earth was without form, and void; and darkness was upon the face of the deep. "
        "And the Spirit of God moved upon the face of the waters.",
        "Song of Solomon 2\n\nI am the rose of Sharon, and the lily of the valleys."]


def test_fortune_files_split_on_percent_lines_and_skip_index_and_pictures(tmp_path):
    folder = tmp_path / "usr/share/games/fortunes"
    folder.mkdir(parents=True)
    (folder / "wisdom").write_text("First cookie,\n\tindented.\n%\nSecond.\n\t\t-- Someone\n%\n")
    (folder / "wisdom.dat").write_bytes(b"\x00\x01binary index")
    (folder / "ascii-art").write_text("  /\\_/\\\n%\n")
    (folder / "wisdom.u8").symlink_to(folder / "wisdom")
    assert pc.fortune_documents(tmp_path) == ["First cookie,\n\tindented.", "Second.\n\t\t-- Someone"]


def test_dedupe_split_and_files_round_trip(tmp_path):
    docs = pc.dedupe(["a  cookie", "a cookie", "another\none"] + [f"doc {i}" for i in range(400)])
    assert docs[:2] == ["a  cookie", "another\none"]
    valid = [d for d in docs if pc.is_valid(d)]
    assert 0.02 < len(valid) / len(docs) < 0.09                   # about 5%, decided by content alone
    assert [d for d in reversed(docs) if pc.is_valid(d)] == valid[::-1]
    pc.write_split(tmp_path / "valid.txt", valid)
    assert read_documents(tmp_path / "valid.txt") == valid


def test_dedupe_carries_what_earlier_sources_saw():
    seen = set()
    assert pc.dedupe(["one page", "two"], seen) == ["one page", "two"]
    assert pc.dedupe(["one  page", "three"], seen) == ["three"]          # the same text in a second manual


def test_sources_name_their_packages_and_licences_once():
    packages = [p for s in pc.SOURCES for p in s.packages]
    assert len(packages) == len(set(packages))
    assert all(s.licence for s in pc.SOURCES)
    assert len({s.name for s in pc.SOURCES}) == len(pc.SOURCES)


def test_page_documents_read_gzip_sort_skip_and_drop_stubs(tmp_path):
    import gzip

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "page.rst.gz").write_bytes(gzip.compress(("Title\n=====\n\n" + "word " * 60).encode()))
    (tmp_path / "a.rst.gz").write_bytes(gzip.compress(b"stub"))
    (tmp_path / "skip.rst.gz").write_bytes(gzip.compress(("x " * 200).encode()))
    docs = pc.page_documents(tmp_path, ("**/*.rst.gz",), pc.rst_to_text, lambda rel: rel.startswith("skip"))
    assert docs == ["Title\n\n" + ("word " * 60).strip()]
