"""Data-parallel training over torchrun's processes (``train.parallel``: DDP or FSDP)."""
from __future__ import annotations

import os

import torch


class Distributed:
    """torchrun's process group when WORLD_SIZE > 1 (DDP, or FSDP for drafters too big to
    replicate); a no-op otherwise. Every rank draws the same rows and anchors from the same
    generator and trains on its own slice, so rank 0's resume point serves every rank."""

    def __init__(self, device: torch.device):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = device
        if self.world > 1:
            import torch.distributed as dist  # distributed runs only

            if device.type == "cuda":
                self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def wrap(self, model: torch.nn.Module, parallel: str) -> torch.nn.Module:
        if self.world == 1:
            return model
        if parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard  # distributed runs only

            for layer in model.layers:
                fully_shard(layer)
            return fully_shard(model)
        from torch.nn.parallel import DistributedDataParallel  # distributed runs only

        return DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def full_state(self, model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
        """Model and optimizer state as one process would hold them (gathered under FSDP)."""
        if self.world == 1:
            return model.state_dict(), optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict  # distributed runs only

        return get_state_dict(model, optimizer.optimizers,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state(self, model: torch.nn.Module, optimizer, model_state: dict, optim_state: dict) -> None:
        if self.world == 1:
            model.load_state_dict(model_state)
            optimizer.load_state_dict(optim_state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict  # distributed runs only

        set_state_dict(model, optimizer.optimizers, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))

    def sum(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        if self.world > 1:
            import torch.distributed as dist  # distributed runs only

            for t in tensors:
                dist.all_reduce(t)
        return list(tensors)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist  # distributed runs only

            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist  # distributed runs only

            dist.destroy_process_group()
