"""transformers.Trainer: ours trains bit-identically to the Trainer's own AMP, and its
checkpoints (scaler.pt) resume in either direction with the scale kept."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dispatch_amp as amp  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from dispatch_amp.integrations.transformers import AmpTrainerMixin, Trainer  # noqa: E402

INIT = {"init_scale": 2.0**8, "growth_interval": 2}
INF_STEP = 4


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


class Recording:
    """Records per optimizer step the loss, the clipped gradients and the loss scale, and
    turns the loss at INF_STEP into inf so that step overflows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses, self.grads, self.scales = [], [], []
        self.add_callback(_Recorder(self))

    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        if self.state.global_step == INF_STEP:
            loss = loss * float("inf")
        self.losses.append(loss.detach().clone())
        return loss


class _Recorder(transformers.TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.trainer.grads.append([p.grad.detach().clone() for p in model.parameters()])

    def on_step_end(self, args, state, control, **kwargs):
        scaler = self.trainer.accelerator.scaler
        self.trainer.scales.append(scaler.get_scale() if scaler is not None else None)


class NativeTrainer(Recording, transformers.Trainer):
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if self.args.fp16:
            # The Trainer's accelerate turns fp16 off on CPU; on a GPU it sets exactly these
            # two attributes, so setting them here runs the Trainer's own fp16 path on CPU.
            self.accelerator.native_amp = True
            self.accelerator.scaler = torch.amp.GradScaler("cpu", **INIT)


class OurTrainer(Recording, Trainer):
    pass


def _model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _dataset():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (16, 8), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _run(cls, tmp_path, precision, steps=6, resume=None, name="run"):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), use_cpu=True, max_steps=steps,
        per_device_train_batch_size=2, learning_rate=1e-3, seed=0, report_to=[],
        save_strategy="steps", save_steps=3, logging_strategy="no", disable_tqdm=True,
        **{precision: True},
    )
    extra = {"amp_scaler_options": INIT} if cls is OurTrainer and precision == "fp16" else {}
    trainer = cls(model=_model(), args=args, train_dataset=_dataset(), **extra)
    # What the autocast made of one matmul inside the model, per forward.
    trainer.inner_dtypes = set()
    trainer.model.transformer.h[0].mlp.c_fc.register_forward_hook(
        lambda module, inputs, out: trainer.inner_dtypes.add(out.dtype))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_bf16_is_bit_identical_to_the_trainers_own(tmp_path, same):
    native = _run(NativeTrainer, tmp_path, "bf16", steps=3, name="native")
    ours = _run(OurTrainer, tmp_path, "bf16", steps=3, name="ours")
    assert ours.accelerator.dispatch_amp.dtype is torch.bfloat16 and not ours.accelerator.native_amp
    assert len(ours.losses) == 3 and ours.inner_dtypes == native.inner_dtypes == {torch.bfloat16}
    assert same(ours.losses, native.losses) and same(ours.grads, native.grads)
    assert same(list(ours.model.parameters()), list(native.model.parameters()))


def test_fp16_and_resume_are_bit_identical_in_both_directions(tmp_path, same):
    native = _run(NativeTrainer, tmp_path, "fp16", name="native")
    ours = _run(OurTrainer, tmp_path, "fp16", name="ours")
    assert isinstance(ours.accelerator.scaler, amp.GradScaler)
    assert len(ours.scales) == 6 and ours.scales == native.scales
    assert not torch.isfinite(ours.losses[INF_STEP])
    assert ours.inner_dtypes == native.inner_dtypes == {torch.float16}
    assert ours.scales[INF_STEP] == ours.scales[INF_STEP - 1] / 2, "the overflow step backs off"
    assert ours.accelerator.scaler.skipped_steps == 1
    assert same(ours.losses, native.losses) and same(ours.grads, native.grads)
    assert same(list(ours.model.parameters()), list(native.model.parameters()))

    # Each run saved checkpoint-3 on the way; resume ours from both.
    for source in ("ours", "native"):
        checkpoint = tmp_path / source / "checkpoint-3"
        assert torch.load(checkpoint / "scaler.pt", weights_only=True)["scale"] == ours.scales[2] != INIT["init_scale"]
        tail = _run(OurTrainer, tmp_path, "fp16", resume=str(checkpoint), name=f"from-{source}")
        assert len(tail.losses) == 3 and tail.scales == ours.scales[3:]
        assert same(tail.losses, ours.losses[3:]) and same(tail.grads, ours.grads[3:])
        assert same(list(tail.model.parameters()), list(ours.model.parameters()))


def test_the_mixin_takes_a_policy_and_checks_its_arguments(tmp_path):
    policy = amp.Policy.for_device("cpu").with_ops(fp32=["linear", "addmm", "mm"])

    class MyTrainer(AmpTrainerMixin, transformers.Trainer):
        pass

    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, bf16=True, report_to=[])
    trainer = MyTrainer(model=_model(), args=args, amp_policy=policy)
    assert trainer.accelerator.dispatch_amp.policy is policy

    AcceleratorState._reset_state(True)
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="set bf16=True or fp16=True"):
        MyTrainer(model=_model(), args=args, amp_policy=policy)


def test_the_mixin_takes_an_fp8_recipe(tmp_path):
    from dispatch_amp import fp8

    recipe = fp8.CurrentScaling()

    class MyTrainer(AmpTrainerMixin, transformers.Trainer):
        pass

    AcceleratorState._reset_state(True)
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, bf16=True, report_to=[])
    trainer = MyTrainer(model=_model(), args=args, amp_fp8=recipe)
    assert trainer.accelerator.dispatch_amp.fp8 is recipe
    AcceleratorState._reset_state(True)
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="amp_fp8 were given"):
        MyTrainer(model=_model(), args=args, amp_fp8=recipe)
