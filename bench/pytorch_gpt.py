#!/usr/bin/env python3
"""The PyTorch peer for cfmo-train's GPT benchmark (bench/gpt_vs_pytorch.sh).

Trains GPT-2's architecture as cfmo-train's `--model gpt:...` does: token
embedding wte [V, C], learned positions wpe [T, C], L pre-LayerNorm blocks
(LayerNorm eps 1e-5; causal self-attention with H heads of C/H scaled by
1/sqrt(C/H); an MLP C -> 4C -> C with tanh-GELU; residuals), a final
LayerNorm and logits by the transposed wte (tied). GPT-2's initialisation:
normal(0, 0.02), the blocks' two output projections normal(0, 0.02/sqrt(2L)),
biases 0, LayerNorm weights 1. AdamW, betas (0.9, 0.95), weight decay on the
matrices only (not biases, LayerNorm or embeddings), one thread by default.

Data as cfmo-train reads it (lib/data/tokens.h): `text:ITEM[,ITEM...]` (a
token per byte; an ITEM a file, a directory of text files skipping *.dat and
hidden files, or a glob; each file once) or `tokens:PATTERN` (llm.c's token
shards, memory-mapped). Without --val-data the last --val-split share of the
tokens validates. A training example is a window of T+1 tokens from a
uniformly random start; val_loss is the mean cross-entropy over the
validation tokens cut into windows of T+1 overlapping by one (window i at
token i*T), a last incomplete window dropped.

Prints one JSON object as its last line, with the keys of `cfmo-train --json`
where they mean the same: tokens_per_s counts B*T predicted tokens a step over
the training steps' time only; gflops_per_s uses flops_per_token (printed),
  6 * (parameters - T*C) + 12 * L * T * C
(each weight's multiply-add forward and twice backward, wpe being a lookup;
attention's QK^T and AV over the full T x T square, masked half included).

`--golden` instead prints the loss of a fixed tiny GPT on fixed tokens (see
golden() and tests/reference/gpt_golden.txt) and exits.
"""
import argparse
import glob
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

LLMC_MAGIC = 20240520
LLMC_VERSION = 1
LLMC_HEADER_BYTES = 256 * 4


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = torch.nn.LayerNorm(dim, eps=1e-5)
        self.c_attn = torch.nn.Linear(dim, 3 * dim)
        self.attn_proj = torch.nn.Linear(dim, dim)
        self.ln_2 = torch.nn.LayerNorm(dim, eps=1e-5)
        self.c_fc = torch.nn.Linear(dim, 4 * dim)
        self.mlp_proj = torch.nn.Linear(4 * dim, dim)

    def attention(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):  # PyTorch 2's fused kernel, where there is one
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        return self.attn_proj(y.transpose(1, 2).reshape(b, t, c))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt(torch.nn.Module):
    def __init__(self, vocab, context, layers, heads, dim):
        super().__init__()
        if dim % heads:
            sys.exit(f"pytorch_gpt.py: dim {dim} is not a multiple of heads {heads}")
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(context, dim)
        self.h = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(dim, eps=1e-5)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                torch.nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_"):
                torch.nn.init.ones_(p)
            elif name.endswith("_proj.weight"):
                torch.nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            else:
                torch.nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()

    def hf_tensors(self):
        """The parameters under Hugging Face's GPT-2 names, in their order and
        layouts (Conv1D: [in, out]), as views of this model's own tensors."""
        out = [("wte.weight", self.wte.weight), ("wpe.weight", self.wpe.weight)]
        for i, b in enumerate(self.h):
            out += [
                (f"h.{i}.ln_1.weight", b.ln_1.weight), (f"h.{i}.ln_1.bias", b.ln_1.bias),
                (f"h.{i}.attn.c_attn.weight", b.c_attn.weight.t()), (f"h.{i}.attn.c_attn.bias", b.c_attn.bias),
                (f"h.{i}.attn.c_proj.weight", b.attn_proj.weight.t()), (f"h.{i}.attn.c_proj.bias", b.attn_proj.bias),
                (f"h.{i}.ln_2.weight", b.ln_2.weight), (f"h.{i}.ln_2.bias", b.ln_2.bias),
                (f"h.{i}.mlp.c_fc.weight", b.c_fc.weight.t()), (f"h.{i}.mlp.c_fc.bias", b.c_fc.bias),
                (f"h.{i}.mlp.c_proj.weight", b.mlp_proj.weight.t()), (f"h.{i}.mlp.c_proj.bias", b.mlp_proj.bias),
            ]
        return out + [("ln_f.weight", self.ln_f.weight), ("ln_f.bias", self.ln_f.bias)]


