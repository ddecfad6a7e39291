"""transformers.Trainer: ours trains bit-identically to the Trainer's own AMP, and its
checkpoints resume in either direction: with the scale kept where both have a GradScaler
(scaler.pt), and in the stock Trainer also from CPU float16, where only ours has one."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dispatch_amp as amp  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from dispatch_amp.integrations.transformers import AMP_SCALER_NAME, AmpTrainerMixin, Trainer  # noqa: E402

INIT = {"init_scale": 2.0**8, "growth_interval": 2}
INF_STEP = 4


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


class Recording:
    """Records the parameters training starts from, and per optimizer step the loss, the
    clipped gradients, the loss scale and the parameters; turns the loss at ``inf_step``
    into inf so that step overflows."""

    inf_step = INF_STEP

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses, self.grads, self.scales, self.params = [], [], [], []
        self.add_callback(_Recorder(self))

    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        if self.state.global_step == self.inf_step:
            loss = loss * float("inf")
        self.losses.append(loss.detach().clone())
        return loss


class _Recorder(transformers.TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.trainer.start_params = [p.detach().clone() for p in model.parameters()]

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.trainer.grads.append([p.grad.detach().clone() for p in model.parameters()])

    def on_step_end(self, args, state, control, model=None, **kwargs):
        scaler = self.trainer.accelerator.scaler
        self.trainer.scales.append(scaler.get_scale() if scaler is not None else None)
        self.trainer.params.append([p.detach().clone() for p in model.parameters()])


class _GpuLikeScaler:
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if self.args.fp16:
            # The Trainer's accelerate turns fp16 off on CPU; on a GPU it sets exactly these
            # two attributes, so setting them here runs the Trainer's own fp16 path on CPU.
            self.accelerator.native_amp = True
            self.accelerator.scaler = torch.amp.GradScaler("cpu", **INIT)


class NativeTrainer(Recording, _GpuLikeScaler, transformers.Trainer):
    """The stock Trainer as it runs fp16 on a GPU."""


class StockTrainer(Recording, transformers.Trainer):
    """The stock Trainer as it runs on CPU: fp16=True gives no scaler and float32."""


class OurTrainer(Recording, Trainer):
    pass


class OurGpuLikeTrainer(Recording, AmpTrainerMixin, _GpuLikeScaler, transformers.Trainer):
    """Ours on an Accelerator that, as on a GPU, came with a stock scaler for fp16."""


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


def _run(cls, tmp_path, precision, steps=6, resume=None, name="run", inf_step=INF_STEP, plan=None):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / name), use_cpu=True, max_steps=steps,
        per_device_train_batch_size=2, learning_rate=1e-3, seed=0, report_to=[],
        save_strategy="steps", save_steps=3, logging_strategy="no", disable_tqdm=True,
        **{precision: True},
    )
    extra = {"amp_scaler_options": INIT} if issubclass(cls, AmpTrainerMixin) and precision == "fp16" else {}
    model = _model()
    if plan is not None:
        plan.bind(model)
    trainer = cls(model=model, args=args, train_dataset=_dataset(), **extra)
    trainer.inf_step = inf_step
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

    # Each run saved checkpoint-3 on the way; resume ours from both. On CPU ours keeps its
    # scale out of scaler.pt, where the stock Trainer has no scaler to load it into.
    for source, scaler_file in (("ours", AMP_SCALER_NAME), ("native", "scaler.pt")):
        checkpoint = tmp_path / source / "checkpoint-3"
        assert torch.load(checkpoint / scaler_file, weights_only=True)["scale"] == ours.scales[2] != INIT["init_scale"]
        tail = _run(OurTrainer, tmp_path, "fp16", resume=str(checkpoint), name=f"from-{source}")
        assert len(tail.losses) == 3 and tail.scales == ours.scales[3:]
        assert same(tail.losses, ours.losses[3:]) and same(tail.grads, ours.grads[3:])
        assert same(list(tail.model.parameters()), list(ours.model.parameters()))


def test_on_cpu_ours_keeps_the_fp16_scale_out_of_scaler_pt_and_resumes_it(tmp_path, same):
    ours = _run(OurTrainer, tmp_path, "fp16", name="ours")
    checkpoint = tmp_path / "ours" / "checkpoint-3"
    assert not (checkpoint / "scaler.pt").exists()
    state = torch.load(checkpoint / AMP_SCALER_NAME, weights_only=True)
    assert state["scale"] == ours.scales[2] != INIT["init_scale"]

    tail = _run(OurTrainer, tmp_path, "fp16", resume=str(checkpoint), name="tail")
    assert tail.scales == ours.scales[3:] and tail.accelerator.scaler.skipped_steps == 1
    assert tail.inner_dtypes == {torch.float16}
    assert same(tail.losses, ours.losses[3:]) and same(tail.grads, ours.grads[3:])
    assert same(list(tail.model.parameters()), list(ours.model.parameters()))

    # Resumed without loss scaling, the float16 scale has no use and is left out.
    AcceleratorState._reset_state(True)
    plain = _run(OurTrainer, tmp_path, "bf16", resume=str(checkpoint), name="bf16", inf_step=None)
    assert plain.accelerator.scaler is None and plain.state.global_step == 6
    assert same(plain.start_params, ours.params[2])


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_cpu_fp16_checkpoint_of_ours_resumes_in_the_stock_trainer(tmp_path, same, precision):
    ours = _run(OurTrainer, tmp_path, "fp16", name="ours")
    AcceleratorState._reset_state(True)
    stock = _run(StockTrainer, tmp_path, precision, resume=str(tmp_path / "ours" / "checkpoint-3"),
                 name="stock", inf_step=None)
    assert stock.accelerator.scaler is None, "the stock Trainer has no scaler on CPU"
    # fp16=True leaves the stock Trainer in float32 on CPU; bf16=True autocasts.
    expected = torch.float32 if precision == "fp16" else torch.bfloat16
    assert stock.inner_dtypes == {expected} and stock.scales == [None] * 3
    assert stock.state.global_step == 6 and all(torch.isfinite(loss) for loss in stock.losses)
    # Model and optimizer continue from the checkpoint: the weights ours had after step 3,
    # and Adam's step count going on from 3.
    assert same(stock.start_params, ours.params[2])
    assert {int(s["step"]) for s in stock.optimizer.state.values()} == {6}


def test_where_the_stock_trainer_has_a_scaler_ours_writes_scaler_pt_for_it(tmp_path, same):
    ours = _run(OurGpuLikeTrainer, tmp_path, "fp16", name="ours")
    assert isinstance(ours.accelerator.scaler, amp.GradScaler)
    checkpoint = tmp_path / "ours" / "checkpoint-3"
    assert not (checkpoint / AMP_SCALER_NAME).exists()
    assert torch.load(checkpoint / "scaler.pt", weights_only=True)["scale"] == ours.scales[2] != INIT["init_scale"]

    AcceleratorState._reset_state(True)
    native = _run(NativeTrainer, tmp_path, "fp16", resume=str(checkpoint), name="native")
    assert isinstance(native.accelerator.scaler, torch.amp.GradScaler)
    assert native.scales == ours.scales[3:] and native.inner_dtypes == {torch.float16}
    assert same(native.losses, ours.losses[3:]) and same(native.grads, ours.grads[3:])
    assert same(list(native.model.parameters()), list(ours.model.parameters()))


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


class _LogReporter(transformers.TrainerCallback):
    """Stands for TensorBoard & co.: what the reporting callbacks receive."""

    def __init__(self, seen):
        self.seen = seen

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def test_amp_metrics_reach_the_trainers_logs_and_show_the_skipped_step(tmp_path):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "logs"), use_cpu=True, max_steps=6, per_device_train_batch_size=2,
        learning_rate=1e-3, seed=0, report_to=[], save_strategy="no", logging_strategy="steps",
        logging_steps=1, disable_tqdm=True, fp16=True,
    )
    AcceleratorState._reset_state(True)
    trainer = OurTrainer(model=_model(), args=args, train_dataset=_dataset(), amp_scaler_options=INIT)
    trainer.inf_step = INF_STEP
    seen = []
    trainer.add_callback(_LogReporter(seen))
    trainer.train()
    logged = [h for h in trainer.state.log_history if "amp/loss_scale" in h]
    assert len(logged) == 6 and [h["amp/loss_scale"] for h in logged] == trainer.scales
    assert [h["amp/skipped_steps"] for h in logged] == [0] * INF_STEP + [1] * (6 - INF_STEP)
    # Every log has the key (fixed schema); the skipped step's count is the true one, also
    # with the Trainer's default fused AdamW, which skips on the device.
    assert trainer.args.optim == "adamw_torch_fused" and trainer.optimizer.optimizer.defaults["fused"]
    overflowing = sum(1 for g in trainer.grads[INF_STEP] if not torch.isfinite(g).all())
    assert overflowing > 0
    assert [h["amp/overflow_params"] for h in logged] == [overflowing if k == INF_STEP else 0 for k in range(6)]
    assert [s["amp/skipped_steps"] for s in seen if "amp/skipped_steps" in s] == [h["amp/skipped_steps"] for h in logged]


def test_the_callback_adds_the_metrics_for_a_stock_trainer(tmp_path):
    from dispatch_amp.integrations.accelerate import install_amp
    from dispatch_amp.integrations.transformers import AmpMetricsCallback

    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=2,
                                          report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    AcceleratorState._reset_state(True)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_dataset())
    install_amp(trainer.accelerator, dtype="fp16")
    seen = []
    trainer.add_callback(_LogReporter(seen))
    trainer.callback_handler.callbacks.insert(0, AmpMetricsCallback(trainer.accelerator))
    trainer.train()
    assert [s["amp/loss_scale"] for s in seen if "loss" in s] == [65536.0, 65536.0]


def test_fp16_on_cpu_trains_float16_and_says_the_stock_trainer_stays_float32(tmp_path):
    import warnings

    def args(**precision):
        return transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", **precision)

    with pytest.warns(UserWarning, match="stock transformers Trainer ignores fp16 here and trains in float32") as caught:
        trainer = Trainer(model=_model(), args=args(fp16=True))
    ours = [w for w in caught if "dispatch_amp's Trainer" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__, "the warning points at the user's line"
    assert trainer.accelerator.dispatch_amp.dtype is torch.float16 and isinstance(trainer.accelerator.scaler, amp.GradScaler)
    AcceleratorState._reset_state(True)
    stock = transformers.Trainer(model=_model(), args=args(fp16=True))
    assert stock.accelerator.scaler is None and not stock.accelerator.native_amp  # float32, silently
    for kwargs in ({"bf16": True}, {}):
        AcceleratorState._reset_state(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Trainer(model=_model(), args=args(**kwargs))
        assert not [w for w in caught if "dispatch_amp's Trainer" in str(w.message)]
    # Where the stock Trainer runs float16 too (a GPU), there is nothing to say.
    AcceleratorState._reset_state(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        OurGpuLikeTrainer(model=_model(), args=args(fp16=True))
    assert not [w for w in caught if "dispatch_amp's Trainer" in str(w.message)]


def test_a_resume_runs_the_policy_the_checkpoint_was_trained_with(tmp_path, same):
    # The checkpoint holds its policy as a reviewable file; a Trainer resumed without
    # amp_policy runs it (warning), and continues as the uninterrupted run did.
    policy = amp.Policy.for_device("cpu").with_ops(fp32=["linear", "addmm", "mm"], name="gemms in fp32")

    class PolicyTrainer(OurTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, amp_policy=PolicyTrainer.policy, **kwargs)

    PolicyTrainer.policy = policy
    whole = _run(PolicyTrainer, tmp_path, "bf16", name="whole", inf_step=None)
    assert whole.inner_dtypes == {torch.float32}
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert amp.config.load(checkpoint / "dispatch_amp_policy.json") == policy

    AcceleratorState._reset_state(True)
    PolicyTrainer.policy = None
    with pytest.warns(amp.AmpNumericsWarning, match="'gemms in fp32' differs.*resumes with the checkpoint's"):
        tail = _run(PolicyTrainer, tmp_path, "bf16", resume=str(checkpoint), name="tail", inf_step=None)
    assert tail.accelerator.dispatch_amp.policy == policy and tail.inner_dtypes == {torch.float32}
    assert same(tail.losses, whole.losses[3:]) and same(list(tail.model.parameters()), list(whole.model.parameters()))


def test_a_resume_runs_the_precision_plan_the_checkpoint_was_trained_with(tmp_path, same):
    # The first block's MLP in float32 by a plan; the resumed Trainer's model has no plan
    # bound: the checkpoint's is bound (warning), and the run continues as the whole one did.
    from dispatch_amp.autocast.plan import bound_plan

    whole = _run(OurTrainer, tmp_path, "bf16", name="whole", inf_step=None,
                 plan=amp.PrecisionPlan({"transformer.h.0.mlp": torch.float32}))
    assert whole.inner_dtypes == {torch.float32}
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    assert (checkpoint / "dispatch_amp_plan.pt").is_file()

    AcceleratorState._reset_state(True)
    with pytest.warns(amp.AmpNumericsWarning, match="no plan is bound.*resumes with the checkpoint's"):
        tail = _run(OurTrainer, tmp_path, "bf16", resume=str(checkpoint), name="tail", inf_step=None)
    assert bound_plan(tail.model) is not None and tail.inner_dtypes == {torch.float32}
    assert same(tail.losses, whole.losses[3:]) and same(list(tail.model.parameters()), list(whole.model.parameters()))


def test_a_bad_policy_file_in_a_checkpoint_fails_naming_the_line(tmp_path):
    whole = _run(OurTrainer, tmp_path, "bf16", name="whole", inf_step=None)
    path = tmp_path / "whole" / "checkpoint-3" / "dispatch_amp_policy.json"
    path.write_text(path.read_text().replace('"fp32"', '"fp23"'))
    AcceleratorState._reset_state(True)
    with pytest.raises(amp.config.ConfigError, match=r"dispatch_amp_policy.json:\d+: rules.fp23: unknown cast kind"):
        _run(OurTrainer, tmp_path, "bf16", resume=str(path.parent), name="tail", inf_step=None)
    assert whole.accelerator.dispatch_amp.policy is None
