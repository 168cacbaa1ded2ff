"""The daemon's CPU kernels for the fused LSTM/GRU cell ops against torch's own math.

Forward: the cell's equations as nn.LSTMCell / nn.GRUCell compute them on the CPU. Backward:
torch's `_thnn_differentiable_*_cell_backward` ops (CPU-capable, composite), which compute the
same gradients from the gates instead of the workspace."""
import pytest
import torch

from daemon import rnn_cells

B, H = 3, 5


def _inputs(gates, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_gates = torch.randn(B, gates * H, generator=g, dtype=torch.float64)
    hidden_gates = torch.randn(B, gates * H, generator=g, dtype=torch.float64)
    state = torch.randn(B, H, generator=g, dtype=torch.float64)
    biases = (torch.randn(gates * H, generator=g, dtype=torch.float64),
              torch.randn(gates * H, generator=g, dtype=torch.float64)) if bias else (None, None)
    return input_gates, hidden_gates, state, *biases


@pytest.mark.parametrize("bias", [True, False])
def test_lstm_cell_forward_matches_lstm_cell_math(bias):
    x, h, c = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, H, dtype=torch.float64), torch.randn(B, H, dtype=torch.float64)
    cell = torch.nn.LSTMCell(4, H, bias=bias).double()
    want_h, want_c = cell(x, (h, c))
    got_h, got_c, _ = rnn_cells.lstm_cell(x @ cell.weight_ih.T, h @ cell.weight_hh.T, c,
                                          cell.bias_ih if bias else None, cell.bias_hh if bias else None)
    torch.testing.assert_close(got_h, want_h)
    torch.testing.assert_close(got_c, want_c)


@pytest.mark.parametrize("bias", [True, False])
def test_gru_cell_forward_matches_gru_cell_math(bias):
    x, h = torch.randn(B, 4, dtype=torch.float64), torch.randn(B, H, dtype=torch.float64)
    cell = torch.nn.GRUCell(4, H, bias=bias).double()
    got, _ = rnn_cells.gru_cell(x @ cell.weight_ih.T, h @ cell.weight_hh.T, h,
                                cell.bias_ih if bias else None, cell.bias_hh if bias else None)
    torch.testing.assert_close(got, cell(x, h))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("which", ["both", "hy only", "cy only"])
def test_lstm_cell_backward_matches_torch(bias, which):
    input_gates, hidden_gates, cx, input_bias, hidden_bias = _inputs(4, bias)
    _, cy, workspace = rnn_cells.lstm_cell(input_gates, hidden_gates, cx, input_bias, hidden_bias)
    grad_hy = None if which == "cy only" else torch.randn(B, H, dtype=torch.float64)
    grad_cy = None if which == "hy only" else torch.randn(B, H, dtype=torch.float64)
    grad_gates, grad_cx, grad_bias = rnn_cells.lstm_cell_backward(grad_hy, grad_cy, cx, cy, workspace, bias)
    want = torch.ops.aten._thnn_differentiable_lstm_cell_backward(
        grad_hy, grad_cy, input_gates, hidden_gates, input_bias, hidden_bias, cx, cy)
    torch.testing.assert_close(grad_gates, want[0])
    torch.testing.assert_close(grad_cx, want[2])
    if bias:
        torch.testing.assert_close(grad_bias, want[3])
    else:
        assert grad_bias is None


@pytest.mark.parametrize("bias", [True, False])
def test_gru_cell_backward_matches_torch(bias):
    input_gates, hidden_gates, hx, input_bias, hidden_bias = _inputs(3, bias)
    _, workspace = rnn_cells.gru_cell(input_gates, hidden_gates, hx, input_bias, hidden_bias)
    grad_hy = torch.randn(B, H, dtype=torch.float64)
    got = rnn_cells.gru_cell_backward(grad_hy, workspace, bias)
    want = torch.ops.aten._thnn_differentiable_gru_cell_backward(
        grad_hy, input_gates, hidden_gates, hx, input_bias, hidden_bias)
    for g, w in zip(got[:3], want[:3]):
        torch.testing.assert_close(g, w)
    if bias:
        torch.testing.assert_close(got[3], want[3])
        torch.testing.assert_close(got[4], want[4])
    else:
        assert got[3] is None and got[4] is None


def test_registered_as_the_ops_cpu_kernels():
    rnn_cells.register()
    input_gates, hidden_gates, cx, input_bias, hidden_bias = _inputs(4, True)
    hy, cy, workspace = torch.ops.aten._thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias, hidden_bias)
    torch.testing.assert_close(hy, rnn_cells.lstm_cell(input_gates, hidden_gates, cx, input_bias, hidden_bias)[0])
    grads = torch.ops.aten._thnn_fused_lstm_cell_backward_impl(torch.ones_like(hy), None, cx, cy, workspace, True)
    assert grads[0].shape == input_gates.shape