def loss_of(model, windows):
    """Mean cross-entropy in nats of windows [B, T+1]: inputs [:, :-1], targets [:, 1:]."""
    logits = model(windows[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


# ---- data, read as lib/data/tokens.cpp reads it ----

def text_files(items, spec):
    files, seen = [], set()

    def add(path):
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            files.append(path)

    def candidate(path):
        name = os.path.basename(path)
        return name and not name.startswith(".") and not name.endswith(".dat") and os.path.isfile(path)

    for item in items.split(","):
        if os.path.isdir(item):
            names = sorted(p for p in (os.path.join(item, n) for n in os.listdir(item)) if candidate(p))
            if not names:
                sys.exit(f"{spec}: directory '{item}' holds no text file")
            for p in names:
                add(p)
        elif any(ch in item for ch in "*?[") and not os.path.exists(item):
            names = [p for p in sorted(glob.glob(item)) if candidate(p)]
            if not names:
                sys.exit(f"{spec}: no text file matches '{item}'")
            for p in names:
                add(p)
        elif os.path.isfile(item):
            add(item)
        else:
            sys.exit(f"'{item}': no such file")
    return files


def read_shard(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    size = os.path.getsize(path)
    if len(header) < 256 or header[0] != LLMC_MAGIC or header[1] != LLMC_VERSION:
        sys.exit(f"'{path}': not an llm.c token file (version {LLMC_VERSION})")
    if LLMC_HEADER_BYTES + 2 * int(header[2]) != size:
        sys.exit(f"'{path}': the header counts {header[2]} tokens but the file holds {size - LLMC_HEADER_BYTES} bytes")
    if header[2] == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=LLMC_HEADER_BYTES, shape=(int(header[2]),))


def load_spec(spec):
    """All tokens of a spec, one array (shards are memory maps; concatenating copies them, which a
    benchmark's few shards afford) and the spec's default vocabulary."""
    if spec.startswith("text:"):
        parts = [np.fromfile(p, dtype=np.uint8) for p in text_files(spec[5:], spec)]
        return np.concatenate(parts) if parts else np.zeros(0, np.uint8), 256
    if spec.startswith("tokens:"):
        paths = sorted(glob.glob(spec[7:]))
        if not paths:
            sys.exit(f"{spec}: no file matches '{spec[7:]}'")
        parts = [read_shard(p) for p in paths]
        return (np.concatenate(parts) if len(parts) > 1 else parts[0]), 50257
    sys.exit(f"'{spec}': token data is 'text:FILE[,FILE...]' or 'tokens:PATTERN'")


def load_data(args):
    tokens, vocab = load_spec(args.data)
    vocab = args.vocab_size or vocab
    if args.val_data:
        train, (val, _) = tokens, load_spec(args.val_data)
    else:
        n_val = int(math.floor(len(tokens) * args.val_split))
        train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    if args.val_tokens:
        val = val[:args.val_tokens]
    for name, split in (("training", train), ("validation", val)):
        if len(split) < args.context + 1:
            sys.exit(f"{args.data}: the {name} split holds {len(split)} tokens, fewer than context + 1")
        if int(split.max()) >= vocab:
            sys.exit(f"{args.data}: token {int(split.max())} is outside the vocabulary of {vocab}")
    return train, val, vocab


def val_loss(model, val, context, batch):
    """The mean cross-entropy over every predicted token of the validation windows."""
    count = (len(val) - 1) // context
    total = 0.0
    with torch.no_grad():
        for first in range(0, count, batch):
            n = min(batch, count - first)
            windows = np.stack([val[(first + i) * context:(first + i) * context + context + 1] for i in range(n)])
            total += float(loss_of(model, torch.from_numpy(windows.astype(np.int64)))) * n
    return total / count


def train(args):
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as cfmo-train does (see pytorch_mlp.py)
    torch.manual_seed(args.seed)
    train_tokens, val, vocab = load_data(args)
    layers, heads, dim, context = args.layers, args.heads, args.dim, args.context
    model = Gpt(vocab, context, layers, heads, dim)
    parameters = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("wte", "wpe"))]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() == 2 and not n.startswith(("wte", "wpe")))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    batch = args.batch_size
    steps = args.steps
    if args.tokens:
        steps = -(-args.tokens // (batch * context))
    rng = np.random.default_rng(args.seed)
    offsets = np.arange(context + 1)
    losses = []
    train_s = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        starts = rng.integers(0, len(train_tokens) - context, size=batch)  # the window's last token inside
        windows = torch.from_numpy(train_tokens[starts[:, None] + offsets].astype(np.int64))
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, windows)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        train_s += time.perf_counter() - t0
        losses.append(float(loss))
    flops_per_token = 6 * (parameters - context * dim) + 12 * layers * context * dim
    tokens = steps * batch * context
    result = {
        "peer": f"pytorch {torch.__version__}",
        "model": f"gpt:layers={layers},heads={heads},dim={dim},context={context}",
        "parameters": parameters,
        "vocab_size": vocab,
        "steps": steps,
        "tokens": tokens,
        "wall_s": None,
        "train_s": train_s,
        "tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
        "flops_per_token": flops_per_token,
        "gflops_per_s": flops_per_token * tokens / train_s / 1e9 if train_s > 0 else 0.0,
        "train_loss": float(np.mean(losses[-50:])) if losses else None,  # the mean of the last 50 steps
        "val_loss": val_loss(model, val, context, batch),
        "val_tokens": len(val),
    }
    result["wall_s"] = time.perf_counter() - start
    print(json.dumps(result))


