"""Plain text from the documentation formats of the Debian packages in `prepare_corpus.py`:
reStructuredText (Sphinx sources), POD (Perl), AsciiDoc (Git) and HTML (DocBook, Sphinx).

The aim is readable English for a language model, not a faithful rendering: markup that a reader
would not see (section underlines, directives, link targets, inline roles, index entries) goes,
the words and code examples stay. Each function maps one file's text to one document's text.
"""
from __future__ import annotations

import html
import re
from html.parser import HTMLParser

BLANK_RUNS = re.compile(r"\n{3,}")
TRAILING_SPACE = re.compile(r"[ \t]+\n")


def tidy(text: str) -> str:
    """Trailing spaces off, at most one blank line in a row, no blank lines at the ends."""
    return BLANK_RUNS.sub("\n\n", TRAILING_SPACE.sub("\n", text.replace("\r\n", "\n"))).rstrip().lstrip("\n")


# ----- reStructuredText ---------------------------------------------------------------------------
RST_ADORNMENT = re.compile(r"""^\s*(([=\-~^"'`#*+.:_])\2{3,}|\+[-=+]{3,})\s*$""")   # underlines, table rules
RST_VERSIONS = {"versionadded": "New in version", "versionchanged": "Changed in version",
                "deprecated": "Deprecated since version"}
RST_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(?:([\w:-]+)::\s*(.*)|(.*))$")
# directives whose whole block is navigation, layout or generated content, not prose
RST_DROPPED_BLOCKS = {"toctree", "image", "figure", "raw", "include", "literalinclude", "index", "kernel-doc",
                      "kernel-abi", "kernel-feat", "kernel-include", "highlight", "only", "tabularcolumns",
                      "sectionauthor", "moduleauthor", "module", "currentmodule", "contents", "meta", "cssclass",
                      "audit-event", "impl-detail", "c:namespace", "c:namespace-push", "c:namespace-pop",
                      "default-domain", "productionlist", "graphviz", "kernel-figure", "kernel-render",
                      "testsetup", "testcleanup", "program", "option-list", "rubric", "opcode", "pdbcommand"}
RST_ROLE = re.compile(r":[\w-]+(?::[\w-]+)?:`([^`]*)`")
RST_LINK = re.compile(r"`([^`<]*?)\s*<[^`>]*>`__?")
RST_REFERENCE = re.compile(r"`([^`]+)`__?")
RST_LITERAL = re.compile(r"``([^`]+)``")
RST_TARGET = re.compile(r"\s*<[^<>]*>$")


def rst_role_text(match: re.Match) -> str:
    """`:func:`open`` -> open, `:ref:`the guide <label>`` -> the guide, `:meth:`~a.b`` -> b."""
    text = RST_TARGET.sub("", match.group(1)) or match.group(1)
    if text.startswith("~"):
        text = text[1:].rsplit(".", 1)[-1]
    return text.lstrip("!")


def rst_inline(line: str) -> str:
    line = RST_ROLE.sub(rst_role_text, line)
    line = RST_LINK.sub(lambda m: m.group(1), line)
    line = RST_LITERAL.sub(lambda m: m.group(1), line)
    return RST_REFERENCE.sub(lambda m: m.group(1), line)


def rst_to_text(text: str) -> str:
    """Sphinx/docutils source -> text: adornment lines, comments, link targets and layout
    directives (with their indented blocks) dropped; other directives (note, code-block,
    function, ...) keep their body, and their argument (a signature, say) becomes a line."""
    out: list[str] = []
    lines = text.replace("\r\n", "\n").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        directive = RST_DIRECTIVE.match(line)
        if directive:
            indent, name, argument = len(directive.group(1)), directive.group(2), directive.group(3)
            if name is None or name in RST_DROPPED_BLOCKS or name.startswith("c:") and not argument:
                # comment, target (".. _x:"), substitution, or a dropped directive: skip its block
                while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                    i += 1
                continue
            # the directive's options (":maxdepth: 2") are markup as well
            while i < len(lines) and re.match(r"^\s+:[\w-]+:", lines[i]):
                i += 1
            if name in RST_VERSIONS:
                out.append(" " * indent + f"{RST_VERSIONS[name]} {rst_inline(argument.strip())}.")
            elif argument.strip():
                out.append(" " * indent + rst_inline(argument.strip()))
            elif name in ("note", "warning", "seealso", "important", "tip", "caution", "attention", "hint"):
                out.append(" " * indent + ("See also:" if name == "seealso" else name.capitalize() + ":"))
            continue
        if RST_ADORNMENT.match(line):
            continue
        if line.rstrip().endswith("::") and not line.strip() == "::":
            line = line.rstrip()[:-1]                                # "Example::" reads "Example:"
        elif line.strip() == "::":
            continue
        out.append(rst_inline(line))
    return tidy("\n".join(out))


