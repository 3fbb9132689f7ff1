"""cfmo: libcfmo's reconciliation of workers for any PyTorch model.

The modes (sync, localsgd, cfmo, asgd), the owners' rounds, the outer
optimizers, the wire codecs and the .cfd delta writer are libcfmo's, as in
cfmo-train; this package hands them a model's CPU float32 parameters in
place (no copies on a step that does not reconcile) and PyTorch's optimizer
state for the staleness discount. See docs/PYTHON.md.

    world = cfmo.World()                  # RANK/WORLD_SIZE, Open MPI, Slurm; alone: a world of one
    rec = cfmo.Reconciler(model.parameters(), world, mode="cfmo")
    for x, y in batches:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        rec.step(opt)                     # every sync_interval steps the delta goes out, unblocking
    rec.finish(opt)                       # rank 0 now holds the global model
"""

import atexit
import sys
import warnings
import weakref

from ._cfmo import (  # noqa: F401  (the public names)
    CheckFailed,
    ConfigError,
    Error,
    InputError,
    InternalError,
    PeerLost,
    World as _World,
    _Reconciler,
    launch_local,
    load_data,
)

__all__ = [
    "World",
    "Reconciler",
    "CommunicationFreeOptimizer",
    "Error",
    "ConfigError",
    "InputError",
    "PeerLost",
    "CheckFailed",
    "InternalError",
    "PeerLostWarning",
    "MODES",
    "load_data",
]

MODES = ("sync", "localsgd", "cfmo", "asgd")


class PeerLostWarning(UserWarning):
    """A peer was lost in an asynchronous mode (cfmo, asgd): training goes on without it."""


# What must be released before the interpreter goes: reconcilers first (their
# modes use the world's communicator), then the worlds (the goodbye).
_live_reconcilers = weakref.WeakSet()
_live_worlds = weakref.WeakSet()


class World(_World):
    """This process's world, found as cfmo-train's workers find theirs.

    RANK/WORLD_SIZE (or Open MPI's OMPI_COMM_WORLD_RANK/SIZE, or Slurm's
    SLURM_PROCID/SLURM_NTASKS) with the rendezvous address (host:port of rank
    0) in CFMO_RENDEZVOUS or `rendezvous`; none of them: a world of one.
    Collective: every rank makes its World together. A peer silent for
    `peer_timeout` seconds is lost. close() leaves it (the goodbye)."""

    def __init__(self, rendezvous="", peer_timeout=10.0):
        super().__init__(rendezvous, peer_timeout)
        _live_worlds.add(self)

    def close(self):
        # A finished Reconciler is released with its world; an unfinished one keeps it (ConfigError).
        for rec in list(_live_reconcilers):
            if rec.world is self and rec._core is not None and rec._core.finished:
                rec.close()
        super().close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@atexit.register
def _release():
    for rec in list(_live_reconcilers):
        rec.close()
    for world in list(_live_worlds):
        _World.close(world)


def _torch_tensor_type():
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else None


def _as_buffer(tensor, what):
    """A CPU float32 contiguous tensor as a numpy view of its memory (no copy)."""
    tensor_type = _torch_tensor_type()
    if tensor_type is None or not isinstance(tensor, tensor_type):
        return tensor  # a numpy array or another buffer: _cfmo checks it
    if tensor.device.type != "cpu":
        raise ConfigError(f"{what}: on {tensor.device}; cfmo reconciles CPU tensors (keep the model on the CPU)")
    if tensor.layout != sys.modules["torch"].strided:
        raise ConfigError(f"{what}: a {tensor.layout} tensor; cfmo reconciles dense tensors")
    if tensor.dtype != sys.modules["torch"].float32:
        raise ConfigError(f"{what}: {tensor.dtype}, expected torch.float32 (model.float())")
    if not tensor.is_contiguous():
        raise ConfigError(f"{what}: not contiguous (make it .contiguous() before the Reconciler)")
    return tensor.detach().numpy()


def _named(params):
    """(names, tensors) from model.parameters(), model.named_parameters(), a list or a dict."""
    if isinstance(params, dict):
        items = list(params.items())
    else:
        items = list(params)
    if items and all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in items):
        return [n for n, _ in items], [t for _, t in items]
    if items and isinstance(items[0], dict) and "params" in items[0]:  # an optimizer's param_groups
        tensors = [p for group in items for p in group["params"]]
        return [str(i) for i in range(len(tensors))], tensors
    return [str(i) for i in range(len(items))], items


