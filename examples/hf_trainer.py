"""Train a tiny GPT-2 (random init from a config, synthetic tokens) with transformers.Trainer on dispatch_amp.

The only change from the stock Trainer is where Trainer is imported from;
TrainingArguments' bf16=True / fp16=True still choose the precision.

Run: python examples/hf_trainer.py [--steps 20] [--fp16]
"""

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from dispatch_amp.integrations.transformers import Trainer  # was: from transformers import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fp16", action="store_true", help="float16 with a GradScaler instead of bfloat16")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    # Synthetic sequences with structure to learn: each token is the previous one plus one.
    starts = torch.randint(0, 128, (64, 1))
    ids = (starts + torch.arange(16)) % 128
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, use_cpu=True, max_steps=args.steps, per_device_train_batch_size=8,
            learning_rate=3e-3, report_to=[], save_strategy="no", logging_strategy="no",
            disable_tqdm=True, fp16=args.fp16, bf16=not args.fp16,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
        result = trainer.train()
    scaler = trainer.accelerator.scaler
    print(f"transformers Trainer + dispatch_amp: {result.global_step} steps, "
          f"mean loss {result.training_loss:.4f}, loss scale "
          f"{scaler.get_scale() if scaler is not None else 'none (bf16)'}")


if __name__ == "__main__":
    main()