# ---- the golden value ----

GOLDEN = dict(vocab=16, context=4, layers=2, heads=2, dim=8)


def golden_parameter(name, k):
    """Element k (counted over all tensors in hf_tensors() order, each row-major in its Hugging Face
    layout) of the parameter named `name`: computed in double, rounded to float32."""
    is_norm_weight = name.endswith("weight") and ("ln_" in name)
    base, amplitude = (1.0, 0.1) if is_norm_weight else (0.0, 0.2)
    return base + amplitude * math.sin(0.37 * k + 0.1)


def golden_tokens():
    """Two windows of T+1 = 5 tokens: t_j = (5 j^2 + 3 j + 1) mod 16, window b = t[5b .. 5b+4]."""
    t = [(5 * j * j + 3 * j + 1) % 16 for j in range(10)]
    return torch.tensor([t[0:5], t[5:10]], dtype=torch.int64)


def golden():
    torch.set_num_threads(1)
    model = Gpt(GOLDEN["vocab"], GOLDEN["context"], GOLDEN["layers"], GOLDEN["heads"], GOLDEN["dim"]).double()
    k = 0
    with torch.no_grad():
        for name, tensor in model.hf_tensors():
            values = [np.float32(golden_parameter(name, k + i)) for i in range(tensor.numel())]
            tensor.copy_(torch.tensor(values, dtype=torch.float64).view(tensor.shape))
            k += tensor.numel()
    loss = loss_of(model, golden_tokens())
    loss.backward()
    grad_norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in model.parameters()))
    print(json.dumps({"golden": GOLDEN, "parameters": k, "loss": f"{float(loss):.8f}",
                      "grad_norm": f"{grad_norm:.8f}", "peer": f"pytorch {torch.__version__}, float64"}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--golden", action="store_true", help="print the golden loss and exit")
    p.add_argument("--data", default="text:/usr/share/games/fortunes")
    p.add_argument("--val-data", default="")
    p.add_argument("--val-split", type=float, default=0.1)
    p.add_argument("--val-tokens", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tokens", type=int, default=0, help="a budget of training tokens (overrides --steps)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=0.0, help="clip the gradient's norm to this (0: no clipping)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    if args.golden:
        golden()
    else:
        train(args)


if __name__ == "__main__":
    main()
