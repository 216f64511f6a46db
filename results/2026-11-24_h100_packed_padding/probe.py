import subprocess, sys
CODE = r'''
import torch, sys
from megatron_sp_ext.attention import lse_kernels as lk
sq, sk, causal, kern = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(1, 8, sq, 64, device="cuda", dtype=torch.bfloat16, generator=g)
k = torch.randn(1, 8, sk, 64, device="cuda", dtype=torch.bfloat16, generator=g)
v = torch.randn_like(k)
o, lse = lk.forward(kern, q, k, v, 0.125, causal)
do = torch.randn_like(o)
dq, dk, dv = lk.backward(kern, do, q, k, v, o, lse, 0.125, causal)
qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
s = qr @ kr.transpose(-1, -2) * 0.125
if causal:
    s = s.masked_fill(torch.ones(sq, sk, device="cuda", dtype=torch.bool).tril(sk - sq).logical_not(), float("-inf"))
ref = s.softmax(-1) @ vr
ref.backward(do.double())
e = max(((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in ((o, ref), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad)))
print(f"err {e:.2e}")
'''
for kern in ("cudnn", "flash"):
    for sq, sk in ((1, 1), (2, 2), (3, 3), (1, 5), (161, 161), (161, 160), (160, 161), (63, 64), (63, 63), (7, 7), (322, 322)):
        for causal in ("0", "1"):
            if causal == "1" and sq > sk: continue
            r = subprocess.run([sys.executable, "-c", CODE, str(sq), str(sk), causal, kern], capture_output=True, text=True, timeout=120)
            print(kern, sq, sk, causal, "rc", r.returncode, r.stdout.strip()[-60:], (r.stderr.strip().splitlines() or [""])[-1][-150:] if r.returncode else "", flush=True)
