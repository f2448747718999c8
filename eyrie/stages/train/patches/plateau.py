"""Every epoch's validation metrics recorded; training stopped once they plateau."""

from __future__ import annotations


class PlateauReached(Exception):
    """Raised after an epoch's validation when training has plateaued: ends speculators' epoch loop."""
