"""The node_image role's estimate of the disk a node needs for an image (ansible/filter_plugins/dlc_image.py),
on the layers and history sizes of a real dlcluster:cpu (2026-11-29) and the images an emulated node held."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ansible/filter_plugins"))
import dlc_image  # noqa: E402

# `docker image inspect --format '{{range .RootFS.Layers}}{{.}},{{end}}'` (shortened ids) and
# `docker history --no-trunc --human=false --format '{{.Size}}'` of that image
LAYERS = ["3f00e8866fa7", "901d9709a488", "79906dfe80b0", "d982bad43608", "9f816abab9f9", "ee68bfdb978f",
          "82378095e8f4", "ff5c4d122cdb", "4b3ed8bcb4f0", "0ce268e7dde6", "19e860367267"]
HISTORY = ("0 0 0 0 0 0 593790 29279 214423 4112 0 0 0 0 0 65883697 0 3496619619 3565914382 0 161079327 "
           "0 0 0 0 125646255").split()
WHOLE = sum(map(int, HISTORY))
# the node's previous image: the same base, torch, stack and runtime layers, then other code
PREVIOUS = ",".join(LAYERS[:8] + ["de1ba9a06ffe", "acf3da82d2e0", "8a90f5ac0f49"]) + ","
# an image of an older stack: the base and torch layers only
OLDER = ",".join(LAYERS[:3] + ["7792f1fa6efe", "afbaf62a7023", "87aa2c2e73ef"]) + ","


@pytest.mark.parametrize("node,needed", [
    ([], WHOLE),  # an empty engine: every layer
    ([",".join(LAYERS)], 0),  # the image is there
    ([PREVIOUS], 214423 + 29279 + 593790),  # the code's three layers, not 7.4 GB
    # three layers shared, of which two may be the empty ones: only the oldest sized entry is sure
    ([OLDER], WHOLE - 125646255),
    ([OLDER, PREVIOUS], 214423 + 29279 + 593790),  # the longest shared prefix counts
    ([",".join(["x", *LAYERS[1:]])], WHOLE),  # a layer shared out of its chain is not one docker reuses
])
def test_the_node_needs_only_the_layers_past_what_it_shares(node, needed):
    got = dlc_image.image_bytes_needed(LAYERS, HISTORY, node)
    assert got == needed
    assert got <= WHOLE  # never more than the image


def test_it_never_underestimates_where_the_empty_layers_are_unknown():
    """Two of the 11 layers are empty, but history does not say which: sharing 9 layers (both empty
    ones among them, at worst) leaves at most the two newest sized entries to come."""
    assert dlc_image.image_bytes_needed(LAYERS, HISTORY, [",".join(LAYERS[:9])]) == 29279 + 593790
    # a history with more sized entries than layers is not this image's: counted whole
    assert dlc_image.image_bytes_needed(LAYERS[:2], HISTORY, [",".join(LAYERS[:2])]) == 0
    assert dlc_image.image_bytes_needed(LAYERS[:3], HISTORY, [LAYERS[0]]) == WHOLE
