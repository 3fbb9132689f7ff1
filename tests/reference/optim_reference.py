#!/usr/bin/python3
"""Reference values for tests/unit/test_optim_optimizer.cpp.

SGD, Adam and AdamW come from torch.optim itself (run with Debian's
/usr/bin/python3 and its torch 1.13), so the C++ optimizers are checked
against PyTorch rather than against a second reading of the same formulas.
Muon is not in torch 1.13: it is written out here in float64 after Keller
Jordan's reference (zeropower_via_newtonschulz5), with the update scaled by
0.2 * sqrt(max(rows, cols)) (Moonshot AI) and AdamW for 1-D parameters.

Prints C++ initialisers; paste them into the test (then clang-format it)
when the cases change.
    /usr/bin/python3 tests/reference/optim_reference.py
"""

import math

import torch

PARAMS = [0.5, -1.25, 2.0, 0.0, -0.75, 1.5, -2.5, 0.125, 3.0, -0.3]
GRADS = [
    [0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.7, -0.8, 0.9, -1.0],
    [-0.05, 0.15, 0.25, -0.35, 0.45, 0.55, -0.65, 0.75, -0.85, 0.95],
    [0.2, 0.2, -0.1, 0.0, 0.3, -0.3, 0.05, 0.6, -0.4, 0.01],
    [1.0, -0.5, 0.25, -0.125, 0.0625, 2.0, -1.5, 0.33, -0.01, 0.4],
]
# A varying learning rate checks that each step uses the lr it is given
# (Adam's step size, AdamW's 1 - lr * wd).
LRS = [0.1, 0.08, 0.06, 0.04]
ADAM_LRS = [0.01, 0.008, 0.006, 0.004]


def print_row(values, per_line=6):
    """One brace-enclosed row, wrapped to stay inside the 120-column limit."""
    items = ["%.9gf" % v for v in values]  # %.9g round-trips a float32
    lines = [", ".join(items[i:i + per_line]) for i in range(0, len(items), per_line)]
    print("    {" + (",\n     ").join(lines) + "},")


def print_table(name, rows):
    print("// %s: parameters after each step" % name)
    print("const Trajectory %s = {" % name)
    for row in rows:
        print_row(row)
    print("};")
    print()


def run_torch(make, lrs):
    param = torch.tensor(PARAMS, dtype=torch.float32, requires_grad=True)
    opt = make([param])
    rows = []
    for lr, grad in zip(lrs, GRADS):
        for group in opt.param_groups:
            group["lr"] = lr
        param.grad = torch.tensor(grad, dtype=torch.float32)
        opt.step()
        rows.append(param.detach().tolist())
    return rows


def torch_cases():
    print_table("kSgdMomentum", run_torch(lambda p: torch.optim.SGD(p, lr=LRS[0], momentum=0.9), LRS))
    print_table("kSgdNesterov", run_torch(lambda p: torch.optim.SGD(p, lr=LRS[0], momentum=0.9, nesterov=True), LRS))
    print_table("kSgdWeightDecay",
                run_torch(lambda p: torch.optim.SGD(p, lr=LRS[0], momentum=0.9, weight_decay=0.01), LRS))
    print_table("kSgdPlain", run_torch(lambda p: torch.optim.SGD(p, lr=LRS[0], momentum=0.0, weight_decay=0.01), LRS))
    print_table("kAdamL2", run_torch(lambda p: torch.optim.Adam(p, lr=ADAM_LRS[0], weight_decay=0.1), ADAM_LRS))
    print_table("kAdamW",
                run_torch(lambda p: torch.optim.AdamW(p, lr=ADAM_LRS[0], betas=(0.85, 0.995), eps=1e-6,
                                                      weight_decay=0.1), ADAM_LRS))


# ---- Muon, float64 ----

# Shapes in flat order: a wide weight, a bias, a tall weight (transposed inside
# Newton-Schulz), a bias.
MUON_LAYOUT = [[3, 5], [3], [4, 3], [4]]
MUON_SIZE = 15 + 3 + 12 + 4
MUON_STEPS = 3
MUON_LRS = [0.02, 0.02, 0.01]


def muon_inputs():
    """Inputs from a formula so the test need not embed them; float32 like the C++."""
    def f32(x):
        return float(torch.tensor(x, dtype=torch.float32))
    params = [f32(0.5 * math.sin(0.7 * i + 0.3)) for i in range(MUON_SIZE)]
    grads = [[f32(math.cos(1.3 * i + 0.9 * t) * (1.0 + 0.1 * t)) for i in range(MUON_SIZE)]
             for t in range(MUON_STEPS)]
    return params, grads


def zeropower_via_newtonschulz5(g, steps):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    transposed = g.size(0) > g.size(1)
    if transposed:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def run_muon(nesterov, momentum, beta1, beta2, eps, weight_decay, ns_steps=5):
    params, grads = muon_inputs()
    p = torch.tensor(params, dtype=torch.float64)
    buf = torch.zeros(MUON_SIZE, dtype=torch.float64)
    exp_avg = torch.zeros(MUON_SIZE, dtype=torch.float64)
    exp_avg_sq = torch.zeros(MUON_SIZE, dtype=torch.float64)
    rows = []
    for step, (lr, grad) in enumerate(zip(MUON_LRS, grads), start=1):
        g_all = torch.tensor(grad, dtype=torch.float64)
        offset = 0
        for shape in MUON_LAYOUT:
            size = math.prod(shape)
            sl = slice(offset, offset + size)
            g = g_all[sl]
            if len(shape) == 2:
                buf[sl] = momentum * buf[sl] + g
                update = g + momentum * buf[sl] if nesterov else buf[sl].clone()
                o = zeropower_via_newtonschulz5(update.reshape(shape), ns_steps).reshape(-1)
                scale = lr * 0.2 * math.sqrt(max(shape))
                p[sl] = p[sl] * (1 - lr * weight_decay) - scale * o
            else:
                p[sl] = p[sl] * (1 - lr * weight_decay)
                exp_avg[sl] = beta1 * exp_avg[sl] + (1 - beta1) * g
                exp_avg_sq[sl] = beta2 * exp_avg_sq[sl] + (1 - beta2) * g * g
                bc1 = 1 - beta1 ** step
                bc2 = 1 - beta2 ** step
                denom = exp_avg_sq[sl].sqrt() / math.sqrt(bc2) + eps
                p[sl] = p[sl] - (lr / bc1) * exp_avg[sl] / denom
            offset += size
        rows.append(p.tolist())
    return rows


def muon_cases():
    print_table("kMuonNesterov", run_muon(nesterov=True, momentum=0.95, beta1=0.9, beta2=0.95, eps=1e-8,
                                          weight_decay=0.1))
    print_table("kMuonPlain", run_muon(nesterov=False, momentum=0.9, beta1=0.9, beta2=0.999, eps=1e-8,
                                       weight_decay=0.0))


if __name__ == "__main__":
    print("// torch %s" % torch.__version__)
    torch_cases()
    muon_cases()
