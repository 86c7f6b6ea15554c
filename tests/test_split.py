"""The seeded three-phase split (utils/data/split.py): hand-computed indices, the
reference's boundary formula, disjoint/covering phases, index-file caching, bad
split strings."""
import os

import numpy as np
import pytest

from utils.data import split as sp
from utils.errors import UserInputError


def reference_boundaries(data_size, splits_string):
    """DeepSpeed-Chat's get_raw_dataset_split_index boundaries, transcribed literally."""
    splits = [float(s) for s in splits_string.split(",")]
    splits_sum = sum(splits)
    splits = [split / splits_sum for split in splits]
    splits_index = [0]
    for index, split in enumerate(splits):
        splits_index.append(splits_index[index] + int(round(split * float(data_size))))
    diff = splits_index[-1] - data_size
    for index in range(1, len(splits_index)):
        splits_index[index] -= diff
    return splits_index


def test_hand_computed_indices_n10():
    # perm = np.arange(10); np.random.RandomState(seed=1234).shuffle(perm)
    #      -> [7, 2, 9, 1, 0, 8, 4, 5, 6, 3]
    # split 2,4,4: p = .2,.4,.4; b = [0, 2, 6, 10] (no overshoot)
    phases = sp.split_indices(10, "2,4,4", seed=1234)
    assert [p.tolist() for p in phases] == [[7, 2], [9, 1, 0, 8], [4, 5, 6, 3]]
    assert phases[0].dtype == np.uint32  # the reference's dtype


def test_hand_computed_indices_n7():
    # perm of 7 with seed 1234 -> [2, 1, 6, 0, 4, 5, 3]
    # .2*7 = 1.4 -> 1, .4*7 = 2.8 -> 3, 2.8 -> 3: b = [0, 1, 4, 7]
    phases = sp.split_indices(7, "2,4,4", seed=1234)
    assert [p.tolist() for p in phases] == [[2], [1, 6, 0], [4, 5, 3]]


@pytest.mark.parametrize("n, split, expected", [
    (10, "2,4,4", [0, 2, 6, 10]),
    (7, "2,4,4", [0, 1, 4, 7]),      # 1.4->1, 2.8->3, 2.8->3
    (5, "2,4,4", [0, 1, 3, 5]),      # 1.0, 2.0, 2.0
    (1, "2,4,4", [0, 1, 1, 1]),      # 0.2->0, 0.4->0, 0.4->0 = 0; overshoot -1 shifts b_1..b_3 up
    (2, "1,1,1", [0, 0, 1, 2]),      # 0.67->1 three times = 3; overshoot +1
    (4, "1,2,1", [0, 1, 3, 4]),
    (2, "1,0,1", [0, 1, 1, 2]),      # round(1.0) = 1 twice
    (10, "1,1,2", [0, 3, 5, 10]),    # 2.5->2, 2.5->2 (round half to even), 5: [0,2,4,9]; overshoot -1
    (3, "1,1,1", [0, 1, 2, 3]),
    (5, "1,2,2", [0, 1, 3, 5]),
    (6, "1,1,2", [0, 1, 3, 6]),      # 1.5->2, 1.5->2 (round half to even), 3.0: [0,2,4,7]; overshoot +1
    (0, "2,4,4", [0, 0, 0, 0]),
])
def test_boundaries_awkward_n(n, split, expected):
    assert reference_boundaries(n, split) == expected  # the expectations are the reference's
    assert sp.split_boundaries(n, sp.parse_data_split(split)) == expected


def test_boundaries_match_reference_formula_everywhere_it_is_sane():
    for n in range(0, 60):
        for split in ("2,4,4", "1,1,1", "6,2,2", "1,0,0", "0,0,1", "3,3,4", "1,2,3"):
            assert sp.split_boundaries(n, sp.parse_data_split(split)) == reference_boundaries(n, split), (n, split)


def test_negative_reference_boundary_is_clamped():
    # The reference gives [0, -1, 3, 7] for split 0,1,1 and N = 7: round(3.5) = 4 twice
    # overshoots by 1, so b_1 = -1, phase 1 = perm[0:-1] (6 rows of a 0 share) and phase 2
    # = perm[-1:3] (empty). Here b_1 is clamped at 0.
    assert reference_boundaries(7, "0,1,1") == [0, -1, 3, 7]
    assert sp.split_boundaries(7, sp.parse_data_split("0,1,1")) == [0, 0, 3, 7]
    assert [len(p) for p in sp.split_indices(7, "0,1,1", 1234)] == [0, 3, 4]


@pytest.mark.parametrize("split", ["2,4,4", "1,1,1", "0,1,1", "0,3,3", "1,0,0", "5,0,5", "1,2,3"])
def test_phases_disjoint_and_covering(split):
    for n in list(range(0, 45)) + [997, 1000]:
        phases = sp.split_indices(n, split, seed=7)
        joined = np.concatenate(phases)
        assert len(joined) == n, (n, split)
        assert sorted(joined.tolist()) == list(range(n)), (n, split)


def test_index_files_cached_and_reused(tmp_path, monkeypatch):
    out = tmp_path / "cache"
    idx = sp.get_split_index(str(out), "builtin/preference", 1234, "train", "2,4,4", 1, 10)
    assert idx.tolist() == [9, 1, 0, 8]
    names = sorted(os.listdir(out))
    assert names == [f"builtin_preference_seed1234_train_2,4,4_{i}.npy" for i in range(3)]
    assert np.load(out / names[2]).tolist() == [4, 5, 6, 3]

    def boom(*a, **k):
        raise AssertionError("index files should have been reused")

    monkeypatch.setattr(sp, "split_indices", boom)
    assert sp.get_split_index(str(out), "builtin/preference", 1234, "train", "2,4,4", 0, 10).tolist() == [7, 2]
    # a different seed, split name or data split is a different file, hence a rebuild
    with pytest.raises(AssertionError, match="reused"):
        sp.get_split_index(str(out), "builtin/preference", 1234, "eval", "2,4,4", 0, 10)
    with pytest.raises(AssertionError, match="reused"):
        sp.get_split_index(str(out), "builtin/preference", 99, "train", "2,4,4", 0, 10)


def test_index_file_not_fitting_the_data_is_rebuilt(tmp_path):
    out = str(tmp_path)
    sp.get_split_index(out, "d", 1234, "train", "2,4,4", 0, 10)
    # the dataset shrank to 7 rows: the cached indices (up to 9) cannot be used
    assert sp.get_split_index(out, "d", 1234, "train", "2,4,4", 0, 7).tolist() == [2]


@pytest.mark.parametrize("bad, fragment", [
    ("2,4", "got 2"),
    ("2,4,4,4", "got 4"),
    ("a,b,c", "comma-separated numbers"),
    ("", "comma-separated numbers"),
    ("0,0,0", "sum to more than 0"),
    ("-1,2,3", "non-negative"),
    ("nan,1,1", "non-negative"),
])
def test_bad_split_strings(bad, fragment):
    with pytest.raises(UserInputError, match=fragment) as info:
        sp.parse_data_split(bad)
    assert "--data_split" in str(info.value) and repr(bad) in str(info.value)


def test_parse_normalises():
    assert sp.parse_data_split("2, 4 ,4") == [0.2, 0.4, 0.4]
    assert sp.parse_data_split("9,1", expected=2) == [0.9, 0.1]
