"""Several count files read as one series (issue 47 item 7): any split of a series into files, in
name order, reads back as the series; files of other layers or experts are refused naming the file."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from eplb.io.formats import FormatError, read_counts_many


@settings(max_examples=25, deadline=None)
@given(windows=st.integers(1, 6), layers=st.integers(1, 3), experts=st.integers(1, 5),
       cuts=st.lists(st.integers(1, 5), min_size=0, max_size=4), seed=st.integers(0, 2**16),
       suffix=st.sampled_from([".npy", ".json"]))
def test_any_split_of_a_series_into_files_reads_back_as_the_series(tmp_path_factory, windows, layers, experts, cuts,
                                                                   seed, suffix):
    series = np.random.default_rng(seed).integers(0, 1000, size=(windows, layers, experts))
    edges = sorted({min(c, windows) for c in cuts} | {0, windows})
    folder = tmp_path_factory.mktemp("dumps")
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        part = series[lo:hi]
        path = folder / f"part_{k:03d}{suffix}"
        if suffix == ".npy":
            np.save(path, part)
        else:
            path.write_text(json.dumps({"logical_count": part.tolist()}))
    data = read_counts_many([folder])
    np.testing.assert_array_equal(data.counts, series)
    files = sorted(folder.iterdir())
    np.testing.assert_array_equal(read_counts_many(files).counts, series)      # a glob's files, in order


def test_files_of_other_experts_are_refused_naming_the_file(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((2, 4)))
    np.save(tmp_path / "b.npy", np.ones((2, 5)))
    with pytest.raises(FormatError, match="b.npy.*several count files must record the same layers and experts"):
        read_counts_many([tmp_path / "a.npy", tmp_path / "b.npy"])


def test_a_folder_without_count_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("no counts here")
    with pytest.raises(FormatError, match="a folder of counts must hold files named"):
        read_counts_many([tmp_path])