def _optimizer_config(optimizer):
    """libcfmo's name for a torch optimizer and its first group's settings (asgd's owners run it)."""
    if optimizer is None:
        return {}
    kind = type(optimizer).__name__.lower()
    if kind not in ("sgd", "adam", "adamw"):
        raise ConfigError(f"optimizer: {type(optimizer).__name__}; asgd's owners run sgd, adam or adamw")
    group = optimizer.param_groups[0]
    config = {"name": kind, "weight_decay": float(group.get("weight_decay", 0.0))}
    if kind == "sgd":
        config.update(momentum=float(group.get("momentum", 0.0)), nesterov=bool(group.get("nesterov", False)))
    else:
        beta1, beta2 = group.get("betas", (0.9, 0.999))
        config.update(beta1=float(beta1), beta2=float(beta2), eps=float(group.get("eps", 1e-8)))
    return config


class Reconciler:
    """libcfmo's mode `mode` over `params` (CPU float32 tensors or numpy arrays).

    Call step(optimizer) after each optimizer.step(): every `sync_interval`
    steps the mode reconciles (cfmo: the delta goes to its owners without
    waiting, and fresh global shards are folded in when they arrive, the
    optimizer's first moments discounted by staleness_beta**staleness).
    sync: call reduce_gradients() between backward() and optimizer.step().
    asgd: call reduce_gradients() instead of optimizer.step(); the owners
    update (pass optimizer= here, for their settings). Collective: every rank
    makes its Reconciler together, over parameters of the same names and shapes.
    With out=RUN the deltas (localsgd, cfmo) go to RUN/deltas/rank-K/*.cfd.
    sample_budget (cfmo, asgd): the examples all workers together train;
    rank 0 keeps the count (step's samples) and stop_requested turns true.
    reply_hold (cfmo): "round" holds an owner's reply until the shard's round
    is whole, "off" answers each delta at once (cfmo-train's --reply-hold).
    """

    def __init__(self, params, world=None, mode="cfmo", sync_interval=10, outer="nesterov", outer_lr=0.5,
                 outer_momentum=0.8, delta_dtype="bf16", staleness_beta=0.9, max_staleness=4, out=None,
                 optimizer=None, sample_budget=0, reply_hold="round"):
        if mode not in MODES:
            raise ConfigError(f"mode '{mode}': expected sync, localsgd, cfmo or asgd")
        self.world = world if world is not None else World()
        if mode == "asgd" and optimizer is None and self.world.size > 1:
            raise ConfigError("mode asgd: pass optimizer= (the owners run its update on their shards)")
        names, tensors = _named(params)
        self._tensors = tensors
        self._names = names
        self._buffers = [_as_buffer(t, f"params[{i}] ('{n}')") for i, (n, t) in enumerate(zip(names, tensors))]
        self._pointers = self._data_pointers()
        self._optimizer = optimizer
        self._core = _Reconciler(self.world, names, self._buffers, mode, sync_interval, staleness_beta,
                                 max_staleness, outer, outer_lr, outer_momentum, delta_dtype,
                                 _optimizer_config(optimizer if mode == "asgd" else None),
                                 "" if out is None else str(out), int(sample_budget), str(reply_hold))
        self._no_moments = [None] * len(tensors)
        self._uses_gradients = self._core.uses_gradients
        self._reduced = False
        self._warned = set()
        _live_reconcilers.add(self)

    # The hot path: a step that does not reconcile is one call that counts it.
    def step(self, optimizer=None, samples=0):
        """After optimizer.step(): `samples` examples made this step (for stats and positions)."""
        if self._uses_gradients:
            if not self._reduced:
                raise ConfigError(f"mode {self._core.mode}: call reduce_gradients() after backward(), every step")
            self._reduced = False
        if self._core.tick(samples):
            return
        self._check_storage()
        self._core.reconcile(self._moments(optimizer))
        self._warn_lost()

    def reduce_gradients(self, optimizer=None, samples=1, grads=None):
        """sync: each parameter's .grad (or each of `grads`) becomes the mean over the
        ranks, weighted by samples. asgd: they go to their owners (at optimizer's lr)."""
        self._reduced = True
        if not self._uses_gradients:
            return
        if grads is not None:
            grads = [_as_buffer(g, f"grads[{i}]") for i, g in enumerate(grads)]
        else:
            grads = self._gradients()
        opt = optimizer if optimizer is not None else self._optimizer
        lr = float(opt.param_groups[0]["lr"]) if opt is not None else 0.0
        self._core.reduce_gradients(grads, int(samples), lr)

    def _gradients(self):
        grads = []
        for i, t in enumerate(self._tensors):
            g = getattr(t, "grad", None)
            if g is None and _torch_tensor_type() is not None and isinstance(t, _torch_tensor_type()):
                t.grad = sys.modules["torch"].zeros_like(t)  # an unused parameter: zero, as every rank's sum needs
                g = t.grad
            if g is None:
                raise ConfigError(f"params[{i}] ('{self._names[i]}'): no .grad to reduce")
            grads.append(_as_buffer(g, f"params[{i}] ('{self._names[i]}').grad"))
        return grads

    def finish(self, optimizer=None):
        """Collective: the last round and the end handshake. Returns True where the
        parameters are now the global ones (rank 0; every rank in sync and localsgd)."""
        self._check_storage()
        self._core.finish(self._moments(optimizer))
        self._warn_lost()
        return self.rank == 0 or self._core.mode in ("sync", "localsgd")

    def close(self):
        """Releases the mode, finished or not (unfinished: the other ranks see this one
        go when its World closes, and treat it as a lost peer)."""
        _live_reconcilers.discard(self)
        core, self._core = getattr(self, "_core", None), None
        del core

    def stats(self):
        """Waits, bytes, rounds, staleness histogram, drops, lost ranks: cfmo-train's summary."""
        return self._core.stats()

    def state_dict(self):
        """The position and outer state (outer momentum; cfmo and asgd: the global
        parameters gathered on rank 0, every rank's position, the owners' state)."""
        return self._core.state_dict()

    def load_state_dict(self, state):
        """Collective, before the first step: every rank loads rank 0's state; the
        global parameters are written into params."""
        self._core.load_state_dict(state)

    def lost_ranks(self):
        return self._core.lost_ranks()

    @property
    def stop_requested(self):
        """cfmo and asgd with a sample_budget: the workers together have trained it."""
        return self._core.stop_requested

    @property
    def rank(self):
        return self._core.rank

    @property
    def size(self):
        return self._core.size

    @property
    def mode(self):
        return self._core.mode

    @property
    def shard_bounds(self):
        """The owners' shards of the flat vector: shard j is [b[j], b[j+1])."""
        return self._core.shard_bounds

    @property
    def layout(self):
        """(name, offset, size) of each tensor in the flat vector."""
        return self._core.layout

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        try:
            if kind is None and not self._core.finished:
                self.finish(self._optimizer)
        finally:
            self.close()

    def _data_pointers(self):
        tensor_type = _torch_tensor_type()
        return [t.data_ptr() if tensor_type is not None and isinstance(t, tensor_type) else None
                for t in self._tensors]

    def _check_storage(self):
        # The mode writes through the pointers taken at construction: a parameter
        # whose storage was replaced (p.data = ...) would silently be left out.
        if self._data_pointers() != self._pointers:
            moved = [self._names[i] for i, (a, b) in enumerate(zip(self._data_pointers(), self._pointers)) if a != b]
            raise ConfigError(f"params: '{moved[0]}' has new storage since the Reconciler was made (set it with copy_)")

    def _moments(self, optimizer):
        """The first moment of each parameter in a torch optimizer's state (None where it has none)."""
        state = getattr(optimizer, "state", None)
        if not state:
            return self._no_moments
        moments = []
        for i, t in enumerate(self._tensors):
            s = state.get(t) if isinstance(state, dict) or hasattr(state, "get") else None
            m = None
            if s:
                m = s.get("exp_avg")
                if m is None:
                    m = s.get("momentum_buffer")
            moments.append(None if m is None else _as_buffer(m, f"optimizer state of params[{i}] ('{self._names[i]}')"))
        return moments

    def _warn_lost(self):
        for r in self._core.lost_ranks():
            if r not in self._warned:
                self._warned.add(r)
                warnings.warn(f"cfmo: rank {r} lost; mode {self.mode} goes on without it", PeerLostWarning,
                              stacklevel=3)