# ----- POD ----------------------------------------------------------------------------------------
POD_CODE = re.compile(r"([A-Z])<<+\s+(.*?)\s+>>+", re.S)              # C<< a->b >>
POD_SIMPLE = re.compile(r"([A-Z])<([^<>]*)>")
POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}


def pod_code(letter: str, inner: str) -> str:
    if letter in ("X", "Z"):                                         # index entries, zero-width
        return ""
    if letter == "E":
        if inner in POD_ESCAPES:
            return POD_ESCAPES[inner]
        try:
            return chr(int(inner, 0)) if inner[:1].isdigit() else html.unescape(f"&{inner};")
        except ValueError:
            return ""
    if letter == "L":
        text, bar, target = inner.partition("|")
        if bar:
            return text
        name, _, section = inner.partition("/")
        return section.strip('"') or name
    return inner


def pod_inline(text: str) -> str:
    text = POD_CODE.sub(lambda m: pod_code(m.group(1), m.group(2)), text)
    for _ in range(8):                                               # nested codes, innermost first
        new = POD_SIMPLE.sub(lambda m: pod_code(m.group(1), m.group(2)), text)
        if new == text:
            break
        text = new
    return text


def pod_to_text(text: str) -> str:
    """POD -> text: headings and items as plain lines, formatting codes resolved, `=begin`/`=end`
    and `=for` blocks (output-format specific) and `=cut` code dropped."""
    out: list[str] = []
    skipping = in_pod = False
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        first = block.lstrip("\n")
        if first.startswith("="):
            command, _, rest = first[1:].partition(" ")
            command = command.split("\n")[0]
            rest = rest.strip()
            in_pod = command != "cut"
            if command == "begin":
                skipping = True
            elif command == "end":
                skipping = False
            elif command.startswith("head") or command == "item":
                if rest and rest != "*":
                    out.append(pod_inline(("* " if command == "item" and not rest[:1].isdigit() else "")
                                          + rest.removeprefix("* ")))
            continue
        if skipping or not in_pod and out:
            continue
        in_pod = True
        out.append(block if block[:1] in (" ", "\t") else pod_inline(block))   # verbatim blocks as they are
    return tidy("\n\n".join(out))


# ----- AsciiDoc -----------------------------------------------------------------------------------
ASCIIDOC_DROPPED = re.compile(r"^(\[\[.*\]\]|\[[\w ,=\"'-]*\]|(include|ifdef|ifndef|endif)::.*|:[\w-]+:.*|\+|"
                              r"([-=.~^+*_/])\3{3,})\s*$")
LINKGIT = re.compile(r"linkgit:([\w.-]+)\[(\d)\]")


def asciidoc_to_text(text: str) -> str:
    """Git's AsciiDoc -> text: title underlines, block delimiters, anchors, attributes and
    `include::` lines dropped; `linkgit:git-log[1]` reads git-log(1)."""
    lines = [LINKGIT.sub(r"\1(\2)", line) for line in text.replace("\r\n", "\n").split("\n")
             if not ASCIIDOC_DROPPED.match(line)]
    return tidy("\n".join(lines))


# ----- Vim help -----------------------------------------------------------------------------------
VIM_TAG = re.compile(r"\*[^\s*|\"]+\*")
VIM_LINK = re.compile(r"\|([^\s|]+)\|")
VIM_DROPPED = re.compile(r"^(\s*[=\-]{10,}|\s*<|\s*vim:.*:)\s*$")


