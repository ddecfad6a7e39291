"""fp8 trains like bfloat16: a small character GPT, 300 steps, fp8 against bf16."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dispatch_amp as amp
from dispatch_amp import fp8
from dispatch_amp.demo import load_corpus

D, HEADS, LAYERS, SEQ, BATCH, STEPS = 64, 4, 2, 32, 16, 300


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, D // HEADS).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, D))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, D), nn.Embedding(SEQ, D)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, vocab)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.norm(self.blocks(x)))


def _data():
    text = load_corpus()
    alphabet = sorted(set(text))
    ids = torch.tensor([alphabet.index(c) for c in text])
    split = int(0.9 * len(ids))
    return ids[:split], ids[split:], len(alphabet)


def _batch(ids, g):
    starts = torch.randint(0, len(ids) - SEQ - 1, (BATCH,), generator=g)
    x = torch.stack([ids[s:s + SEQ] for s in starts])
    y = torch.stack([ids[s + 1:s + SEQ + 1] for s in starts])
    return x, y


def _train(recipe):
    train, held_out, vocab = _data()
    torch.manual_seed(0)
    model = TinyGPT(vocab)
    if recipe is not None:
        recipe.bind(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(STEPS):
        x, y = _batch(train, g)
        with amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad(), amp.autocast("cpu", dtype=torch.bfloat16, fp8=recipe):
        held = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                   for x, y in (_batch(held_out, g) for _ in range(8))) / 8
    return losses, held


@pytest.fixture(scope="module")
def bf16_run():
    return _train(None)


@pytest.mark.parametrize("make", [fp8.CurrentScaling, fp8.DelayedScaling, fp8.RowwiseScaling],
                         ids=lambda m: m.__name__)
def test_fp8_training_follows_bf16(bf16_run, make):
    recipe = make()
    losses, held = _train(recipe)
    ref_losses, ref_held = bf16_run
    mean_diff = sum(abs(a - b) for a, b in zip(losses, ref_losses)) / STEPS
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 1.0  # it learned
    assert mean_diff <= 0.02, f"mean |loss difference| {mean_diff:.4f}"
    assert abs(held - ref_held) <= 0.02, f"held-out loss {held:.4f} against bf16 {ref_held:.4f}"
    # Every linear of the blocks ran in fp8 (the 3 x 4 block linears; the head's output
    # width is the alphabet's size, not a multiple of 16, unless it is).
    assert len(recipe.report()) >= 4 * LAYERS
