"""In this process: a world of one, the bad arguments, the exceptions."""

import numpy as np
import pytest

import cfmo

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def world():
    w = cfmo.World()
    yield w
    w.close()


def train(mode, use_reconciler, world, wrapper=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=gen)
    y = torch.randint(0, 3, (256,), generator=gen)
    if use_reconciler and wrapper:
        step_opt = cfmo.CommunicationFreeOptimizer(opt, world, mode=mode, sync_interval=3)
    elif use_reconciler:
        rec = cfmo.Reconciler(model.parameters(), world, mode=mode, sync_interval=3, optimizer=opt)
    for i in range(0, 256, 16):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16]).backward()
        if use_reconciler and wrapper:
            step_opt.step(samples=16)
            continue
        if use_reconciler and mode in ("sync", "asgd"):
            rec.reduce_gradients(opt)
        opt.step()
        if use_reconciler:
            rec.step(opt, samples=16)
    if use_reconciler:
        (step_opt.reconciler if wrapper else rec).finish(opt)
        (step_opt.reconciler if wrapper else rec).close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", cfmo.MODES)
@pytest.mark.parametrize("wrapper", [False, True])
def test_a_world_of_one_changes_nothing(world, mode, wrapper):
    plain = train(mode, False, world)
    reconciled = train(mode, True, world, wrapper)
    for a, b in zip(plain, reconciled):
        assert torch.equal(a, b)


def test_world_of_one(world):
    assert (world.rank, world.size) == (0, 1)
    assert world.lost_ranks() == []


def expect_config_error(match, *args, world, **kwargs):
    with pytest.raises(cfmo.ConfigError, match=match) as raised:
        cfmo.Reconciler(*args, world, **kwargs)
    message = str(raised.value)
    assert "\n" not in message
    assert isinstance(raised.value, ValueError) and raised.value.exit_status == 2
    return message


def test_bad_tensors_raise_one_clear_line(world):
    expect_config_error(r"params\[0\] \('0'\): torch.float64, expected torch.float32", [torch.zeros(3).double()],
                        world=world)
    expect_config_error(r"params\[1\] \('1'\): not contiguous", [torch.zeros(3), torch.zeros(4, 5).t()], world=world)
    expect_config_error(r"on meta; cfmo reconciles CPU tensors", [torch.zeros(3, device="meta")], world=world)
    if torch.cuda.is_available():
        expect_config_error(r"on cuda:0; cfmo reconciles CPU tensors", [torch.zeros(3, device="cuda")], world=world)
    named = torch.nn.Linear(3, 2).double()
    expect_config_error(r"\('weight'\): torch.float64", named.named_parameters(), world=world)
    expect_config_error(r"params\[0\] \('0'\): float64, expected float32", [np.zeros(3)], world=world)
    expect_config_error(r"not contiguous", [np.zeros((4, 4), np.float32)[:, 1]], world=world)
    expect_config_error(r"not a writable buffer", [b"abcd"], world=world)
    expect_config_error(r"not a writable buffer", [5], world=world)
    expect_config_error(r"no tensors", [], world=world)


def test_bad_settings_name_the_keyword(world):
    p = [np.zeros(4, np.float32)]
    expect_config_error(r"^mode 'fast': expected sync, localsgd, cfmo or asgd$", p, world=world, mode="fast")
    expect_config_error(r"^sync_interval: must be >= 1$", p, world=world, sync_interval=0)
    expect_config_error(r"^staleness_beta: must be in \(0, 1\]$", p, world=world, staleness_beta=1.5)
    expect_config_error(r"^outer: 'adam' is not avg or nesterov$", p, world=world, outer="adam")
    expect_config_error(r"^outer_lr: must be positive$", p, world=world, outer_lr=0)
    expect_config_error(r"^outer_momentum: must be in \[0, 1\)$", p, world=world, outer_momentum=1)
    expect_config_error(r"^delta_dtype 'fp8': expected fp32, bf16 or int8$", p, world=world, delta_dtype="fp8")
    expect_config_error(r"^max_staleness: must be >= 0$", p, world=world, max_staleness=-1)
    expect_config_error(r"^reply_hold: 'later' is not round or off$", p, world=world, reply_hold="later")


def test_replaced_storage_is_refused(world):
    model = torch.nn.Linear(4, 2)
    rec = cfmo.Reconciler(model.named_parameters(), world, mode="localsgd")
    model.weight.data = torch.zeros(2, 4)
    with pytest.raises(cfmo.ConfigError, match="'weight' has new storage"):
        rec.finish()
    rec.close()


def test_one_reconciler_per_world(world):
    rec = cfmo.Reconciler([np.zeros(4, np.float32)], world)
    with pytest.raises(cfmo.ConfigError, match="already has a Reconciler"):
        cfmo.Reconciler([np.zeros(4, np.float32)], world)
    with pytest.raises(cfmo.ConfigError, match="not finished"):
        world.close()
    rec.finish()
    with pytest.raises(cfmo.ConfigError, match="finished"):
        rec.step()
    rec.close()


