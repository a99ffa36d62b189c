"""User pages state each fact on its own: no page names an issue number or labels a
measurement "run 17". A reader has neither the tracker nor the log those point into; a
measurement says what it is (model, layout, device, JAX version, date, command)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

#: Pages about the project's own history, where its issue numbers belong.
EXCLUDED = {"CHANGELOG.md", "CONTRIBUTING.md"}

#: Words that make "run 2 …" a count, not a label ("run 2 processes", "runs 248
#: programs a step").
_UNITS = (
    "process|processes|step|steps|stage|stages|time|times|device|devices|microbatch|"
    "microbatches|worker|workers|thread|threads|action|actions|program|programs|row|rows|"
    "block|blocks|layer|layers|call|calls|test|tests|scenario|scenarios|example|examples|"
    "case|cases|second|seconds|minute|minutes|ms|s|µs|rank|ranks|host|hosts|chip|chips|"
    "epoch|epochs|iteration|iterations|job|jobs|copies|more|of|x|bytes|KiB|MiB|GiB|MB|GB"
)
#: "run 17", "Run 2's", "runs 1 and 2": a measurement named by its number. Not a count
#: followed by its unit ("run 2 and 4 processes": the numbers taken whole, possessively,
#: before the unit is looked for), nor a compilation count of the runtime's `run`
#: programs in a generated table ("10: run 5, make_zeros 4, split 1").
RUN_LABEL = re.compile(
    r"(?<!\d: )\b[Rr]uns?\s+\d++(?:\.\d++)?+\b(?:\s*(?:,|and|or|to|-|–)\s*\d++\b)*+"
    rf"(?!\s*(?:{_UNITS})\b)(?!\s*[×%])"
)
#: "#40", "issue 42", "Issue #33", "issues/12", "PR 7": a number in the tracker. Not an
#: HTML character reference ("&#39;") nor a link to a heading ("(#fsdp-in-stages)").
ISSUE_NUMBER = re.compile(
    r"(?<![&\w])#\d+\b|\b[Ii]ssues?[\s/#]+\d+\b|\b(?:PR|[Pp]ull request)\s*#?\d+\b"
)


def user_pages() -> list[Path]:
    """README.md and every Markdown page of docs/, less the history pages."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [
        p for p in pages if p.name not in EXCLUDED and not p.name.startswith("development-history")
    ]


def offences(text: str) -> list[tuple[int, str]]:
    """(line number, what matched) for each run label or issue number in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in (RUN_LABEL, ISSUE_NUMBER):
            found += [(number, m.group(0)) for m in pattern.finditer(line)]
    return found


@pytest.mark.parametrize(
    "text",
    [
        "Run 17 explains it.",
        "the step of run 16 took",
        "in run 15, the scan's",
        "1.087 in runs 1 and 2",
        "(runs 1 to 3 above)",
        "**Run 3, 2026-12-06**",
        "Targets (#27): at most",
        "issue 42 says",
        "(Issue #40)",
        "see issues/12",
        "PR #7",
    ],
)
def test_a_history_reference_is_found(text):
    assert offences(text), text


@pytest.mark.parametrize(
    "text",
    [
        "16 stages on one chip run 248 programs a step",
        "run 2 processes with pipemark.launch",
        "runs 4 microbatches",
        "the tests run 2 and 4 processes",
        "| 10: run 5, make_zeros 4, split 1 | 150.8 |",
        "| pipeline S 1, M 1, B 8 | 24.3 | 1: run 1 | 169.1 |",
        "[FSDP in stages](submeshes.md#fsdp-in-stages)",
        "it&#39;s",
        "change from run to run",
        "three runs of this round's code gave 16, 14 and 13 rows",
    ],
)
def test_ordinary_text_is_left_alone(text):
    assert not offences(text), offences(text)


def test_no_user_page_names_an_issue_or_a_run_number():
    found = [
        f"{page.relative_to(ROOT)}:{number}: {match!r}"
        for page in user_pages()
        for number, match in offences(page.read_text(encoding="utf-8"))
    ]
    assert not found, (
        "say what the measurement is (model, device, JAX version, date, command) or "
        "what the issue asked, not its number:\n" + "\n".join(found)
    )
