"""corpus_text.py: documentation markup to plain text."""
from corpus_text import asciidoc_to_text, html_to_text, pod_to_text, rst_to_text, vimhelp_to_text

RST = """.. SPDX-License-Identifier: GPL-2.0

.. _pci-recovery:

==============
Error Recovery
==============

The :c:func:`pci_reset` call and :ref:`the guide <guide-label>` say ``reset`` resets; see
`docs <https://example.org>`_ and :meth:`~dict.get`.

.. toctree::
   :maxdepth: 2

   intro
   api

.. note::

   Keep this.

.. function:: open(file, mode='r')

   Open *file*.

   .. versionadded:: 3.10

Example::

    code()

+-----+-----+
| a   | b   |
+=====+=====+
"""


def test_rst_keeps_words_and_drops_markup():
    assert rst_to_text(RST) == (
        "Error Recovery\n\n"
        "The pci_reset call and the guide say reset resets; see\ndocs and get.\n\n"
        "Note:\n\n   Keep this.\n\n"
        "open(file, mode='r')\n\n   Open *file*.\n\n   New in version 3.10.\n\n"
        "Example:\n\n    code()\n\n| a   | b   |")


POD = """=head1 NAME

perlfoo - the B<foo> and C<< $x->y >> of L<perlsyn/"Compound Statements">

=over

=item * First E<lt>tagE<gt>X<index>

=back

    verbatim B<kept>

=begin html

<p>dropped</p>

=end html

=cut

sub code { }
"""


def test_pod_resolves_codes_and_skips_format_blocks_and_code():
    assert pod_to_text(POD) == ("NAME\n\nperlfoo - the foo and $x->y of Compound Statements\n\n"
                                "* First <tag>\n\n    verbatim B<kept>")


def test_asciidoc_drops_rules_and_anchors_and_reads_linkgit():
    text = "git-log(1)\n==========\n\n[[opts]]\nSee linkgit:git-diff[1].\n+\n----\n$ git log\n----\n"
    assert asciidoc_to_text(text) == "git-log(1)\n\nSee git-diff(1).\n$ git log"


def test_vim_help_drops_tags_and_example_marks():
    text = "*usr_02.txt*\tFor Vim\n\n|02.1|\tRunning\n====================\nType this: >\n\tvim\n<\n vim:tw=78:ts=8:\n"
    assert vimhelp_to_text(text) == "\tFor Vim\n\n02.1\tRunning\nType this:\n\tvim"


HTML = """<html><head><title>T</title><script>x()</script></head><body>
<div class="navheader"><a href="a">Prev</a></div>
<h1>Title<a class="headerlink" href="#t">¶</a></h1>
<p>Some   <b>bold</b>
text.</p>
<ul><li><p>one</p></li><li>two</li></ul>
<pre>  indented
    more</pre>
<DIV CLASS="NAVFOOTER">Next</DIV>
</body></html>"""


def test_html_keeps_body_text_blocks_and_pre_drops_navigation():
    assert html_to_text(HTML) == "Title\n\nSome bold text.\n\n* one\n\n* two\n\n  indented\n    more"
