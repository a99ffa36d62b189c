"""docs/scale.md's comparison with MaxText's published runs is what
docs/gen/maxtext_table.py makes today (issue 58)."""

from tests._docs import docs_generator


def test_maxtext_table_is_up_to_date(capsys):
    gen = docs_generator("maxtext_table")
    assert gen.main(["--check"]) == 0, capsys.readouterr().err


def test_every_published_row_is_there():
    gen = docs_generator("maxtext_table")
    runs = gen.runs()
    assert len(runs) == 4 * 6 + 1  # the v5e table and the v5p Llama 2 70B row
    assert {r.layout.chips for r in runs if "v5e" in r.label} == {256 * s for s in gen.SLICES}
    # the published step follows from the published rate and MaxText's 2023 count
    first = runs[0]
    assert first.published_seconds == gen.flops_2023(first.model, 6 * 2048) / 120e12
