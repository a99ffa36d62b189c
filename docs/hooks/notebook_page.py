"""MkDocs hook: render docs/tutorial.ipynb as a page of the site, with its stored outputs.

The notebook is committed with its outputs (``python docs/gen/tutorial.py`` runs it and
writes them back), so the site shows what the code printed without running anything
at build time. nbconvert turns the notebook into Markdown, which MkDocs then renders
like any other page: the code is highlighted by the site's Pygments, links to
``tutorial.ipynb`` from other pages resolve to the page, and the notebook's HTML
outputs (pipemark's stage views) and figures (embedded as data URLs) need no network.
The notebook file itself is published next to the page for download.
"""

from __future__ import annotations

import posixpath

import jinja2
import nbformat
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page
from nbconvert import MarkdownExporter
from traitlets.config import Config

NOTEBOOKS = ("tutorial.ipynb",)

# nbconvert's Markdown template, with outputs marked as such: text in fences of class
# nb-output (so they look different from the code that made them), HTML in a div that
# site.css lets scroll sideways.
TEMPLATE = """\
{%- extends 'markdown/index.md.j2' -%}
{% block stream %}
``` { .text .nb-output }
{{ output.text | trim('\\n') }}
```
{% endblock stream %}
{% block data_text scoped %}
``` { .text .nb-output }
{{ output.data['text/plain'] | trim('\\n') }}
```
{% endblock data_text %}
{% block data_html scoped %}
<div class="nb-output nb-html">
{{ output.data['text/html'] }}
</div>
{% endblock data_html %}
{% block data_png %}
![A figure the cell drew](data:image/png;base64,{{ output.data['image/png'] | replace('\\n', '') }})
{% endblock data_png %}
"""


class NotebookFile(File):
    """A notebook that MkDocs treats as a page (``tutorial.ipynb`` -> ``tutorial/``)."""

    def is_documentation_page(self) -> bool:
        return True


def notebook_markdown(source: str, download: str) -> str:
    """The notebook (JSON text) as Markdown; ``download`` is the notebook's URL."""
    config = Config()
    # Figures stay inside the page as data URLs instead of separate files.
    config.ExtractOutputPreprocessor.enabled = False
    exporter = MarkdownExporter(
        config=config,
        extra_loaders=[jinja2.DictLoader({"pipemark_page.md.j2": TEMPLATE})],
        template_file="pipemark_page.md.j2",
    )
    notebook = nbformat.reads(source, as_version=4)
    body, _ = exporter.from_notebook_node(notebook)
    # A link to the notebook file under the notebook's title (its first line).
    title, _, rest = body.lstrip("\n").partition("\n")
    link = f"[Download the notebook]({download}) to run it yourself."
    if not title.startswith("# "):
        return f"{link}\n\n{body}"
    return f"{title}\n\n{link}\n{rest}"


def _download_uri(src_uri: str) -> str:
    stem, _ = posixpath.splitext(src_uri)
    return posixpath.join(stem, posixpath.basename(src_uri))


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for src_uri in NOTEBOOKS:
        original = files.get_file_from_path(src_uri)
        if original is None:
            continue
        files.remove(original)
        files.append(
            NotebookFile(src_uri, original.src_dir, original.dest_dir, original.use_directory_urls)
        )
        copy = File.generated(config, _download_uri(src_uri), abs_src_path=original.abs_src_path)
        files.append(copy)
    return files


def on_page_read_source(page: Page, config: MkDocsConfig) -> str | None:
    if page.file.src_uri not in NOTEBOOKS:
        return None  # MkDocs reads the page as usual
    with open(page.file.abs_src_path, encoding="utf-8") as handle:
        source = handle.read()
    # The page sits next to the source's folder name: tutorial.ipynb -> tutorial/...
    return notebook_markdown(source, _download_uri(page.file.src_uri))