class CommunicationFreeOptimizer:
    """The article's wrapper, made real: a torch optimizer and a Reconciler in one.

        opt = cfmo.CommunicationFreeOptimizer(torch.optim.AdamW(model.parameters()), world, mode="cfmo")
        opt.zero_grad(); loss.backward(); opt.step()
        ...
        opt.finish()

    step() does what the mode needs: sync reduces the gradients first, asgd
    sends them to the owners instead of stepping, the others step and reconcile.
    """

    def __init__(self, optimizer, world=None, **settings):
        self.optimizer = optimizer
        self.reconciler = Reconciler(optimizer.param_groups, world, optimizer=optimizer, **settings)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, *args, **kwargs):
        return self.optimizer.zero_grad(*args, **kwargs)

    def step(self, closure=None, samples=0):
        loss = closure() if closure is not None else None
        rec = self.reconciler
        if rec._uses_gradients:
            rec.reduce_gradients(self.optimizer, samples=max(int(samples), 1))
        if not rec._core.owns_update:
            self.optimizer.step()
        rec.step(self.optimizer, samples)
        return loss

    def finish(self):
        return self.reconciler.finish(self.optimizer)

    def stats(self):
        return self.reconciler.stats()

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict(), "reconciler": self.reconciler.state_dict()}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state["optimizer"])
        self.reconciler.load_state_dict(state["reconciler"])

    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return self.reconciler.__exit__(kind, value, traceback)
