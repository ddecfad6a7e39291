"""Python decompositions of C++ composite ops whose insides native autocast casts.

Some composite ops are not in native's tables but call ops that are (``F.linear`` inside
``lstm_cell``) from C++, where native autocast sees them above autograd and our function
level cannot. Casting such an op whole gives the wrong dtype (a GRU's gates mix bf16
matmuls with the fp32 hidden state and come out fp32 natively), and leaving it alone
runs its matmuls in fp32 or fails on mixed inputs. So the function level runs these
Python versions instead, with itself active: the ``F.linear`` calls inside are cast as
native casts them and everything else follows ordinary type promotion.

Each decomposition follows its C++ original (aten/src/ATen/native/RNN.cpp, CPU path;
PadNd.cpp for ``pad``; LossNLL.cpp for ``cross_entropy_loss``) op for op, in-place ops included, so values and autograd graphs are the same. It is used
only when the op is in no table of the active policy (the CUDA table casts these ops
whole, as cuDNN does) and returns ``NOT_HANDLED`` for call forms it does not cover,
which then run as given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["DECOMPOSITIONS", "NOT_HANDLED"]

NOT_HANDLED = object()


def lstm_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    h, c = hx
    gates = F.linear(h, w_hh, b_hh).add_(F.linear(input, w_ih, b_ih))
    return _lstm_gates(gates, c)


def _lstm_gates(gates, c):
    ingate, forgetgate, cellgate, outgate = gates.unsafe_chunk(4, 1)
    ingate = ingate.sigmoid_()
    forgetgate = forgetgate.sigmoid_()
    cellgate = cellgate.tanh_()
    outgate = outgate.sigmoid_()
    cy = (forgetgate * c).add_(ingate * cellgate)
    hy = outgate * cy.tanh()
    return hy, cy


def gru_cell(input, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    return _gru_step(F.linear(input, w_ih, b_ih), hx, w_hh, b_hh)


def _gru_step(input_gates, hidden, w_hh, b_hh):
    i_r, i_z, i_n = input_gates.unsafe_chunk(3, 1)
    h_r, h_z, h_n = F.linear(hidden, w_hh, b_hh).unsafe_chunk(3, 1)
    reset_gate = h_r.add_(i_r).sigmoid_()
    input_gate = h_z.add_(i_z).sigmoid_()
    new_gate = i_n.add(h_n.mul_(reset_gate)).tanh_()
    return (hidden - new_gate).mul_(input_gate).add_(new_gate)


def _gru_direction(inputs, hidden, w_ih, w_hh, b_ih, b_hh, reverse):
    # The CPU path projects the whole sequence at once, then steps through it.
    steps = F.linear(inputs, w_ih, b_ih).unbind(0)
    if reverse:
        steps = steps[::-1]
    outputs = []
    for step in steps:
        hidden = _gru_step(step, hidden, w_hh, b_hh)
        outputs.append(hidden)
    if reverse:
        outputs.reverse()
    return torch.stack(outputs, 0), hidden


def gru(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first=None):
    if not isinstance(hx, torch.Tensor) or batch_first is None or input.dim() != 3:
        return NOT_HANDLED  # the packed-sequence form: gru(data, batch_sizes, hx, ...)
    if batch_first:
        input = input.transpose(0, 1)
    directions = 2 if bidirectional else 1
    per_direction = 4 if has_biases else 2
    hiddens = hx.unbind(0)
    finals = []
    layer_input = input
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            weights = params[index * per_direction:(index + 1) * per_direction]
            w_ih, w_hh = weights[0], weights[1]
            b_ih, b_hh = (weights[2], weights[3]) if has_biases else (None, None)
            out, final = _gru_direction(
                layer_input, hiddens[index], w_ih, w_hh, b_ih, b_hh, reverse=direction == 1
            )
            outputs.append(out)
            finals.append(final)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, outputs[0].dim() - 1)
        if dropout != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout, train)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return output, torch.stack(finals, 0)


def pad(input, pad, mode="constant", value=None):
    # F.pad picks reflection_padNd / replication_padNd in C++; native CPU autocast runs
    # several of those in fp32, so the pick has to happen where we can see it.
    if mode not in ("reflect", "replicate") or value is not None or len(pad) % 2:
        return NOT_HANDLED
    family = "reflection" if mode == "reflect" else "replication"
    op = getattr(torch._C._nn, f"{family}_pad{len(pad) // 2}d", None)
    return NOT_HANDLED if op is None else op(input, pad)


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
# After (input, target, weight): the aten signature's arguments, and F.cross_entropy's.
_ATEN_CE_ARGS = ("reduction", "ignore_index", "label_smoothing")
_FUNCTIONAL_CE_ARGS = ("size_average", "ignore_index", "reduce", "reduction", "label_smoothing")


def _cross_entropy_options(args, kwargs):
    """reduction (as a string), ignore_index and label_smoothing from either signature;
    None when F.cross_entropy's legacy size_average/reduce are given."""
    reduction = kwargs.get("reduction", args[0] if args else None)
    if isinstance(reduction, int) and not isinstance(reduction, bool):  # aten: an enum
        options = {**dict(zip(_ATEN_CE_ARGS, args)), **kwargs}
        options["reduction"] = _REDUCTIONS[options["reduction"]]
        return options
    options = {**dict(zip(_FUNCTIONAL_CE_ARGS, args)), **kwargs}
    if options.pop("size_average", None) is not None or options.pop("reduce", None) is not None:
        return None
    return options


