"""``amp_metrics``: a loss scaler's numbers under ``amp/`` names, for any logger.

Framework-free: every integration's logging goes through it, and a loop of your own can
pass it to its logger directly.
"""

from __future__ import annotations

__all__ = ["amp_metrics"]


def amp_metrics(scaler) -> dict[str, float]:
    """The loss scaler's numbers under ``amp/`` names, for a logger (one host sync).

    ``amp/loss_scale``, ``amp/skipped_steps`` and ``amp/overflow_params`` (how many
    gradients held inf/nan on the last step: 0 when it was not skipped), from
    ``GradScaler.metrics()``; for torch's GradScaler the scale alone; ``{}`` without a
    scaler (bfloat16). The keys are the same on every call for one scaler, so loggers
    with a fixed set of columns (CSV writers such as timm's ``summary.csv``) get whole
    rows, and a logger that keeps a value until it is logged again (Lightning, within an
    epoch) shows each step's own count.

    Example::

        >>> from dispatch_amp import GradScaler
        >>> amp_metrics(GradScaler("cpu", init_scale=256.0))
        {'amp/loss_scale': 256.0, 'amp/skipped_steps': 0, 'amp/overflow_params': 0}
    """
    if scaler is None:
        return {}
    if not hasattr(scaler, "metrics"):
        return {"amp/loss_scale": float(scaler.get_scale())}
    m = scaler.metrics()
    return {"amp/loss_scale": m["loss_scale"], "amp/skipped_steps": m["skipped_steps"],
            "amp/overflow_params": m["overflow_params"]}

