"""The architecture table is consistent with what reads it: the tiny-file writer, the servable list,
llama.cpp's names, describe's families and the suite's splits."""

from __future__ import annotations

from agent.artifacts import archs, archtable, routing, tiny


def test_every_row_has_a_tiny_file_writer_and_nothing_else_does() -> None:
    assert set(tiny._BUILDERS) == {a.name for a in archtable.ARCHITECTURES}
    assert tuple(a.name for a in archtable.ARCHITECTURES) == tiny.ARCHITECTURES


def test_the_servable_list_is_the_rows_and_their_aliases() -> None:
    names = {n for a in archtable.ARCHITECTURES for n in (a.name, *a.aliases)}
    assert names == archs.SERVABLE_ARCHITECTURES
    assert archtable.facts("mistral") is archtable.BY_NAME["llama"]
    assert archtable.facts("not-an-architecture") is None


def test_every_row_is_an_architecture_the_pinned_llama_cpp_loads() -> None:
    """llama.cpp is the oracle of every row (and runs the whole-model fallback)."""
    for a in archtable.ARCHITECTURES:
        assert a.name in routing.WHOLE_ARCHITECTURES, a.name


def test_every_row_has_a_known_family_and_three_hops_covering_its_suite_file() -> None:
    for a in archtable.ARCHITECTURES:
        assert a.family in archtable.FAMILIES, a.name
        splits = a.suite.splits
        assert len(splits) == 3, a.name
        assert splits[0][0] == 0 and splits[-1][1] == archtable.suite_layers(a), a.name
        assert all(x[1] == y[0] and x[0] < x[1] for x, y in zip(splits, splits[1:], strict=False)), a.name
        if a.packaged is not None:
            assert a.packaged[1][0][0] == 0 and len(a.packaged[1]) == 3, a.name


def test_families_of_architectures_only_described_are_not_servable() -> None:
    for name, fam in archtable.DESCRIBED_ONLY.items():
        assert name not in archs.SERVABLE_ARCHITECTURES
        assert archtable.family(name) == fam
    assert archtable.family("falcon") == archtable.KV  # a plain K/V cache unless declared otherwise
