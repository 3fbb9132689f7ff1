#!/usr/bin/env python3
"""A PyTorch MLP on Fashion-MNIST, trained by several workers through cfmo.

    python3 -m cfmo.launch -n 2 examples/torch_mlp.py --mode cfmo
    python3 -m cfmo.launch -n 2 examples/torch_mlp.py --mode cfmo --slowdown 1=2 --json
    python3 examples/torch_mlp.py                  # alone: plain PyTorch, the same loop

The model (784-256-128-10, ReLU), AdamW and the batches are PyTorch's; cfmo
reconciles the workers: every --sync-interval steps each worker's delta goes
to the owners of its shards without waiting (mode cfmo), or the workers
average (localsgd), or every step's gradients are averaged (sync) or applied
by their owners (asgd). Each rank trains on its slice of every global batch
of a shuffled order, as cfmo-train does. In cfmo and asgd the workers share
a budget of --samples (a fast worker takes more steps than a slow one); in
sync and localsgd each takes --samples / (workers x batch) steps.

--slowdown RANK=FACTOR makes that rank's steps FACTOR times their natural
time (a sleep), like cfmo-train's. Rank 0 prints the test accuracy of the
global model and the run's figures (--json: one JSON object).
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch

import cfmo


def mlp(hidden):
    widths = [784] + [int(h) for h in hidden.split(",")] + [10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def slowdown_of(items, rank):
    factor = 1.0
    for item in items:
        r, f = item.split("=")
        if int(r) == rank:
            factor = float(f)
    return factor


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist",
                   help="Fashion-MNIST's IDX files (Debian's dataset-fashion-mnist), or synthetic[:TRAIN[:TEST]]")
    p.add_argument("--hidden", default="256,128")
    p.add_argument("--mode", default="cfmo", choices=cfmo.MODES)
    p.add_argument("--sync-interval", type=int, default=10)
    p.add_argument("--samples", type=int, default=120000, help="examples all workers together train")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--slowdown", action="append", default=[], metavar="RANK=FACTOR")
    p.add_argument("--out", help="run directory: the deltas go to OUT/deltas/rank-K/*.cfd, for cfmo-diverge")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    world = cfmo.World()
    rank, workers, batch = world.rank, world.size, args.batch_size
    (train_x, train_y), (test_x, test_y) = cfmo.load_data(args.data)
    x = torch.from_numpy(train_x).float().div_(255)
    y = torch.from_numpy(train_y).long()
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = mlp(args.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    asynchronous = args.mode in ("cfmo", "asgd") and workers > 1
    rec = cfmo.Reconciler(model.named_parameters(), world, mode=args.mode, sync_interval=args.sync_interval,
                          optimizer=opt, out=args.out, sample_budget=args.samples if asynchronous else 0)

    g = batch * workers
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
    steps = args.samples // g
    factor = slowdown_of(args.slowdown, rank)
    step_s, rec_step_s = [], []
    samples = 0
    step = 0
    start = time.perf_counter()
    while not rec.stop_requested if asynchronous else step < steps:
        first = (step * g) % (len(x) - g) + rank * batch
        idx = order[first:first + batch]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x[idx]), y[idx]).backward()
        if rec.mode in ("sync", "asgd"):
            rec.reduce_gradients(opt, samples=batch)  # sync: the mean gradient; asgd: to the owners
        if rec.mode != "asgd" or workers == 1:
            opt.step()
        t1 = time.perf_counter()
        rec.step(opt, samples=batch)
        t2 = time.perf_counter()
        if factor > 1:
            time.sleep((factor - 1) * (t2 - t0))
        step_s.append(t1 - t0)
        rec_step_s.append(t2 - t1)
        samples += batch
        step += 1
    rec.finish(opt)
    loop_s = time.perf_counter() - start
    stats = rec.stats()

    # Every rank's [samples, loop seconds, solo samples/s, bytes sent], summed into one table.
    compute_s = loop_s - stats["wait_s"] - stats["finish_wait_s"]
    table = np.zeros((workers, 4), np.float32)
    table[rank] = [samples, loop_s, samples / compute_s if compute_s > 0 else 0, stats["bytes_sent"]]
    world.all_reduce(table)
    if rank == 0:
        with torch.no_grad():
            xt = torch.from_numpy(test_x).float().div_(255)
            accuracy = float((model(xt).argmax(1) == torch.from_numpy(test_y).long()).float().mean())
        total = int(table[:, 0].sum())
        rate = total / float(table[:, 1].max())
        result = {
            "mode": args.mode, "workers": workers, "slowdown": args.slowdown, "samples": total,
            "loop_s": float(table[:, 1].max()), "samples_per_s": rate,
            "efficiency": rate / float(table[:, 2].sum()), "test_accuracy": accuracy,
            "bytes_sent": int(table[:, 3].sum()), "rounds": stats["rounds"],
            "step_us": 1e6 * statistics.median(step_s), "rec_step_us": 1e6 * statistics.median(rec_step_s),
        }
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(f"{args.mode}, {workers} workers: {total} samples in {result['loop_s']:.1f} s "
                  f"({rate:.0f}/s, efficiency {result['efficiency']:.2f}), test accuracy {accuracy:.4f}, "
                  f"{result['bytes_sent'] / 1e6:.1f} MB sent; rec.step {result['rec_step_us']:.1f} us "
                  f"of a {result['step_us']:.0f} us step (medians)", flush=True)
    world.close()


if __name__ == "__main__":
    main()
