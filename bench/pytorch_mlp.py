#!/usr/bin/env python3
"""The PyTorch peer for cfmo-train's single-worker benchmark.

Trains the same MLP (784-H1-...-10, ReLU, softmax cross-entropy) on the same
Fashion-MNIST files with AdamW, batch 64, one thread, the data in memory as
float32 in [0, 1] and reshuffled every epoch, and prints one JSON object with
the same keys as `cfmo-train --json` (samples_per_s counts training steps only).
"""
import argparse
import gzip
import json
import os
import struct
import sys
import time

import numpy as np
import torch


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    dims = magic & 0xFF
    shape = struct.unpack(">" + "I" * dims, data[4:4 + 4 * dims])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(data_dir, stem):
    for suffix in (".gz", ""):
        path = os.path.join(data_dir, stem + suffix)
        if os.path.exists(path):
            return read_idx(path)
    sys.exit(f"pytorch_mlp.py: {stem} not found in {data_dir}")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--hidden", default="256,128")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: epochs only)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-flush-denormal", action="store_true",
                   help="keep denormals (PyTorch's default); by default they are flushed, as cfmo-train does")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    # AdamW's first moment of weights that stop getting gradient (Fashion-MNIST's always-black border
    # pixels) decays into the denormal range within a few hundred steps, where x86 arithmetic is ~100x
    # slower. cfmo-train flushes denormals; the peer gets the same so the comparison is of the rest.
    if not args.no_flush_denormal:
        torch.set_flush_denormal(True)
    torch.manual_seed(args.seed)
    x_train = torch.from_numpy(load(args.data, "train-images-idx3-ubyte").reshape(-1, 784).astype(np.float32) / 255)
    y_train = torch.from_numpy(load(args.data, "train-labels-idx1-ubyte").astype(np.int64))
    x_test = torch.from_numpy(load(args.data, "t10k-images-idx3-ubyte").reshape(-1, 784).astype(np.float32) / 255)
    y_test = torch.from_numpy(load(args.data, "t10k-labels-idx1-ubyte").astype(np.int64))

    widths = [784] + [int(h) for h in args.hidden.split(",") if h] + [10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    loss_fn = torch.nn.CrossEntropyLoss()

    steps = 0
    samples = 0
    train_s = 0.0
    start = time.perf_counter()
    done = False
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train))
        for first in range(0, len(x_train), args.batch_size):
            t0 = time.perf_counter()
            idx = order[first:first + args.batch_size]
            xb, yb = x_train[idx], y_train[idx]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            train_s += time.perf_counter() - t0
            steps += 1
            samples += len(idx)
            if args.steps and steps >= args.steps:
                done = True
                break
        if done:
            break
    with torch.no_grad():
        logits = model(x_test)
        test_loss = float(loss_fn(logits, y_test))
        test_accuracy = float((logits.argmax(1) == y_test).float().mean())
    print(json.dumps({
        "peer": f"pytorch {torch.__version__}",
        "steps": steps,
        "samples": samples,
        "wall_s": time.perf_counter() - start,
        "train_s": train_s,
        "samples_per_s": samples / train_s,
        "test_accuracy": test_accuracy,
        "test_loss": test_loss,
    }))


if __name__ == "__main__":
    main()
