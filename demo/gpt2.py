"""A Hugging Face `transformers` GPT-2, built from a config, trained on one process or many.

The model is `GPT2LMHeadModel` from a `GPT2Config` (random init, nothing downloaded); the data is
a synthetic token language made here (a random Markov chain, so the loss has something to learn).
Batches are dicts (`input_ids`, `labels`) passed to the model as keyword arguments, and the loss
is the one the model returns. The same script runs every layout; only the launch and the
`parallel.*` keys change:

    python demo/gpt2.py                                                    # one process
    torchrun --nproc-per-node 2 demo/gpt2.py                               # DDP
    torchrun --nproc-per-node 2 demo/gpt2.py --stack parallel \\
        --parallel.axes.shard 2 --fsdp.enabled true                        # FSDP2
    torchrun --nproc-per-node 2 demo/gpt2.py --stack parallel --parallel.axes.tensor 2   # tensor parallel
    torchrun --nproc-per-node 4 demo/gpt2.py --stack parallel \\
        --parallel.axes.shard 2 --parallel.axes.tensor 2 --fsdp.enabled true           # FSDP2 x TP

`dataloader.batch_size` is per data-parallel rank: ranks of one tensor-parallel group read the
same batch. docs/clusters.md shows the multi-node and Slurm launches of this script.

Tensor parallelism needs two changes to the stock model, both made here. Hugging Face's GPT-2 uses
`Conv1D` layers (a linear layer with a transposed weight), which torch's `ColwiseParallel` and
`RowwiseParallel` do not accept, so every `Conv1D` becomes the `nn.Linear` computing the same
function. And the fused query/key/value projection `c_attn` is split into three linear layers:
cut column-wise as one matrix, a rank would get all of the queries and none of the values.
Both happen at build time on every layout, so checkpoints of all layouts have the same names.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import danling as dl


class GPT2DemoConfig(dl.RunnerConfig):
    """Settings of the GPT-2 run (model sizes default to a tiny model that trains on a CPU).

    Attributes:
        n_layer: Transformer blocks.
        n_embd: Hidden size.
        n_head: Attention heads (the tensor-parallel degree must divide it).
        vocab_size: Tokens of the synthetic language.
        context: Tokens per sequence (also the model's `n_positions`).
        sequences: Training sequences (validation gets a quarter as many).
        successors: Tokens that may follow each token in the synthetic language (fewer: easier).
        threads: Intra-op CPU threads for torch (`torch.set_num_threads`).
    """

    steps: int = 60
    n_layer: int = 2
    n_embd: int = 32
    n_head: int = 2
    vocab_size: int = 64
    context: int = 32
    sequences: int = 512
    successors: int = 4
    threads: int = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.seed = 0
        self.optim.type = "adamw"
        self.optim.lr = 1e-2
        self.max_grad_norm = 1.0
        self.dataloader.batch_size = 8
        self.workspace_root = "runs"
        self.lineage = "demo"
        self.experiment = "gpt2"
        self.log_interval = 10
        if args or kwargs:
            self.merge(*args, **kwargs)


class MarkovTokens(Dataset):
    """Sequences of a fixed random Markov chain: each token is followed by one of `successors` tokens.

    The chain depends on `seed` only, so training and validation sets built with the same seed
    and different `offset`s speak the same language.
    """

    def __init__(self, sequences: int, length: int, vocab: int, successors: int, seed: int, offset: int = 0) -> None:
        chain = torch.Generator().manual_seed(seed)
        table = torch.randint(0, vocab, (vocab, successors), generator=chain)
        draws = torch.Generator().manual_seed(seed + 1 + offset)
        tokens = torch.empty(sequences, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (sequences,), generator=draws)
        for i in range(1, length):
            choice = torch.randint(0, successors, (sequences,), generator=draws)
            tokens[:, i] = table[tokens[:, i - 1], choice]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sequence = self.tokens[index]
        return {"input_ids": sequence, "labels": sequence}  # the model shifts the labels itself


class QKV(nn.Module):
    """The query, key and value projections as three layers, concatenated like GPT-2's fused `c_attn`."""

    def __init__(self, fused: nn.Linear) -> None:
        super().__init__()
        width = fused.in_features
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        with torch.no_grad():
            for i, layer in enumerate((self.q, self.k, self.v)):
                layer.weight.copy_(fused.weight[i * width : (i + 1) * width])
                layer.bias.copy_(fused.bias[i * width : (i + 1) * width])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


def linearize(module: nn.Module) -> None:
    """Replace every `transformers` `Conv1D` under `module` by the equivalent `nn.Linear` (in place)."""
    from transformers.pytorch_utils import Conv1D

    for name, child in module.named_children():
        if isinstance(child, Conv1D):
            in_features, out_features = child.weight.shape  # Conv1D stores the weight transposed
            linear = nn.Linear(in_features, out_features)
            with torch.no_grad():
                linear.weight.copy_(child.weight.T)
                linear.bias.copy_(child.bias)
            setattr(module, name, linear)
        else:
            linearize(child)


class GPT2LM(nn.Module):
    """`GPT2LMHeadModel` from a config, with linear layers, and the tensor-parallel plan of its blocks."""

    def __init__(self, config: GPT2DemoConfig) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        gpt_config = GPT2Config(
            vocab_size=config.vocab_size,
            n_positions=config.context,
            n_embd=config.n_embd,
            n_layer=config.n_layer,
            n_head=config.n_head,
            resid_pdrop=0.0,  # no dropout: every layout computes the same losses
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        self.gpt = GPT2LMHeadModel(gpt_config)
        self.gpt.loss_type = "ForCausalLM"  # its class name names no loss: transformers would warn, then use this
        linearize(self.gpt)
        for block in self.gpt.transformer.h:
            block.attn.c_attn = QKV(block.attn.c_attn)

    def forward(self, **batch: torch.Tensor) -> Any:
        return self.gpt(**batch)

    def parallelize(self, parallel: Any) -> None:
        """Split each block over the tensor axis: heads and MLP columns in, their projections out.

        Each rank keeps `n_head / tensor` heads, so the attention's split of the fused output into
        query, key and value uses the local width. Does nothing without a tensor axis.

        Called when: by ParallelRunner's `parallelize_model`, once per run on every rank, any layout.
        Holds on entry: the model is on its device, unwrapped; `parallel.mesh["tensor"]` exists.
        Side effects: turns the blocks' linear weights into DTensors over the tensor axis.
        Overrides must not: rename parameters or wrap the model in FSDP/DDP (the runner does that next).

        Raises:
            ValueError: the tensor degree does not divide `n_head`.
        """
        degree = parallel.topology.degrees["tensor"]
        if degree == 1:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        heads = self.gpt.config.n_head
        if heads % degree:
            raise ValueError(f"parallel.axes.tensor={degree} must divide the model's n_head={heads}")
        plan = {
            "attn.c_attn.q": ColwiseParallel(),
            "attn.c_attn.k": ColwiseParallel(),
            "attn.c_attn.v": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(),
        }
        for block in self.gpt.transformer.h:
            parallelize_module(block, parallel.mesh["tensor"], plan)
            block.attn.split_size //= degree


class GPT2Runner(dl.Runner):
    """Binds the model and the synthetic token data; steps pass the dict batch to the model."""

    def __init__(self, config: GPT2DemoConfig) -> None:
        super().__init__(config)
        torch.manual_seed(config.seed)  # the same initial weights on every rank and every layout
        self.model = GPT2LM(config)
        data = (config.sequences, config.context, config.vocab_size, config.successors, config.seed)
        self.datasets.train = MarkovTokens(*data)
        self.datasets.val = MarkovTokens(config.sequences // 4, *data[1:], offset=1)
        self.losses: list[float] = []  # every micro-step's loss, averaged over the data-parallel ranks

    def train_step(self, data: dict[str, torch.Tensor]) -> tuple[None, torch.Tensor]:
        """Forward the dict batch, back-propagate the model's own loss, and record it.

        Called when: by the training loop, once per micro-batch, on every rank.
        Holds on entry: the model is in train mode; `data` holds `input_ids` and `labels` on the CPU.
        Side effects: back-propagates, calls `step()`, appends the rank-averaged loss to `self.losses`.
        Overrides must not: skip `backward` or `step()` (the update would never happen), or skip the
            loss reduction on some ranks only (it is a collective).
        """
        with self.train_context():
            loss = self.model(**self.to_device(data)).loss
        self.backward(loss)
        self.step()
        self.losses.append(float(self.reduce(loss.detach())))
        return None, loss.detach()

    def evaluate_step(self, data: dict[str, torch.Tensor]) -> tuple[None, torch.Tensor]:
        """The model's loss on one validation batch.

        Called when: by the evaluation loop, once per batch, on every rank, inside `inference_context()`.
        Holds on entry: the model is in eval mode.
        Side effects: none.
        Overrides must not: call `backward` or `step()`.
        """
        with self.forward_context():
            return None, self.model(**self.to_device(data)).loss.detach()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train for `steps` optimizer steps and report the first and last losses against chance."""
    config = GPT2DemoConfig().parse(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(config.threads)
    with GPT2Runner(config) as runner:
        results = runner.train()
        row = results[runner.train_state.global_step]
        summary = {"losses": runner.losses, "row": row, "dir": runner.dir, "world_size": runner.world_size}
        if runner.is_main_process:
            first, last, chance = runner.losses[0], row["val"]["loss"], math.log(config.vocab_size)
            print(f"train loss {first:.3f} at the first step, val loss {last:.3f} at the end (uniform: {chance:.3f})")
            print(f"run directory {runner.dir}")
        return summary


if __name__ == "__main__":
    main()
