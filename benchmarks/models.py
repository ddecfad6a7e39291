"""Small reference models shared by the benchmark suites and tests/autocast/test_models.py.

Plain ``torch.nn`` code, nothing from dispatch_amp: the same definitions run under native
``torch.autocast`` and under ``dispatch_amp.autocast`` so the two can be compared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    d_model: int = 64
    n_heads: int = 4
    n_blocks: int = 2
    max_len: int = 64
    need_weights: bool = False


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, MultiheadAttention, LayerNorm, GELU MLP."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, cfg.n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.need_weights = cfg.need_weights

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=self.need_weights)
        x = x + a
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_blocks))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=idx.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# GPT-2's shapes, the vocabulary padded to a multiple of 64 (50257 -> 50304) as nanoGPT does.
# At the benchmarks' batches an H100 step of small (8 x 1024 tokens) is host-bound: the
# device idles while the host issues its ops, so host time ours adds shows in the step.
# Medium (16 x 1024 tokens, about 5.7x the matrix arithmetic per step) keeps the device busy, so
# host time should hide behind it: the GPU-bound model beside the host-bound ones.
GPT2_SMALL = GPTConfig(vocab=50304, d_model=768, n_heads=12, n_blocks=12, max_len=1024)
GPT2_MEDIUM = GPTConfig(vocab=50304, d_model=1024, n_heads=16, n_blocks=24, max_len=1024)


def tiny_width(cfg: GPTConfig, *, per_head: int = 4, vocab: int = 512, max_len: int = 32) -> GPTConfig:
    """``cfg``'s op structure (blocks, heads) at a tiny width (``per_head`` features a head),
    vocabulary and context: the same calls per step at next to no arithmetic, for CPU runs
    and the GPU check's dry run.

    Example::

        tiny_width(GPT2_MEDIUM)   # 24 blocks, 16 heads, d_model 64, vocab 512, max_len 32
    """
    return dataclasses.replace(cfg, d_model=cfg.n_heads * per_head, vocab=vocab, max_len=max_len)


def gpt2(cfg: GPTConfig) -> GPT:
    """A ``GPT`` with its head tied to the token embedding, as GPT-2's (``copy.deepcopy``
    keeps the tie).

    Example::

        model = gpt2(tiny_width(GPT2_MEDIUM))
    """
    model = GPT(cfg)
    model.head.weight = model.tok.weight
    return model


def gpt_batch(cfg: GPTConfig, batch: int, seq: int, generator=None):
    idx = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=generator)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


class CNN(nn.Module):
    """Conv2d (with bias) + BatchNorm2d + ReLU + MaxPool2d, twice, then a Linear head."""

    def __init__(self, channels: int = 3, classes: int = 10, width: int = 16, size: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=True),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=True),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * width * (size // 4) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x), y)


class RNNTagger(nn.Module):
    """Embedding + nn.LSTM (or nn.GRU, nn.RNN) + Linear, a per-token tagger."""

    def __init__(self, vocab: int = 100, emb: int = 32, hidden: int = 48, tags: int = 12,
                 cell: str = "lstm", layers: int = 1):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[cell]
        self.rnn = rnn(emb, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, tags)
        self.vocab, self.tags = vocab, tags

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(idx))
        return self.out(h)

    def loss(self, idx: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, self.tags), tags.reshape(-1))


class EncoderClassifier(nn.Module):
    """nn.TransformerEncoderLayer (batch_first) over a Linear input projection."""

    def __init__(self, d_in: int = 24, d_model: int = 32, heads: int = 4, classes: int = 5,
                 norm_first: bool = False):
        super().__init__()
        self.inp = nn.Linear(d_in, d_model)
        self.layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=64, dropout=0.0, batch_first=True,
            norm_first=norm_first,
        )
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.inp(x)).mean(1))


class ResidualMLP(nn.Module):
    """Many small layers (Linear + SiLU + residual): a model whose step time is mostly
    per-call overhead, where a Python-level autocast pays the most."""

    def __init__(self, width: int = 64, depth: int = 24, classes: int = 10):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return self.head(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.forward(x), y)


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1, 3x3 (stride here), 1x1 convolutions without bias, each
    followed by BatchNorm2d; ReLU; a projection shortcut where the shape changes."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        out = planes * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out)
        self.down = None
        if stride != 1 or inplanes != out:
            self.down = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return F.relu(h + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """A ResNet with bottleneck blocks; the defaults are ResNet-50's shape (blocks 3, 4, 6, 3;
    width 64; 1000 classes: 25.6M parameters, as torchvision's resnet50). Plain ``torch.nn``,
    so no torchvision is needed."""

    def __init__(self, blocks=(3, 4, 6, 3), width: int = 64, classes: int = 1000, channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(channels, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        layers, inplanes = [], width
        for i, n in enumerate(blocks):
            planes = width * 2**i
            for j in range(n):
                layers.append(Bottleneck(inplanes, planes, stride=2 if (j == 0 and i > 0) else 1))
                inplanes = planes * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x), y)