def test_sync_without_reduce_gradients_is_refused_on_several_ranks_only(world):
    rec = cfmo.Reconciler([np.zeros(4, np.float32)], world, mode="sync")
    rec.step()  # alone there is nothing to reduce
    rec.close()


def test_state_dict_round_trips(world):
    params = [np.arange(10, dtype=np.float32), np.ones((3, 3), np.float32)]
    rec = cfmo.Reconciler(params, world, mode="localsgd", sync_interval=2)
    for _ in range(4):
        params[0] += 1
        rec.step(samples=8)
    state = rec.state_dict()
    assert state["position"]["step"] == 4 and state["position"]["samples"] == 32
    rec.close()
    fresh = [np.zeros(10, np.float32), np.zeros((3, 3), np.float32)]
    rec2 = cfmo.Reconciler(fresh, world, mode="localsgd", sync_interval=2)
    rec2.load_state_dict(state)
    assert np.array_equal(fresh[0], params[0]) and np.array_equal(fresh[1], params[1])
    again = rec2.state_dict()
    assert again["position"] == state["position"]
    assert np.array_equal(again["params"], state["params"])
    with pytest.raises(cfmo.ConfigError, match="before the first step"):
        rec2.step()
        rec2.load_state_dict(state)
    rec2.close()
    rec3 = cfmo.Reconciler(fresh, world, mode="cfmo")
    with pytest.raises(cfmo.ConfigError, match="the state is of mode localsgd"):
        rec3.load_state_dict(state)
    with pytest.raises(cfmo.ConfigError, match="not a state_dict"):
        rec3.load_state_dict({"params": []})
    rec3.close()


def test_a_rank_without_a_rendezvous_is_a_config_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("CFMO_RENDEZVOUS", raising=False)
    with pytest.raises(cfmo.ConfigError, match="^RANK/WORLD_SIZE says 2 ranks: set CFMO_RENDEZVOUS"):
        cfmo.World()
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(cfmo.ConfigError, match="RANK=3 and WORLD_SIZE=2 do not describe a rank"):
        cfmo.World()


def test_exceptions_form_one_family():
    for kind, status in ((cfmo.CheckFailed, 1), (cfmo.ConfigError, 2), (cfmo.InputError, 3), (cfmo.PeerLost, 4),
                         (cfmo.InternalError, 5)):
        assert issubclass(kind, cfmo.Error) and issubclass(kind, RuntimeError)
        assert kind.exit_status == status


def test_load_data_and_all_reduce(world):
    (x, y), (tx, ty) = cfmo.load_data("synthetic:300:50")
    assert x.shape == (300, 784) and x.dtype == np.uint8 and y.dtype == np.int32 and tx.shape == (50, 784)
    assert set(np.unique(y)) <= set(range(10))
    with pytest.raises(cfmo.InputError, match="data directory '/nonexistent': not found"):
        cfmo.load_data("/nonexistent")
    a = np.arange(4, dtype=np.float32)
    world.all_reduce(a)  # a world of one: the sum is itself
    assert a.tolist() == [0, 1, 2, 3]
    with pytest.raises(cfmo.ConfigError, match="all_reduce: float64, expected float32"):
        world.all_reduce(np.zeros(3))


def test_sample_budget_is_the_async_modes(world):
    rec = cfmo.Reconciler([np.zeros(4, np.float32)], world, mode="cfmo", sample_budget=100)
    rec.step(samples=200)
    assert not rec.stop_requested  # alone there is no budget keeper: the caller's loop decides
    rec.close()
    with pytest.raises(cfmo.ConfigError, match="sample_budget: must be >= 0"):
        cfmo.Reconciler([np.zeros(4, np.float32)], world, sample_budget=-1)


def test_the_wrapper_is_an_optimizer_with_a_state_dict(world):
    model = torch.nn.Linear(4, 2)
    opt = cfmo.CommunicationFreeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), world,
                                          mode="localsgd", sync_interval=1)
    assert opt.param_groups is opt.optimizer.param_groups
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    state = opt.state_dict()
    assert state["reconciler"]["position"]["step"] == 3 and "state" in state["optimizer"]
    opt.finish()
    opt.reconciler.close()
    again = cfmo.CommunicationFreeOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), world,
                                            mode="localsgd", sync_interval=1)
    again.load_state_dict(state)
    assert again.reconciler.stats()["step"] == 3
    with again:
        pass  # finishes and closes


def test_a_closed_world_is_refused():
    w = cfmo.World()
    w.close()
    w.close()  # idempotent
    with pytest.raises(cfmo.ConfigError, match="this World was closed"):
        cfmo.Reconciler([np.zeros(4, np.float32)], w)
    with pytest.raises(cfmo.ConfigError, match="this World was closed"):
        w.all_reduce(np.zeros(4, np.float32))
