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
