"""A tiny character-level language model trained in step mode, then asked for a sample.

Step mode means the budget is a number of optimizer steps (`steps`) instead of epochs: the
runner cycles through the training data for as long as it takes, evaluates a few validation
batches at the end and saves a final checkpoint. The text is `demo/corpus.txt` (a few KB of
prose written for this demo), so nothing is downloaded.

Examples:
    python demo/char_lm.py
    python demo/char_lm.py --steps 600 --hidden 256 --temperature 0.6 --prompt "The lamp"
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import danling as dl

CORPUS = Path(__file__).with_name("corpus.txt")


class CharLMConfig(dl.RunnerConfig):
    """Settings of the language-model run.

    Attributes:
        corpus: Text file to learn from.
        context: Characters per training window.
        embed: Size of the character embeddings.
        hidden: Width of the GRU.
        val_fraction: Share of the text (its end) kept for validation.
        prompt: Text the sample starts from.
        sample_length: Characters to generate after training.
        temperature: Softmax temperature of the sampler; lower is more conservative.
        threads: Intra-op CPU threads for torch (`torch.set_num_threads`).
    """

    steps: int = 300
    corpus: str = os.fspath(CORPUS)
    context: int = 64
    embed: int = 48
    hidden: int = 128
    val_fraction: float = 0.1
    prompt: str = "The "
    sample_length: int = 240
    temperature: float = 0.7
    threads: int = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.seed = 7
        self.optim.type = "adamw"
        self.optim.lr = 2e-3
        self.optim.weight_decay = 0.1
        self.max_grad_norm = 1.0
        self.dataloader.batch_size = 32
        self.workspace_root = "runs"
        self.lineage = "demo"
        self.experiment = "char-lm"
        self.log_interval = 50
        if args or kwargs:
            self.merge(*args, **kwargs)


class CharWindows(Dataset):
    """Every window of `context` characters, paired with the same window shifted by one."""

    def __init__(self, ids: torch.Tensor, context: int) -> None:
        if len(ids) <= context:
            raise ValueError(f"text of {len(ids)} characters is too short for context={context}")
        self.ids, self.context = ids, context

    def __len__(self) -> int:
        return len(self.ids) - self.context

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.ids[index : index + self.context + 1]
        return {"input": window[:-1], "target": window[1:]}


class CharGRU(nn.Module):
    """Embedding, one GRU layer and a linear read-out to next-character logits."""

    def __init__(self, vocab_size: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed)
        self.rnn = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, ids: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        return self.step(ids, state)[0]

    def step(self, ids: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        output, state = self.rnn(self.embedding(ids), state)
        return self.head(output), state

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, length: int, temperature: float, generator: torch.Generator) -> list[int]:
        """Sample `length` characters after `prompt` (1-D ids), one at a time, carrying the GRU state."""
        logits, state = self.step(prompt[None])
        generated: list[int] = []
        for _ in range(length):
            probs = F.softmax(logits[0, -1] / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
            generated.append(int(token))
            logits, state = self.step(token[None], state)
        return generated


def sequence_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position of a `(batch, time, vocab)` prediction."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class CharLMRunner(dl.TorchRunner):
    """Binds the model, loss and windowed text; training counts steps, not epochs."""

    def __init__(self, config: CharLMConfig) -> None:
        super().__init__(config)
        text = Path(config.corpus).read_text(encoding="utf-8")
        self.vocab = sorted(set(text))
        self.index = {char: i for i, char in enumerate(self.vocab)}
        ids = torch.tensor([self.index[char] for char in text], dtype=torch.long)
        split = int(len(ids) * (1 - config.val_fraction))
        self.datasets.train = CharWindows(ids[:split], config.context)
        self.datasets.val = CharWindows(ids[split:], config.context)
        self.model = CharGRU(len(self.vocab), config.embed, config.hidden)
        self.criterion = sequence_cross_entropy

    def sample(self, prompt: str, length: int, temperature: float, seed: int = 0) -> str:
        """Continue `prompt` with `length` sampled characters (characters not in the corpus are dropped)."""
        model = self.unwrap(self.model)
        model.eval()
        ids = torch.tensor([self.index[char] for char in prompt if char in self.index] or [0], device=self.device)
        generator = torch.Generator(device=ids.device).manual_seed(seed)
        generated = model.generate(ids, length, temperature, generator)
        return prompt + "".join(self.vocab[i] for i in generated)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train for `steps` optimizer steps, report the losses and print a sample."""
    config = CharLMConfig().parse(list(sys.argv[1:] if argv is None else argv))
    torch.set_num_threads(config.threads)
    with CharLMRunner(config) as runner:
        results = runner.train()
        row = results[runner.train_state.global_step]
        sample = runner.sample(config.prompt, config.sample_length, config.temperature, seed=config.seed)
        train_loss, val_loss, uniform = row["train"]["loss"], row["val"]["loss"], math.log(len(runner.vocab))
        steps = runner.train_state.global_step
        print(f"after {steps} steps: train loss {train_loss:.3f}, val loss {val_loss:.3f} (uniform: {uniform:.3f})")
        print("sample:\n" + sample)
        print(f"run directory {runner.dir}")
        return {"row": row, "sample": sample, "dir": runner.dir, "vocab_size": len(runner.vocab)}


if __name__ == "__main__":
    main()