def vimhelp_to_text(text: str) -> str:
    """Vim's help files -> text: `*tag*` anchors, separator rules, the `>` / `<` example marks and
    the modeline dropped; `|link|` reads link."""
    lines = []
    for line in text.replace("\r\n", "\n").split("\n"):
        if VIM_DROPPED.match(line):
            continue
        line = VIM_LINK.sub(r"\1", VIM_TAG.sub("", line)).rstrip()
        lines.append(line[:-1].rstrip() if line.endswith(" >") or line == ">" else line)
    return tidy("\n".join(lines))


# ----- HTML ---------------------------------------------------------------------------------------
BLOCK_TAGS = {"p", "div", "section", "article", "br", "hr", "li", "dt", "dd", "dl", "ul", "ol", "table", "tr",
              "h1", "h2", "h3", "h4", "h5", "h6", "pre", "blockquote", "title", "caption", "figure"}
SKIPPED_TAGS = {"script", "style", "head", "nav", "noscript", "button", "form", "select", "svg"}
VOID_TAGS = {"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed", "source", "wbr"}
# ids and classes of navigation, headers, footers, sidebars, tables of contents and permalink marks
# in the packages' HTML (DocBook, Sphinx, texi2any, mdBook, and the SQLite, Apache httpd and Node.js sites)
SKIPPED_MARKS = {"navheader", "navfooter", "nav", "navigation", "hd", "ft", "sidebar", "sphinxsidebar",
                 "global-nav", "searchbox", "banner", "headerlink", "related", "footer", "breadcrumbs",
                 "toc", "toc-backref", "skip", "docnav", "copyright", "legalnotice", "indexterm",
                 "nosearch", "fancy_toc", "menu", "searchmenu", "page-header", "path", "quickview", "toplang",
                 "bottomlang", "top", "column2", "gtoc", "header-container", "api_metadata", "menu-bar",
                 "search-wrapper", "searchresults-outer", "nav-panel"}

PRE_MARK = "\x00"
LIST_MARK_ALONE = re.compile(r"^\* *\n+(?=\S)", re.M)


class _TextExtractor(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.stack: list[tuple[str, bool]] = []     # (tag, skipped)
        self.pre = 0

    @property
    def skipping(self) -> bool:
        return any(skipped for _, skipped in self.stack)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in VOID_TAGS:
            if tag in ("br", "hr") and not self.skipping:
                self.parts.append("\n")
            return
        marks = set()
        for key, value in attrs:
            if key in ("id", "class") and value:
                marks.update(value.lower().split())
        # texi2any's navigation is a div of class "header"; mdBook's headings are links of that class
        skipped = tag in SKIPPED_TAGS or bool(marks & SKIPPED_MARKS) or tag == "div" and "header" in marks
        self.stack.append((tag, skipped))
        if tag in BLOCK_TAGS and not self.skipping:
            self.parts.append("\n\n" if tag not in ("li", "dd", "tr") else "\n")
            if tag == "li":
                self.parts.append("* ")
        if tag == "pre":
            self.pre += 1
            self.parts.append(PRE_MARK)

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID_TAGS or not any(t == tag for t, _ in self.stack):
            return                                                  # stray end tag
        while self.stack:
            open_tag, _ = self.stack.pop()
            if open_tag == "pre":
                self.pre -= 1
            if open_tag == tag:
                break
        if tag in BLOCK_TAGS and not self.skipping:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self.skipping:
            return
        # preformatted lines carry PRE_MARK so that html_to_text keeps their indentation
        self.parts.append(data.replace("\n", "\n" + PRE_MARK) if self.pre else re.sub(r"\s+", " ", data))


def html_to_text(text: str) -> str:
    """HTML -> text: the body's words with block elements on lines of their own, `<pre>` kept
    verbatim, navigation/headers/footers/sidebars (by tag, id or class) and scripts dropped."""
    parser = _TextExtractor()
    parser.feed(text.replace(PRE_MARK, ""))
    parser.close()
    lines = [line.replace(PRE_MARK, "").rstrip() if PRE_MARK in line else line.strip()
             for line in "".join(parser.parts).split("\n")]
    text = tidy("\n".join(lines).replace("\xa0", " "))
    return LIST_MARK_ALONE.sub("* ", text)                           # <li><p>text: the mark joins its text
