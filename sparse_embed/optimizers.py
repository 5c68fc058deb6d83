"""Optimizer specs that the lookup's backward applies to the touched rows (see `sparse_embed.core.optimizers`)."""

from sparse_embed.core.optimizers import (
    DEFAULT,
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    Custom,
    LaProp,
    Optimizer,
    RowwiseAdagrad,
    SlotSpec,
)

__all__ = ["DEFAULT", "FTRL", "SGD", "Adagrad", "AdagradMomentum", "Adam", "Custom", "LaProp", "Optimizer",
           "RowwiseAdagrad", "SlotSpec"]
