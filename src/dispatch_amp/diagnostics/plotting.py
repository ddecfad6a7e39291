"""``plot_training``: a PNG of loss and loss scale over steps (needs matplotlib).

matplotlib is an optional extra (``pip install "dispatch-amp[plot]"``); without it the
function raises ``ImportError`` saying so, and nothing else in the package needs it.

Example::

    amp.plot_training({"ours": losses}, "run.png", scales={"ours": scaler.scale_history()})
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

__all__ = ["plot_training"]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plot_training needs matplotlib, an optional extra: "
            'pip install "dispatch-amp[plot]" (or pip install matplotlib)'
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_training(
    losses: Mapping[str, Sequence[float]],
    path: str | os.PathLike,
    *,
    scales: Mapping[str, Sequence[tuple[int, float, bool]]] | None = None,
    title: str = "training",
) -> str:
    """Writes a PNG with the loss of each run and, if given, each run's loss scale.

    Args:
        losses: run name -> loss per step.
        path: where to write the PNG.
        scales: run name -> ``(step, scale, skipped)`` rows, as
            ``GradScaler.scale_history()`` returns them; skipped steps are marked.
        title: the figure title.

    Returns the path written.

    Example::

        plot_training({"fp32": [2.1, 1.9], "bf16": [2.1, 1.95]}, "loss.png")
    """
    plt = _pyplot()
    with_scale = bool(scales) and any(len(rows) for rows in scales.values())
    fig, axes = plt.subplots(
        2 if with_scale else 1, 1, figsize=(8, 6 if with_scale else 3.5), squeeze=False
    )
    ax = axes[0][0]
    styles = ("-", "--", ":", "-.")  # runs often overlap: keep each one visible
    for i, (name, values) in enumerate(losses.items()):
        ax.plot(range(1, len(values) + 1), list(values), styles[i % len(styles)], label=name,
                linewidth=1.4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if with_scale:
        draw_scales(axes[1][0], scales)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_scales(ax, scales) -> None:
    """Draws each run's loss scale on ``ax`` (log 2 axis), marking skipped steps.

    ``scales``: run name -> ``(step, scale, skipped)`` rows, as ``GradScaler.scale_history()``.

    Example::

        draw_scales(ax, {"fp16": scaler.scale_history()})
    """
    for name, rows in scales.items():
        if not rows:
            continue
        ax.step([r[0] for r in rows], [r[1] for r in rows], where="post", label=f"{name} scale")
        skipped = [(r[0], r[1]) for r in rows if r[2]]
        if skipped:
            ax.scatter(*zip(*skipped), marker="x", color="red", label=f"{name} skipped")
    ax.set_yscale("log", base=2)
    ax.set(xlabel="step", ylabel="loss scale")
    ax.grid(alpha=0.3)
    ax.legend()
