"""Diagnose a GPU daemon: start one on cuda:0 with its stderr kept ($OUT/daemon_diag.err) and every
thread's stack dumped on SIGUSR1 (sent when a step runs 20 s), then time a few ops against the CPU's:
matmuls (FP32, TF32), convolutions, attention and their gradients, a large download."""
import os, signal, subprocess, sys, tempfile, threading, time
os.environ["GENIE_HEARTBEAT_TIMEOUT"] = "60"
import torch
import torch.nn.functional as F
out = os.environ.get("OUT", "/tmp")
tmp = tempfile.mkdtemp()
err = open(os.path.join(out, "daemon_diag.err"), "w")
boot = ("import faulthandler, signal, sys, runpy; faulthandler.enable(); "
        "faulthandler.register(signal.SIGUSR1, all_threads=True); "
        f"sys.argv=['genie-daemon','--listen','ipc://{tmp}/d.sock','--log-level','INFO','--device','cuda:0']; "
        "runpy.run_module('genie_daemon', run_name='__main__')")
proc = subprocess.Popen([sys.executable, "-c", boot], stdout=subprocess.PIPE, stderr=err, text=True)
endpoint = None  # bounded by the caller's timeout (scripts/gpu_quick_check.sh) if it never comes
for line in proc.stdout:
    if line.startswith("GENIE_DAEMON_READY"):
        endpoint = line.split()[1]
        break
if endpoint is None:
    err.close()
    sys.exit(f"the daemon did not start (exit {proc.wait()}):\n" + open(os.path.join(out, "daemon_diag.err")).read()[-3000:])
import genie
genie.init(endpoint)
def step(name, fn):
    done = threading.Event()
    def watch():
        if not done.wait(20):
            print(f"  {name}: still running after 20s; daemon alive={proc.poll() is None}; dumping its stacks", flush=True)
            if proc.poll() is None:
                proc.send_signal(signal.SIGUSR1)
    threading.Thread(target=watch, daemon=True).start()
    t = time.perf_counter()
    try:
        r = fn()
        print(f"{name}: ok in {time.perf_counter() - t:.2f}s {r if r is not None else ''}", flush=True)
    except Exception as e:
        print(f"{name}: FAILED in {time.perf_counter() - t:.2f}s: {type(e).__name__}: {str(e)[:300]}", flush=True)
    done.set()
    if proc.poll() is not None:
        print(f"  daemon exited with {proc.returncode}", flush=True)
d = "remote_accelerator:0"
a, b = torch.randn(512, 1024), torch.randn(1024, 256)
step("matmul", lambda: (a.to(d) @ b.to(d)).sum().item())
def tf32():
    torch.set_float32_matmul_precision("high")
    r = (a.to(d) @ b.to(d)).cpu()
    torch.set_float32_matmul_precision("highest")
    return (r - a @ b).abs().max().item()
step("matmul_tf32", tf32)
step("local_cuda_matmul", lambda: (a.cuda() @ b.cuda()).sum().item())
x, w = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
step("conv2d", lambda: (F.conv2d(x.to(d), w.to(d)).cpu() - F.conv2d(x, w)).abs().max().item())
step("conv2d_again", lambda: (F.conv2d(x.to(d), w.to(d), padding=1).cpu() - F.conv2d(x, w, padding=1)).abs().max().item())
q = torch.randn(2, 4, 64, 32)
step("sdpa", lambda: (F.scaled_dot_product_attention(q.to(d), q.to(d), q.to(d)).cpu() - F.scaled_dot_product_attention(q, q, q)).abs().max().item())
def sdpa_backward():
    qc, qr = q.clone().requires_grad_(), q.to(d).requires_grad_()
    F.scaled_dot_product_attention(qr, qr, qr, is_causal=True).sum().backward()
    F.scaled_dot_product_attention(qc, qc, qc, is_causal=True).sum().backward()
    return (qr.grad.cpu() - qc.grad).abs().max().item()
step("sdpa_backward", sdpa_backward)
def conv_backward():
    wc, wr = w.clone().requires_grad_(), w.to(d).requires_grad_()
    F.conv2d(x.to(d), wr).square().sum().backward()
    F.conv2d(x, wc).square().sum().backward()
    return (wr.grad.cpu() - wc.grad).abs().max().item()
step("conv2d_backward", conv_backward)
step("big_download", lambda: (torch.randn(8 << 20).to(d) * 3).cpu().shape)
genie.shutdown()
proc.terminate()
try:
    proc.wait(10)
except subprocess.TimeoutExpired:
    proc.kill()
err.close()
print("daemon stderr tail:"); print(open(os.path.join(out, "daemon_diag.err")).read()[-3000:])
