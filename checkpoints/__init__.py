"""Checkpoints for elastimesh: sharded, asynchronous, committed by the driver, resharded on load.

Driver side (no torch, no ray): :mod:`layout`, :mod:`manifest`, :mod:`storage`, :mod:`catalog`.
Worker side (torch.distributed): :mod:`state`, :mod:`writer`, :mod:`reader`.

This package deliberately imports nothing at package import time, so that the driver can import
``checkpoints.catalog`` without pulling in ``torch.distributed``.
"""

from __future__ import annotations
