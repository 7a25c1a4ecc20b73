"""PyTorch twin of tests/training_loops_adversarial.rs
k_grad_scaler_two_optimizers_inf_in_one_matches_torch: torch.amp.GradScaler over two SGD
optimizers, an inf in the first one's gradients at iteration 2 and a NaN in the second one's at
iteration 4. Prints, per iteration, the scale, the growth tracker and both weights, which the
test holds as its expected values.

    pip install torch
    python3 scripts/torch_grad_scaler_two_optimizers.py
"""
import torch
wa = torch.tensor([1.0, 2.0], requires_grad=True)
wb = torch.tensor([3.0], requires_grad=True)
oa = torch.optim.SGD([wa], lr=0.1); ob = torch.optim.SGD([wb], lr=0.1)
s = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
for i in range(6):
    xa = torch.tensor([1.0, float('inf') if i == 2 else 0.5])
    xb = torch.tensor([float('nan')]) if i == 4 else torch.tensor([1.0])
    loss = (wa * xa).sum() + (wb * wb * xb).sum()
    oa.zero_grad(); ob.zero_grad()
    s.scale(loss).backward()
    s.unscale_(oa)
    s.step(oa); s.step(ob); s.update()
    print(i, s.get_scale(), s._growth_tracker.item(), wa.tolist(), wb.tolist())
