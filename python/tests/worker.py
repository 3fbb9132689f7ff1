"""One rank of a test world, started by `python3 -m cfmo.launch -n N worker.py CONFIG`.

CONFIG is a JSON file: {"scenario": NAME, "out": DIR, ...}. The rank writes
what it saw to DIR/rank-K.json; the tests read those. Scenarios are the
functions below whose names start with scenario_.
"""

import json
import os
import signal
import sys
import time
import warnings

import numpy as np

import cfmo


def synthetic(seed, n, dim=20, classes=4):
    """A teacher's labels on Gaussian inputs: the same teacher on every rank."""
    teacher = np.random.default_rng(0).standard_normal((dim, classes)).astype(np.float32)
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x, (x @ teacher).argmax(axis=1)


def mlp(torch, dim=20, classes=4, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(dim, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))


def evaluate(torch, model, x, y):
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
        accuracy = (logits.argmax(dim=1).numpy() == y).mean().item()
    return loss, accuracy


def scenario_converge(config, world):
    """Every mode on synthetic data: rank 0's global model after finish()."""
    import torch

    torch.set_num_threads(1)
    model = mlp(torch)
    test_x, test_y = synthetic(999, 2000)
    before = evaluate(torch, model, test_x, test_y)
    x, y = synthetic(100 + world.rank, 4000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped = config.get("wrapper", False)
    settings = dict(mode=config["mode"], sync_interval=config.get("sync_interval", 5))
    if wrapped:
        step_opt = cfmo.CommunicationFreeOptimizer(opt, world, **settings)
        rec = step_opt.reconciler
    else:
        rec = cfmo.Reconciler(model.named_parameters(), world, optimizer=opt, **settings)
    batch = 32
    for step in range(config["steps"]):
        i = (step * batch) % len(x)
        xb, yb = torch.from_numpy(x[i:i + batch]), torch.from_numpy(y[i:i + batch])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        if wrapped:
            step_opt.step(samples=batch)
            continue
        if rec.mode in ("sync", "asgd"):
            rec.reduce_gradients(opt, samples=batch)
        if rec.mode != "asgd" or world.size == 1:
            opt.step()
        rec.step(opt, samples=batch)
    is_global = rec.finish(opt)
    stats = rec.stats()
    return {"global": is_global, "before": before, "after": evaluate(torch, model, test_x, test_y), "stats": stats}


def scenario_delta_reaches_owners(config, world):
    """Article bug 1 (its delta was always zero): only rank 1 moves; the owners' global moves with it."""
    params = [np.zeros((7, 9), np.float32), np.zeros(33, np.float32)]
    rec = cfmo.Reconciler(params, world, mode=config["mode"], sync_interval=2, outer="avg", outer_lr=1.0,
                          delta_dtype="fp32")
    for _ in range(20):
        if world.rank == 1:
            for p in params:
                p += 1.0
        rec.step(samples=1)
        time.sleep(0.002)
    is_global = rec.finish()
    return {"global": is_global, "min": min(float(p.min()) for p in params), "stats": rec.stats()}


def scenario_no_wait(config, world):
    """Article bug 2 (its "async" all-reduce blocked): rank 1 is held until rank 0 has
    finished all its rounds; rank 0 gets there only if it waits for nobody."""
    gate = os.path.join(config["out"], "gate")
    params = [np.zeros(1000, np.float32)]
    rec = cfmo.Reconciler(params, world, mode=config["mode"], sync_interval=2)
    if world.rank == 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not os.path.exists(gate):
            return {"error": "rank 0 never finished its steps while rank 1 was held"}
    steps = 60
    for _ in range(steps):
        params[0] += 0.01
        rec.step(samples=1)
        time.sleep(0.001)  # replies come back while rank 0 trains on
    before_finish = rec.stats()
    if world.rank == 0:
        with open(gate, "w"):
            pass
    rec.finish()
    return {"steps": steps, "stats": before_finish}


def scenario_discount(config, world):
    """Article bug 3 (its discount compounded to zero): the first moment of each shard is
    beta**(the staleness of the contributions whose replies rebased it), summed, not a running product."""
    import torch

    torch.set_num_threads(1)
    beta = 0.5
    model = mlp(torch)
    params = list(model.parameters())
    # momentum 1, zero gradients: momentum_buffer changes only by the discount.
    opt = torch.optim.SGD(params, lr=1e-3, momentum=1.0)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        opt.state[p]["momentum_buffer"].fill_(1.0)
    # Replies answered at once: a held reply also carries the contributions
    # that came after this rank's, and the rounds its base was behind then
    # (the discount's exponent) outgrow the staleness the owner recorded.
    rec = cfmo.Reconciler(params, world, mode="cfmo", sync_interval=1, staleness_beta=beta, max_staleness=1000,
                          outer="avg", outer_lr=1.0, reply_hold="off")
    for step in range(config["steps"]):
        opt.step()
        rec.step(opt, samples=1)
        if world.rank == 1:
            time.sleep(0.005)  # the slow rank: its contributions arrive stale
    stats = rec.stats()
    flat = np.full(rec.shard_bounds[-1], np.nan)
    for (_, offset, size), p in zip(rec.layout, params):
        flat[offset:offset + size] = opt.state[p]["momentum_buffer"].numpy().ravel()
    exponents = []
    bounds = rec.shard_bounds
    for j in range(world.size):
        shard = flat[bounds[j]:bounds[j + 1]]
        shard = shard[~np.isnan(shard)]
        e = -np.log2(shard)
        exponents.append(sorted(set(e.round(6).tolist())))
    rec.finish(opt)
    staleness_sum = sum(s * n for s, n in enumerate(stats["staleness_histogram"]))
    return {"exponents": exponents, "staleness_sum": staleness_sum, "rounds": stats["rounds"],
            "histogram": stats["staleness_histogram"][:8]}


def scenario_resume(config, world):
    """localsgd: a run stopped at a round and resumed from the state dicts ends where the
    uninterrupted one does, bit for bit."""
    import torch

    torch.set_num_threads(1)
    model = mlp(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = cfmo.Reconciler(model.named_parameters(), world, mode=config["mode"], sync_interval=5)
    x, y = synthetic(100 + world.rank, 4000)
    ckpt = os.path.join(config["out"], f"ckpt-{world.rank}.pt")
    start = 0
    if config.get("resume"):
        saved = torch.load(ckpt)
        opt.load_state_dict(saved["optimizer"])
        rec.load_state_dict(saved["reconciler"])
        start = saved["reconciler"]["position"]["step"]
    for step in range(start, config["steps"]):
        xb, yb = torch.from_numpy(x[step * 32:(step + 1) * 32]), torch.from_numpy(y[step * 32:(step + 1) * 32])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        if rec.mode == "sync":
            rec.reduce_gradients(opt, samples=32)
        opt.step()
        rec.step(opt, samples=32)
        if step + 1 == config.get("save_at") and not config.get("resume"):
            torch.save({"optimizer": opt.state_dict(), "reconciler": rec.state_dict()}, ckpt)
    rec.finish(opt)
    flat = np.concatenate([p.detach().numpy().ravel() for p in model.parameters()])
    return {"params": flat.tolist()}


def scenario_async_state(config, world):
    """cfmo and asgd: rank 0's state_dict() gathers the owners' shards; loaded on every rank
    of a new Reconciler, the global parameters are written into its tensors."""
    params = [np.zeros(100, np.float32) + world.rank, np.zeros((4, 4), np.float32)]
    rec = cfmo.Reconciler(params, world, mode=config["mode"], sync_interval=1, delta_dtype="fp32",
                          optimizer=FakeSgd() if config["mode"] == "asgd" else None)
    state = rec.state_dict()
    rec.finish()
    rec.close()
    out = {"keys": sorted(state.keys()), "has_params": len(state["params"]) > 0, "ranks": len(state["ranks"])}
    if world.rank == 0:
        np.save(os.path.join(config["out"], "state.npy"), state["params"])
        with open(os.path.join(config["out"], "state.json"), "w") as f:
            json.dump({k: v for k, v in state.items() if k in ("format", "mode", "world", "position", "global",
                                                                  "owner_steps", "ranks", "versions")}, f)
    world_barrier(config, world, "saved")
    with open(os.path.join(config["out"], "state.json")) as f:
        loaded = json.load(f)
    loaded["params"] = np.load(os.path.join(config["out"], "state.npy"))
    loaded["outer_momentum"] = np.zeros(0, np.float32)
    loaded["owner_state"] = []
    fresh = [np.full(100, -1.0, np.float32), np.full((4, 4), -1.0, np.float32)]
    rec2 = cfmo.Reconciler(fresh, world, mode=config["mode"], sync_interval=1,
                           optimizer=FakeSgd() if config["mode"] == "asgd" else None)
    rec2.load_state_dict(loaded)
    out["loaded_first"] = float(fresh[0][0])
    out["saved_first"] = float(loaded["params"][0])
    rec2.finish()
    return out


class FakeSgd:
    """What asgd's owners read of a torch optimizer, without torch."""

    def __init__(self):
        self.param_groups = [{"lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}]


FakeSgd.__name__ = "SGD"


def world_barrier(config, world, name):
    """A file barrier between the ranks of one host (the tests' own, outside any Reconciler)."""
    open(os.path.join(config["out"], f"{name}-{world.rank}"), "w").close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(config["out"], f"{name}-{r}")) for r in range(world.size)):
            return
        time.sleep(0.01)
    raise RuntimeError(f"barrier {name}: not every rank came")


def scenario_killed(config, world):
    """A rank killed mid-run: sync raises cfmo.PeerLost naming it; cfmo warns and finishes."""
    params = [np.zeros(1000, np.float32)]
    rec = cfmo.Reconciler(params, world, mode=config["mode"], sync_interval=2)
    grads = [np.zeros(1000, np.float32)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(config["steps"]):
                if world.rank == 1 and step == 10:
                    os.kill(os.getpid(), signal.SIGKILL)
                rec.reduce_gradients(grads=grads)
                params[0] += 0.01
                rec.step(samples=1)
                time.sleep(0.01)
            rec.finish()
        except cfmo.PeerLost as e:
            return {"raised": type(e).__name__, "message": str(e), "exit_status": e.exit_status}
    return {"raised": None, "lost": rec.lost_ranks(),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, cfmo.PeerLostWarning)]}


def scenario_mismatch(config, world):
    """Different parameters on rank 1: both ranks raise cfmo.ConfigError in the constructor."""
    shape = config["shapes"][world.rank]
    try:
        cfmo.Reconciler([np.zeros(shape, np.float32)], world, mode="cfmo")
    except cfmo.ConfigError as e:
        return {"raised": str(e)}
    return {"raised": None}


def scenario_deltas(config, world):
    """out=RUN: the deltas land as .cfd files that cfmo-diverge reads."""
    import torch

    torch.set_num_threads(1)
    model = mlp(torch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rec = cfmo.Reconciler(model.named_parameters(), world, mode=config["mode"], sync_interval=5,
                          out=config["run"])
    x, y = synthetic(100 + world.rank, 4000)
    for step in range(50):
        xb, yb = torch.from_numpy(x[step * 32:(step + 1) * 32]), torch.from_numpy(y[step * 32:(step + 1) * 32])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        rec.step(opt, samples=32)
        time.sleep(0.002)
    rec.finish(opt)
    stats = rec.stats()
    return {"written": stats["deltas_written"], "skipped": stats["deltas_skipped"]}


def scenario_forever(config, world):
    """Trains until interrupted (the test sends the launcher SIGINT once every rank has started)."""
    params = [np.zeros(100, np.float32)]
    rec = cfmo.Reconciler(params, world, mode=config["mode"], sync_interval=2)
    open(os.path.join(config["out"], f"started-{world.rank}"), "w").close()
    while True:
        params[0] += 0.01
        rec.reduce_gradients(grads=[np.zeros(100, np.float32)])
        rec.step(samples=1)
        time.sleep(0.001)


def main():
    with open(sys.argv[1]) as f:
        config = json.load(f)
    world = cfmo.World(peer_timeout=config.get("peer_timeout", 10))
    result = globals()["scenario_" + config["scenario"]](config, world)
    result["rank"] = world.rank
    result["size"] = world.size
    with open(os.path.join(config["out"], f"rank-{world.rank}.json"), "w") as f:
        json.dump(result, f)
    world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
