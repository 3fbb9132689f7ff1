#!/usr/bin/env python3
"""The PyTorch DDP peer for cfmo-train's multi-worker benchmark.

W processes (gloo, one thread each) train the MLP on Fashion-MNIST with AdamW,
batch B per worker, each on its slice of every global batch (as cfmo-train
shards), for a fixed number of steps. `--slowdown RANK=FACTOR` sleeps after each
of that rank's steps so it takes FACTOR times its natural time, like
cfmo-train's simulation. Prints one JSON object: total samples/s and test accuracy.
"""
import argparse
import json
import os
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
from pytorch_mlp import load  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, args, port, queue):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=args.workers)
    torch.manual_seed(args.seed)
    x = torch.from_numpy(load(args.data, "train-images-idx3-ubyte").reshape(-1, 784).astype(np.float32) / 255)
    y = torch.from_numpy(load(args.data, "train-labels-idx1-ubyte").astype(np.int64))
    widths = [784] + [int(h) for h in args.hidden.split(",")] + [10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    factor = 1.0
    for item in args.slowdown:
        r, f = item.split("=")
        if int(r) == rank:
            factor = float(f)
    g = args.batch_size * args.workers
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
    dist.barrier()
    start = time.perf_counter()
    samples = 0
    for step in range(args.steps):
        first = (step * g) % (len(x) - g) + rank * args.batch_size
        idx = order[first:first + args.batch_size]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[idx]), y[idx]).backward()
        opt.step()
        if factor > 1:
            time.sleep((factor - 1) * (time.perf_counter() - t0))
        samples += len(idx)
    dist.barrier()
    elapsed = time.perf_counter() - start
    totals = torch.tensor([float(samples)])
    dist.all_reduce(totals)
    if rank == 0:
        xt = torch.from_numpy(load(args.data, "t10k-images-idx3-ubyte").reshape(-1, 784).astype(np.float32) / 255)
        yt = torch.from_numpy(load(args.data, "t10k-labels-idx1-ubyte").astype(np.int64))
        with torch.no_grad():
            acc = float((model.module(xt).argmax(1) == yt).float().mean())
        queue.put({"peer": f"pytorch {torch.__version__} DDP gloo", "workers": args.workers,
                   "samples": int(totals.item()), "wall_s": elapsed, "samples_per_s": totals.item() / elapsed,
                   "test_accuracy": acc})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--hidden", default="256,128")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--slowdown", action="append", default=[])
    args = p.parse_args()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args, free_port(), queue), nprocs=args.workers, join=True)
    print(json.dumps(queue.get()))


if __name__ == "__main__":
    main()
