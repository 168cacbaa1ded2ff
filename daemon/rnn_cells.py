"""CPU kernels for the fused LSTM and GRU cell ops, which torch picks for out-of-tree devices.

For an input on a CUDA, XPU or PrivateUse1 device (Genie's remote_accelerator), torch's
LSTM, GRU, LSTMCell and GRUCell compute each step's gates with matmuls and hand the rest to
aten::_thnn_fused_lstm_cell / _thnn_fused_gru_cell, and autograd to their backward ops. torch
has those ops for CUDA only, so a CPU daemon registers them here (where torch has no CPU kernel),
in aten ops, with the CUDA kernels' exact contract: the same outputs, contiguous whatever the
inputs' layout (the client plans them so: genie/frontend/shape_rules.py), the same workspace
layout (the backward reads what the forward stored), an undefined bias gradient without biases.
"""
from __future__ import annotations

import torch

from . import cpu_kernels


def register() -> None:
    """Give the four ops a CPU kernel where torch has none (once per process)."""
    cpu_kernels.register_where_missing(__name__, {
        "_thnn_fused_lstm_cell": lstm_cell,
        "_thnn_fused_lstm_cell_backward_impl": lstm_cell_backward,
        "_thnn_fused_gru_cell": gru_cell,
        "_thnn_fused_gru_cell_backward": gru_cell_backward,
    })


def _gates(input_gates, hidden_gates, input_bias, hidden_bias):
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    return gates


def lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """(hy, cy, workspace): workspace holds the activated gates [i, f, g, o] for the backward."""
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy.contiguous(), cy.contiguous(), torch.cat([i, f, g, o], 1)


def lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, has_bias):
    """(grad of the gates before activation, grad_cx, grad_bias or undefined); all undefined
    when neither output has a gradient."""
    if grad_hy is None and grad_cy is None:
        return None, None, None
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    grad_c = torch.zeros_like(cy) if grad_cy is None else grad_cy
    if grad_hy is not None:
        grad_o = grad_hy * tanh_cy
        grad_c = grad_c + grad_hy * o * (1 - tanh_cy * tanh_cy)
    else:
        grad_o = torch.zeros_like(cy)
    grad_gates = torch.cat([
        grad_c * g * (1 - i) * i,
        grad_c * cx * (1 - f) * f,
        grad_c * i * (1 - g * g),
        grad_o * (1 - o) * o,
    ], 1)
    grad_bias = grad_gates.sum(0) if has_bias else None
    return grad_gates, (grad_c * f).contiguous(), grad_bias


def gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """(hy, workspace): workspace holds [r, z, n, hx, hidden n-gate with its bias] for the backward."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, iz, in_ = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy.contiguous(), torch.cat([r, z, n, hx, hn], 1)


def gru_cell_backward(grad_hy, workspace, has_bias):
    """(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)."""
    r, z, n, hx, hn = workspace.chunk(5, 1)
    grad_z = grad_hy * (hx - n) * (1 - z) * z
    grad_in = grad_hy * (1 - z) * (1 - n * n)
    grad_r = grad_in * hn * (1 - r) * r
    grad_input_gates = torch.cat([grad_r, grad_z, grad_in], 1)
    grad_hidden_gates = torch.cat([grad_r, grad_z, grad_in * r], 1)
    grad_hx = (grad_hy * z).contiguous()
    if has_bias:
        return grad_input_gates, grad_hidden_gates, grad_hx, grad_input_gates.sum(0), grad_hidden_gates.sum(0)
    return grad_input_gates, grad_hidden_gates, grad_hx, None, None
