"""TorchRec's side of `benchmarks/e2e.py`: the DLRM as a TorchRec user builds it on CPU.

One `EmbeddingBagCollection` (weighted where the data has gains other than
1) under `DistributedModelParallel` on a 1-process gloo group, its fused
optimizer FBGEMM's EXACT_ROWWISE_ADAGRAD (applied inside the backward), the
dense layers in torch with `torch.optim.Adagrad` (accumulators from 0, the
same eps), torch on `threads` threads. Tables and dense layers start from
the same numbers as the other systems' (`e2e_data`).
The input pipeline builds the `KeyedJaggedTensor` on a background thread.
`dense_step` times the dense part alone on a plain copy of the head (no
DDP wrapper), on fixed embedding activations.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from benchmarks.e2e_data import HostBatch, Model, dense_init, initial_tables
from benchmarks.e2e_jax import threaded


def _head_module(torch, model: Model):
    """The bottom MLP, dot interaction and top MLP as a torch module: `head(pooled [B, dim] list, dense) -> [B]`."""
    nn = torch.nn

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict()
            for name, (w, b) in dense_init(model).items():
                layer = nn.Linear(w.shape[0], w.shape[1])
                with torch.no_grad():
                    layer.weight.copy_(torch.from_numpy(w.T.copy()))
                    layer.bias.copy_(torch.from_numpy(b))
                self.layers[name] = layer
            self.pairs = torch.triu_indices(model.vectors, model.vectors, 1)

        def forward(self, pooled, dense):
            x = dense
            for i in range(len(model.bottom) + 1):
                x = torch.relu(self.layers[f"bottom_{i}"](x))
            v = torch.stack([x, *pooled], dim=1)
            dots = torch.bmm(v, v.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
            y = torch.cat([x, dots], dim=1)
            last = len(model.top)
            for k in range(last + 1):
                y = self.layers[f"top_{k}"](y)
                y = torch.relu(y) if k < last else y
            return y[:, 0]

    return Head()


def dense_trainer(torch, model: Model):
    """The dense part alone on fixed activations, on a plain copy of the head (no DDP wrapper) with its own
    Adagrad: `step(acts [B, dim] list, x) -> loss`, `x[1]` the dense features `[B, num_dense]`, `x[2]` the labels."""
    head = _head_module(torch, model)
    optimizer = torch.optim.Adagrad(head.parameters(), lr=model.dense_lr, eps=model.eps)

    def step(acts: list, x) -> Any:
        acts = [a.detach().requires_grad_() for a in acts]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(head(acts, x[1]), x[2])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def fused_dmp(torch, module, fused: dict, tables: list[str]):
    """`module` under DistributedModelParallel on this process's group, every table TABLE_WISE with the FUSED kernel
    (FBGEMM's TBE, the optimizer `fused` applied inside the backward): left to itself, the planner makes small
    tables DATA_PARALLEL, trained by a dense optimizer instead."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    sharders = [EmbeddingBagCollectionSharder(fused_params=fused)]
    constraints = {t: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for t in tables}
    topology = Topology(world_size=torch.distributed.get_world_size(), compute_device="cpu")
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(module, sharders, torch.distributed.GroupMember.WORLD)
    return DistributedModelParallel(module, device=torch.device("cpu"), plan=plan, sharders=sharders)


def _dmp(torch, model: Model, weighted: bool):
    """The EmbeddingBagCollection and the head under DistributedModelParallel, the fused row-wise Adagrad."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    features = [f for f, _ in model.features]
    names = {t: [f for f, ft in model.features if ft == t] for t, _ in model.tables}
    configs = [EmbeddingBagConfig(name=t, num_embeddings=rows, embedding_dim=model.dim, feature_names=names[t])
               for t, rows in model.tables]
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": model.embedding_lr, "eps": model.eps}

    class Net(torch.nn.Module):
        def __init__(self, ebc, head):
            super().__init__()
            self.ebc, self.head = ebc, head

        def forward(self, kjt, dense):
            pooled = self.ebc(kjt)
            return self.head([pooled[f] for f in features], dense)

    ebc = EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device("meta"))  # no unsharded copy
    return fused_dmp(torch, Net(ebc, _head_module(torch, model)), fused, [t for t, _ in model.tables])


class TorchRec:
    """The DLRM under `DistributedModelParallel` (see the module docstring)."""

    def __init__(self, model: Model, threads: int):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.torch, self.model = torch, model
        self.features = [f for f, _ in model.features]
        self.weighted = model.name.startswith("demo")  # w1's gains are all 1
        self.dmp = _dmp(torch, model, self.weighted)
        self._init_tables()
        dense = [p for n, p in self.dmp.named_parameters() if "embedding_bags" not in n]
        self.optimizer = torch.optim.Adagrad(dense, lr=model.dense_lr, eps=model.eps)
        self.dense_step = dense_trainer(torch, model)

    def _init_tables(self) -> None:
        """`e2e_data.initial_tables`, written into this process's shards of the fused tables through their state
        dict's views."""
        torch, tables = self.torch, initial_tables(self.model)
        with torch.no_grad():
            for key, value in self.dmp.state_dict().items():
                if "embedding_bags" in key and key.endswith(".weight"):
                    for shard in value.local_shards():
                        (r, c), (n, m) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                        shard.tensor.copy_(torch.from_numpy(tables[key.split(".")[-2]][r:r + n, c:c + m]))

    def prepare(self, hb: HostBatch) -> Any:
        from torchrec import KeyedJaggedTensor

        torch = self.torch
        cat = lambda parts: torch.from_numpy(np.concatenate(parts))  # noqa: E731
        weights = cat([hb.gains[f] for f in self.features]) if self.weighted else None
        kjt = KeyedJaggedTensor(keys=self.features, values=cat([hb.ids[f][0] for f in self.features]),
                                lengths=cat([hb.ids[f][1] for f in self.features]), weights=weights)
        return kjt, torch.from_numpy(hb.dense), torch.from_numpy(hb.labels)

    def loop(self, items: Iterable[HostBatch]):
        return threaded(items, self.prepare)

    def step(self, x) -> Any:
        kjt, dense, labels = x
        loss = self.torch.nn.functional.binary_cross_entropy_with_logits(self.dmp(kjt, dense), labels)
        self.optimizer.zero_grad()
        loss.backward()  # the tables' fused optimizer runs inside
        self.optimizer.step()
        return loss.detach()

    def activations(self, x) -> list:
        with self.torch.no_grad():
            pooled = self.dmp.module.ebc(x[0])
            return [pooled[f].clone() for f in self.features]

    def predict(self, x) -> np.ndarray:
        with self.torch.no_grad():
            return self.dmp(x[0], x[1]).numpy()
