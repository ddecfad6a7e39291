"""Train a small classifier with the Lightning Trainer on dispatch_amp (float16 + GradScaler).

The only change from Lightning's own AMP plugin is where MixedPrecision is imported from.

Run: python examples/lightning_trainer.py [--steps 20] [--precision bf16-mixed]
"""

import argparse
import warnings

import lightning.pytorch as pl
import torch

from dispatch_amp.integrations.lightning import MixedPrecision  # was: lightning.pytorch.plugins


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x).float(), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", default="16-mixed", choices=["16-mixed", "bf16-mixed"])
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(256, 32)
    y = x[:, :4].argmax(dim=1)                     # a learnable target
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    plugin = MixedPrecision(args.precision, "cpu")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        gradient_clip_val=1.0,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(Classifier(), loader)
    scale = plugin.scaler.get_scale() if plugin.scaler is not None else "none (bf16)"
    print(f"lightning Trainer + dispatch_amp: {trainer.global_step} steps, "
          f"loss {trainer.callback_metrics['loss']:.4f}, loss scale {scale}")


if __name__ == "__main__":
    main()
