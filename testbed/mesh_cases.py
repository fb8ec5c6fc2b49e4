"""What the mesh tests share: the small model they train, how many steps, and a shape's test id.

``SMALL`` (d_model 32, seq_len 32, 4 layers) keeps a TP step well under a second on 2 cores and has
enough layers for pp = 2 with two virtual stages each; ``STEPS`` is the length of an equivalence run
(tests/distributed/test_mesh_equivalence.py and the family tests).
"""

from __future__ import annotations

SMALL = ("model.d_model=32", "model.n_heads=4", "model.seq_len=32", "model.n_layers=4")
STEPS = 10


def mesh_id(shape: tuple[int, int, int]) -> str:
    """The pytest id of a (dp, pp, tp) shape: ``dp2-pp1-tp2``."""
    return "dp{}-pp{}-tp{}".format(*shape)
