"""TorchRec interop: an EmbeddingBagCollection's tables and fused optimizer state in and out, and its optimizers.

    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    tables = sparse_embed.torchrec.from_torchrec(plan, state)      # or a DCP checkpoint's directory
    sparse_embed.torchrec.to_torchrec(plan, tables, into=state)    # back into TorchRec's tensors, in place

What converts exactly, and what is refused: docs/torchrec.md. Implemented in
`sparse_embed.integrations.torchrec` (torch is not needed to import it);
loaded on first use.
"""

from sparse_embed import _lazy

__all__ = ["features_from_torchrec", "from_torchrec", "fused_params", "optimizer_from_fused_params", "to_torchrec"]

__getattr__, __dir__ = _lazy.attach(__name__, {"sparse_embed.integrations.torchrec": tuple(__all__)})