def cross_entropy_loss(input, target, weight=None, *args, **kwargs):
    """``F.cross_entropy`` (or ``torch._C._nn.cross_entropy_loss``) as LossNLL.cpp composes it.

    Native CUDA autocast does not register ``cross_entropy_loss``: the C++ composite calls
    ``log_softmax(input, dim, dtype=input.dtype)``, which its fp32-unless-dtype rule leaves
    in the low dtype because the dtype is given, then ``nll_loss`` (float32) and, with label
    smoothing or probability targets, sums (float32). Made here from the same calls, the
    function level casts each one as native does (measured on an H100: native's float16
    loss is ``nll_loss(log_softmax(x16).float())``, not the float32 cross entropy).
    """
    options = _cross_entropy_options(args, kwargs)
    if options is None:
        return NOT_HANDLED  # the legacy arguments: F.cross_entropy resolves them itself
    reduction = options.get("reduction", "mean")
    ignore_index = options.get("ignore_index", -100)
    label_smoothing = options.get("label_smoothing", 0.0)
    if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor) or reduction not in ("none", "mean", "sum"):
        return NOT_HANDLED
    if weight is not None and type(weight) is not torch.Tensor and label_smoothing > 0:
        return NOT_HANDLED  # the tensor-subclass branch of the C++ original
    class_dim = 0 if input.dim() == 1 else 1
    log_probs = torch.log_softmax(input, class_dim, dtype=input.dtype)
    if input.shape == target.shape:
        return _cross_entropy_probabilities(log_probs, target, weight, reduction, label_smoothing, class_dim)
    nll = F.nll_loss(log_probs, target, weight, ignore_index=ignore_index, reduction=reduction)
    if label_smoothing <= 0.0:
        return nll
    n_classes = log_probs.shape[class_dim]
    if weight is not None:
        shape = [1] * log_probs.dim()
        shape[class_dim] = weight.shape[0]
        smooth = -(log_probs * weight.view(shape)).sum(class_dim)
    else:
        smooth = -log_probs.sum(class_dim)
    ignored = target == ignore_index
    smooth.masked_fill_(ignored, 0.0)
    if reduction == "mean":
        if weight is not None:
            smooth = smooth.sum() / weight.gather(0, target.masked_select(~ignored).flatten()).sum()
        else:
            smooth = smooth.sum() / (~ignored).sum()
    elif reduction == "sum":
        smooth = smooth.sum()
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / n_classes)


def _cross_entropy_probabilities(log_probs, target, weight, reduction, label_smoothing, class_dim):
    n_classes = log_probs.shape[class_dim]
    if label_smoothing > 0.0:
        target = target * (1 - label_smoothing) + label_smoothing / n_classes
    product = log_probs * target
    if weight is not None and log_probs.dim() > 1:
        shape = [1] * log_probs.dim()
        shape[1] = weight.shape[0]
        product = product * weight.view(shape)
    elif weight is not None:
        product = product * weight
    if reduction == "none":
        return -product.sum(class_dim)
    total = -product.sum()
    if reduction == "sum":
        return total
    if log_probs.numel() == 0:
        return total.fill_(float("nan"))
    return total / (log_probs.numel() // n_classes)


# aten op name -> decomposition
DECOMPOSITIONS = {
    "lstm_cell": lstm_cell,
    "gru_cell": gru_cell,
    "gru": gru,
    "pad": pad,
    "cross_entropy_loss": cross_entropy_loss,
}
