"""Document-boundary masks: exactly the targets whose input is EOS are left out of the loss."""

from __future__ import annotations

import numpy as np
import pytest

from meshdata import DataError, TokenSource, microbatch_tokens
from meshdata.masks import IGNORE, boundary_eos, counted, mask_targets

EOS = 2


def test_targets_after_eos_are_masked():
    # three documents: [5 6 7 EOS] [8 9 EOS] [10 11 ...]
    stream = np.array([5, 6, 7, EOS, 8, 9, EOS, 10, 11, 12, EOS, 13, 14], np.int32)
    src = TokenSource.from_array(stream, 16, "t", eos_id=EOS)
    x, y = microbatch_tokens(src, np.array([0, 1]), 6)  # windows [0:7] and [6:13]
    masked = mask_targets(x, y, EOS)
    # window 0: inputs 5 6 7 E 8 9 -> targets 6 7 E 8 9 E; the target after the input EOS (8) is out
    assert masked[0].tolist() == [6, 7, EOS, IGNORE, 9, EOS]
    # window 1: inputs E 10 11 12 E 13 -> targets 10 11 12 E 13 14
    assert masked[1].tolist() == [IGNORE, 11, 12, EOS, IGNORE, 14]
    assert counted(masked) == 12 - 3
    assert y[0].tolist() == [6, 7, EOS, 8, 9, EOS]  # the input arrays are not modified
    assert mask_targets(x, y, None) is y and counted(y) == 12  # off: every target counts


def test_setting_resolution():
    with_eos = TokenSource.from_array(np.arange(10), 16, "a", eos_id=EOS)
    without = TokenSource.from_array(np.arange(10), 16, "b")
    assert boundary_eos("auto", with_eos) == EOS and boundary_eos("auto", without) is None
    assert boundary_eos(True, with_eos) == EOS and boundary_eos(False, with_eos) is None
    with pytest.raises(DataError, match="mask_document_boundaries = false") as ei:
        boundary_eos(True, without)
    assert ei.value.key == "data.mask_document_boundaries"
