"""Lab 08: the router, capacity and balancing pieces do what the papers say; the expert-parallel
layer equals the single-device layer (outputs, gradients, dropped tokens) on real ranks,
including the edge cases; expert-parallel training equals one-process training; the counted
all-to-all bytes equal the formula; and the checkers pass the reference while naming the
mistake in typical wrong answers."""

import math

import pytest
import torch
import torch.distributed as dist

import distlab
from distlab import moe as M
from distlab.grading import CheckFailed, lab08
from distlab.model import GPTConfig
from distlab.reference import max_abs_diff

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_thread")]

D, E = 12, 8


@pytest.fixture(scope="module")
def ranks4():
    yield distlab.Ranks.shared(4, backend="gloo")  # the checkers' warm group too
    distlab.shutdown()


@pytest.fixture(scope="module")
def ranks2():
    yield distlab.Ranks.shared(2, backend="gloo")
    distlab.shutdown()


def _tokens(T, d=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, d, generator=g), torch.randn(E, d, generator=g) / math.sqrt(d)


# ---------------------------------------------------------------- one process


def test_route_switch_mixtral_and_bias_semantics():
    x, w = _tokens(32)
    top1 = M.route(x, w, 1)
    probs = torch.softmax(x @ w.t(), -1)
    assert torch.allclose(top1.probs, probs) and torch.equal(top1.experts[:, 0], probs.argmax(-1))
    assert torch.allclose(top1.gates[:, 0], probs.max(-1).values)  # k = 1: the raw probability (Switch)
    top2 = M.route(x, w, 2)
    assert torch.allclose(top2.gates.sum(-1), torch.ones(32))  # k = 2: renormalised (Mixtral)
    assert (top2.gates[:, 0] >= top2.gates[:, 1]).all()  # best first
    bias = torch.zeros(E)
    bias[5] = 1.0  # larger than any probability gap: expert 5 is everyone's first choice
    biased = M.route(x, w, 2, bias)
    assert (biased.experts[:, 0] == 5).all()
    assert torch.allclose(biased.gates, biased.probs.gather(-1, biased.experts) /
                          biased.probs.gather(-1, biased.experts).sum(-1, keepdim=True))  # gates from probs only
    for bad in (0, E + 1, True):
        with pytest.raises(ValueError, match="k="):
            M.route(x, w, bad)


def test_capacity_formula_and_first_choices_first():
    assert M.expert_capacity(64, 8, 2, 1.25) == 20
    assert M.expert_capacity(10, 8, 1, 1.25) == 2  # ⌈1.5625⌉
    with pytest.raises(ValueError, match="capacity_factor"):
        M.expert_capacity(10, 8, 1, 0)
    # 4 tokens: all first choices are expert 0, all second choices expert 1; capacity 2
    experts = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    keep = M.assign_capacity(experts, 2, 2)
    # expert 0: first choices of tokens 0, 1 fit; token 2's first choice and token 3's second do not.
    # expert 1: token 3's FIRST choice comes before every second choice, then token 0's second choice.
    assert keep.tolist() == [[True, True], [True, False], [False, False], [True, False]]
    assert M.assign_capacity(experts, 2, None).all()


def test_everything_to_one_expert_keeps_exactly_its_capacity():
    experts = torch.zeros(50, 1, dtype=torch.long)
    keep = M.assign_capacity(experts, 4, M.expert_capacity(50, 4, 1, 1.0))
    assert int(keep.sum()) == 13 and keep[:13].all() and not keep[13:].any()


def test_balancing_losses_and_bias_step():
    balanced = torch.full((8, 4), 0.25)
    assert math.isclose(float(M.load_balancing_loss(balanced, torch.arange(8).remainder(4)[:, None], 4)), 1.0)
    collapsed = torch.zeros(8, 4)
    collapsed[:, 0] = 1
    assert math.isclose(float(M.load_balancing_loss(collapsed, torch.zeros(8, 2, dtype=torch.long), 4)), 4.0)
    logits = torch.randn(16, 4, requires_grad=True)
    M.load_balancing_loss(torch.softmax(logits, -1), logits.detach().topk(2).indices, 4).backward()
    assert logits.grad.abs().sum() > 0  # through the mean probabilities
    z = M.router_z_loss(torch.tensor([[0.0, 0.0], [math.log(3.0), math.log(3.0) - 1e9]]))
    assert math.isclose(float(z), (math.log(2.0) ** 2 + math.log(3.0) ** 2) / 2, rel_tol=1e-6)
    new = M.update_expert_bias(torch.zeros(4), torch.tensor([10, 30, 20, 20]), 0.1)
    assert new.tolist() == pytest.approx([0.1, -0.1, 0.0, 0.0])  # underloaded up, overloaded down, mean unchanged


def test_noisy_route_is_route_plus_gaussian_noise_that_evens_load_only_by_rerouting():
    x, w = M.skewed_tokens(512, 16, 8, 0.5, seed=0)
    plain = M.route(x, w, 2)
    quiet = M.noisy_route(x, w, 2, noise_std=0.0)
    assert torch.equal(quiet.experts, plain.experts) and torch.allclose(quiet.gates, plain.gates)
    again = [M.noisy_route(x, w, 2, noise_std=1.0, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(again[0].logits, again[1].logits)  # the generator makes a draw reproducible
    learned = M.noisy_route(x, w.requires_grad_(True), 2, noise_weight=torch.zeros(8, 16),
                            generator=torch.Generator().manual_seed(0))
    sigma = float((learned.logits - x @ w.t()).detach().std())
    assert abs(sigma - math.log(2.0)) < 0.03  # softplus(0) = ln 2: the paper's W_noise starts at zero
    assert torch.allclose(learned.gates.sum(-1), torch.ones(512))
    learned.gates.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="k=9 experts per token, but the router has 8 experts"):
        M.noisy_route(x, w, 9)
    generator = torch.Generator().manual_seed(0)
    spread = {}
    for std in (0.5, 4.0):
        draws = [M.noisy_route(x, w.detach(), 2, noise_std=std, generator=generator) for _ in range(10)]
        spread[std] = (sorted(M.imbalance(torch.bincount(r.experts.reshape(-1), minlength=8)) for r in draws)[5],
                       sorted(float((r.experts[:, 0] != plain.experts[:, 0]).float().mean()) for r in draws)[5])
    plain_busiest = M.imbalance(torch.bincount(plain.experts.reshape(-1), minlength=8))
    assert plain_busiest > spread[0.5][0] > spread[4.0][0] and spread[0.5][1] < spread[4.0][1] > 0.5


def _loop_moe(x, w, experts, k, capacity_factor, shared):
    """An independent, token-by-token MoE: the spec written as plainly as possible."""
    probs = torch.softmax(x @ w.t(), -1)
    T = x.shape[0]
    capacity = math.ceil(capacity_factor * T * k / len(experts)) if capacity_factor else T * k
    used = [0] * len(experts)
    choices = probs.topk(k, -1)
    keep = torch.zeros(T, k, dtype=torch.bool)
    for c in range(k):  # first choices first, then second, in token order
        for t in range(T):
            e = int(choices.indices[t, c])
            if used[e] < capacity:
                used[e] += 1
                keep[t, c] = True
    out = []
    for t in range(T):
        gates = choices.values[t] / choices.values[t].sum() if k > 1 else choices.values[t]
        y = shared(x[t:t + 1])[0] if shared is not None else torch.zeros(x.shape[1])
        for c in range(k):
            if keep[t, c]:
                y = y + gates[c] * experts[int(choices.indices[t, c])](x[t:t + 1])[0]
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("k,capacity_factor,shared", [(1, None, False), (2, 1.0, True), (3, 1.25, False)])
def test_moe_forward_equals_a_token_by_token_loop(k, capacity_factor, shared):
    x, w = _tokens(40, seed=k)
    x = x + 1.5  # a shared offset: a skewed router, so the capacity drops something
    experts = M.make_experts(D, 2, range(E), seed=1, std=0.3)
    shared_expert = M.make_experts(D, 2, [-1], seed=1, std=0.3)[0] if shared else None
    y, result = M.moe_forward(x, w, experts, k, capacity_factor, shared_expert)
    assert torch.allclose(y, _loop_moe(x, w, experts, k, capacity_factor, shared_expert), atol=1e-5)
    if capacity_factor:
        assert result.dropped > 0 and result.capacity == M.expert_capacity(40, E, k, capacity_factor)


def test_experts_are_the_same_whichever_rank_builds_them():
    everyone = M.make_experts(D, 2, range(E), seed=3)
    mine = M.make_experts(D, 2, range(4, 8), seed=3)
    for a, b in zip(everyone[4:], mine):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(everyone[0].fc.weight, everyone[1].fc.weight)


def test_bad_expert_parallel_layouts_are_one_line_errors():
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the expert-parallel degree 4.*8"):
        M.check_expert_parallel(6, 4)
    assert list(M.local_expert_ids(8, 3, 4)) == [6, 7]
    with pytest.raises(ValueError, match="balancing"):
        M.MoEConfig(balancing="loss")
    with pytest.raises(ValueError, match="k=9"):
        M.MoEConfig(num_experts=8, k=9)
    with pytest.raises(ValueError, match="capacity_factor=0"):
        M.MoEConfig(capacity_factor=0)
    with pytest.raises(RuntimeError, match="needs a process group"):
        M.MoELayer(8, M.MoEConfig(), expert_parallel=True)


def test_deepseek_v3_parameters_and_bytes():
    v3 = M.DEEPSEEK_V3
    assert abs(v3.total_params / 671e9 - 1) < 0.002  # "671B total"
    assert 37e9 <= v3.active_params < 38e9  # "37B activated per token"
    bytes_ = M.all_to_all_bytes(4096, 8, 7168, 64)
    assert bytes_["payload_per_all_to_all"] == 4096 * 8 * 7168 * 2
    assert bytes_["sent_per_layer"] == 4 * 63 / 64 * bytes_["payload_per_all_to_all"]


# ---------------------------------------------------------------- on ranks


def _ep_job(T_per_rank, k, capacity_factor, seed, all_to_one=False, shared=False):
    """Each rank: its tokens through the expert-parallel layer; returns outputs and gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(sum(T_per_rank), D, generator=g) + 0.7
    w = torch.randn(E, D, generator=g) / math.sqrt(D)
    if all_to_one:
        x_all, w[0] = x_all.abs(), 3.0
    start = sum(T_per_rank[:rank])
    x = x_all[start:start + T_per_rank[rank]].clone().requires_grad_(True)
    w.requires_grad_(True)
    layer_ids = M.local_expert_ids(E, rank, world)
    local = M.make_experts(D, 2, layer_ids, seed=seed, std=0.3)
    routing = M.route(x, w, k)
    capacity = None if capacity_factor is None else M.expert_capacity(x.shape[0], E, k, capacity_factor)
    keep = M.assign_capacity(routing.experts, E, capacity)
    y = M.expert_parallel_forward(x, routing, keep, local)
    y.pow(2).mean().backward()
    return {"y": y.detach(), "x_grad": x.grad, "w_grad": w.grad, "keep": keep,
            "experts": {i: [p.grad for p in local[j].parameters()] for j, i in enumerate(layer_ids)}}


def _ep_reference(T_per_rank, k, capacity_factor, seed, all_to_one=False):
    g = torch.Generator().manual_seed(seed)
    x_all = torch.randn(sum(T_per_rank), D, generator=g) + 0.7
    w = torch.randn(E, D, generator=g) / math.sqrt(D)
    if all_to_one:
        x_all, w[0] = x_all.abs(), 3.0
    w.requires_grad_(True)
    experts = M.make_experts(D, 2, range(E), seed=seed, std=0.3)
    out, start = [], 0
    for T in T_per_rank:
        x = x_all[start:start + T].clone().requires_grad_(True)
        start += T
        y, result = M.moe_forward(x, w, experts, k, capacity_factor)
        y.pow(2).mean().backward()
        out.append({"y": y.detach(), "x_grad": x.grad, "keep": result.keep})
    return out, w.grad, experts


def _assert_ep_equals_reference(run, T_per_rank, k, capacity_factor, seed, all_to_one=False):
    reference, w_grad, experts = _ep_reference(T_per_rank, k, capacity_factor, seed, all_to_one)
    for rank, (got, ref) in enumerate(zip(run, reference)):
        assert torch.equal(got["keep"], ref["keep"]), f"rank {rank}: a different set of dropped tokens"
        assert torch.allclose(got["y"], ref["y"], rtol=0, atol=1e-5), rank
        assert torch.allclose(got["x_grad"], ref["x_grad"], rtol=0, atol=1e-5), rank
        for i, grads in got["experts"].items():
            for g, p in zip(grads, experts[i].parameters()):
                assert torch.allclose(g, p.grad, rtol=0, atol=1e-5), (rank, i)
    assert torch.allclose(sum(r["w_grad"] for r in run), w_grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("T_per_rank,k,capacity_factor", [
    ([24, 17, 30, 9], 2, None),
    ([24, 17, 30, 9], 2, 1.0),  # drops: the same ones as on one device
    ([16, 1, 20, 12], 3, 1.25),
])
def test_expert_parallel_equals_single_device(ranks4, T_per_rank, k, capacity_factor):
    run = ranks4.run(_ep_job, args=(T_per_rank, k, capacity_factor, 11), show_output=False)
    if capacity_factor:
        assert sum(int((~r["keep"]).sum()) for r in run) > 0
    _assert_ep_equals_reference(run, T_per_rank, k, capacity_factor, 11)


def test_all_tokens_to_one_expert_and_ranks_that_receive_nothing(ranks4, ranks2):
    for ranks, T_per_rank in ((ranks4, [10, 12, 8, 6]), (ranks2, [10, 12])):
        run = ranks.run(_ep_job, args=(T_per_rank, 1, None, 5, True), show_output=False)
        assert all((r["keep"] & True).all() for r in run)
        _assert_ep_equals_reference(run, T_per_rank, 1, None, 5, True)
        # expert 0 lives on rank 0: every other rank's experts got no token, so zero gradient
        for got in run[1:]:
            assert all(float(g.abs().sum()) == 0 for grads in got["experts"].values() for g in grads)


def _layer_on_ranks(num_experts):
    M.MoELayer(8, M.MoEConfig(num_experts=num_experts, k=2), expert_parallel=True)


def test_experts_not_divisible_by_ranks_fail_before_any_collective(ranks4):
    with pytest.raises(distlab.RankFailed, match="num_experts=6 is not divisible by the expert-parallel degree 4"):
        ranks4.run(_layer_on_ranks, args=(6,), show_output=False)


def _layer_bytes(T, k, num_experts):
    layer = M.MoELayer(16, M.MoEConfig(num_experts=num_experts, k=k), seed=1, expert_parallel=True)
    x = torch.randn(T, 16, generator=torch.Generator().manual_seed(dist.get_rank())).requires_grad_(True)
    layer(x).sum().backward()
    return None


def test_counted_all_to_all_bytes_equal_the_formula(ranks4):
    run = ranks4.run(_layer_bytes, args=(32, 2, 8), show_output=False)
    expected = M.all_to_all_bytes(32, 2, 16, 4, bytes_per_value=4)
    for log in run.comm:  # the counts, then dispatch, combine and their backward
        assert log.ops["all_to_all_single"].calls == 1 + expected["calls"]
    # A rank dispatches its own tokens but combines the ones that came to its experts, so the
    # formula is the mean over ranks: exact for the total (plus 8 int64 counts per rank).
    total = sum(log.ops["all_to_all_single"].payload_bytes for log in run.comm)
    assert total == 4 * (expected["payload_per_layer"] + 8 * 8)


@pytest.mark.parametrize("balancing,capacity_factor", [("aux", 1.0), ("bias", None)])
def test_expert_parallel_training_equals_one_process(ranks4, balancing, capacity_factor):
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16)
    moe = M.MoEConfig(num_experts=4, k=2, capacity_factor=capacity_factor, shared_expert=balancing == "bias",
                      bias_rate=1e-2, router_std=0.3)
    job = dict(steps=3, balancing=balancing, cfg=cfg, moe=moe, batch_size=8, optimizer="sgd", lr=0.2)
    run = ranks4.run(M.train_moe, kwargs=dict(job, return_state=True), show_output=False)
    ref = M.train_moe_reference(world_size=4, **job)
    assert run[0]["losses"] == pytest.approx(ref["losses"], abs=1e-5)
    assert run[0]["loads"] == ref["loads"]  # the same routing decisions at every step
    name, diff = max_abs_diff(M.merge_expert_states(run), ref["state"])
    assert diff <= 1e-5, f"{name} differs by {diff}"
    if capacity_factor:
        assert sum(run[0]["dropped"]) > 0


def test_torchrun_entry_point_summarises_a_run(ranks2):
    run = ranks2.run(M.train, kwargs=dict(steps=3, num_experts=4, d_model=16, n_head=2, vocab_size=64, seq_len=16,
                                          batch_size=2, capacity_factor=None), show_output=False)
    assert [r["rank"] for r in run] == [0, 1] and run[0]["loss_first"] == run[1]["loss_first"]  # a global mean
    assert run[0]["dropped_share"] == 0 and 1 <= run[0]["busiest_over_mean"] <= 4
    # per rank and step: 2 layers x 4 all-to-alls of the tokens (+ the counts), 2·16 tokens, top-2, d = 16, fp32
    total = sum(r["all_to_all_bytes_per_step"] for r in run)
    assert total == 2 * (2 * M.all_to_all_bytes(32, 2, 16, 2, 4)["payload_per_layer"] + 2 * 4 * 8)


def _one_gpu_job():
    """On one NCCL rank (its GPU): the expert-parallel layer and three training steps."""
    dev = distlab.device()
    x, w = M.skewed_tokens(64, D, E, 0.5, seed=3)
    reference, _ = M.moe_forward(x, w, M.make_experts(D, 2, range(E), seed=3, std=0.3), 2, 1.0)
    x, w = x.to(dev), w.to(dev)
    routing = M.route(x, w, 2)
    keep = M.assign_capacity(routing.experts, E, M.expert_capacity(64, E, 2, 1.0))
    y = M.expert_parallel_forward(x, routing, keep, M.make_experts(D, 2, range(E), seed=3, std=0.3, device=dev))
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16)
    run = M.train_moe(steps=3, balancing="bias", cfg=cfg, moe=M.MoEConfig(num_experts=4, capacity_factor=1.0),
                      batch_size=4, optimizer="sgd", lr=0.2)
    return dev.type, float((y.cpu() - reference).abs().max()), run["losses"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_expert_parallel_and_training_on_one_gpu_with_nccl():
    device, diff, losses = distlab.launch(_one_gpu_job, world_size=1, backend="nccl", show_output=False)[0]
    assert device == "cuda" and diff < 1e-4
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=16)
    ref = M.train_moe_reference(steps=3, balancing="bias", cfg=cfg, moe=M.MoEConfig(num_experts=4, capacity_factor=1.0),
                                batch_size=4, world_size=1, optimizer="sgd", lr=0.2)
    assert losses == pytest.approx(ref["losses"], abs=1e-4)


# ---------------------------------------------------------------- checkers


def _moe_layer(x, w, experts, k, capacity_factor=None, shared=None):
    return M.moe_forward(x, w, experts, k, capacity_factor, shared)[0]


def _ep(x, routing, keep, local_experts):
    return M.expert_parallel_forward(x, routing, keep, local_experts)


def test_checkers_pass_the_reference_8_1_to_8_5():
    assert "k > E rejected" in lab08.check_router(M.route)
    assert "first choices" in lab08.check_capacity(M.expert_capacity, M.assign_capacity)
    assert "collapsed = E" in lab08.check_balancing_losses(M.load_balancing_loss, M.router_z_loss)
    assert "simulated steps" in lab08.check_bias_update(M.update_expert_bias)
    assert "every gradient" in lab08.check_moe_layer(_moe_layer)


def _route_unnormalised(x, w, k, bias=None):
    r = M.route(x, w, k, bias)
    return M.Routing(r.logits, r.probs, r.experts, r.probs.gather(-1, r.experts))


def _route_bias_in_gates(x, w, k, bias=None):
    r = M.route(x, w, k, bias)
    if bias is None:
        return r
    gates = (r.probs + bias).gather(-1, r.experts)
    return M.Routing(r.logits, r.probs, r.experts, gates / gates.sum(-1, keepdim=True) if k > 1 else gates)


def _route_always_renormalised(x, w, k, bias=None):
    r = M.route(x, w, k, bias)
    raw = r.probs.gather(-1, r.experts)
    return M.Routing(r.logits, r.probs, r.experts, raw / raw.sum(-1, keepdim=True))


def _route_no_check(x, w, k, bias=None):
    probs = torch.softmax((x @ w.t()).float(), -1)
    experts = (probs + (0 if bias is None else bias)).topk(min(k, probs.shape[-1]), -1).indices
    gates = probs.gather(-1, experts)
    return M.Routing(x @ w.t(), probs, experts, gates / gates.sum(-1, keepdim=True) if k > 1 else gates)


@pytest.mark.parametrize("wrong,message", [
    (_route_always_renormalised, "with k=1 every gate came out 1.0: keep the raw probability"),
    (_route_unnormalised, "divide them by their sum over the k choices"),
    (_route_bias_in_gates, "the bias leaked into the gates"),
    (_route_no_check, "k > experts must raise ValueError"),
])
def test_router_checker_names_the_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        lab08.check_router(wrong)


def _capacity_floor(tokens, E, k, cf):
    return math.floor(cf * tokens * k / E)


def _assign_token_major(experts, E, capacity):
    return M.assign_capacity(experts, E, None) if capacity is None else lab08._token_major_keep(experts, E, capacity)


def test_capacity_checker_names_the_mistake():
    with pytest.raises(CheckFailed, match="round up"):
        lab08.check_capacity(_capacity_floor, M.assign_capacity)
    with pytest.raises(CheckFailed, match="hand out all first choices"):
        lab08.check_capacity(M.expert_capacity, _assign_token_major)


def test_loss_and_bias_checkers_name_the_mistake():
    def per_token_fraction(probs, experts, E):
        return M.load_balancing_loss(probs, experts, E) * experts.shape[1]

    def z_sum(logits):
        return M.router_z_loss(logits) * logits.shape[0]

    with pytest.raises(CheckFailed, match="divide the counts by T·k"):
        lab08.check_balancing_losses(per_token_fraction, M.router_z_loss)
    with pytest.raises(CheckFailed, match="mean over tokens, not the sum"):
        lab08.check_balancing_losses(M.load_balancing_loss, z_sum)
    with pytest.raises(CheckFailed, match="wrong sign"):
        lab08.check_bias_update(lambda b, load, rate: M.update_expert_bias(b, load, -rate))
    with pytest.raises(CheckFailed, match="proportional to the error"):
        lab08.check_bias_update(lambda b, load, rate: b + rate * (load.float().mean() - load.float()))


def test_layer_checker_names_missing_drops_and_shared_expert():
    with pytest.raises(CheckFailed, match="drop them"):
        lab08.check_moe_layer(lambda x, w, ex, k, cf=None, sh=None: M.moe_forward(x, w, ex, k, None, sh)[0])
    with pytest.raises(CheckFailed, match="lacks the shared expert"):
        lab08.check_moe_layer(lambda x, w, ex, k, cf=None, sh=None: M.moe_forward(x, w, ex, k, cf, None)[0])


def _ep_without_autograd(x, routing, keep, local_experts):
    """Tokens sent with the raw collective: the outputs are right, no gradient goes home."""
    world = dist.get_world_size()
    plan = M.dispatch_plan(routing, keep)
    recv = M.exchange_counts(plan.counts)
    send_splits = plan.counts.view(world, -1).sum(1).tolist()
    recv_splits = recv.sum(1).tolist()
    received = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(received, x[plan.token].detach(), recv_splits, send_splits)
    local = torch.repeat_interleave(torch.arange(recv.shape[1]).repeat(world), recv.reshape(-1))
    order = torch.argsort(local, stable=True)
    out = M.run_experts(local_experts, received[order], recv.sum(0).tolist())
    back = torch.empty_like(out).index_copy(0, order, out)
    returned = x.new_empty(sum(send_splits), x.shape[1])
    dist.all_to_all_single(returned, back.detach(), send_splits, recv_splits)
    return M.combine(x, plan, returned, routing)


def _ep_all_gather(x, routing, keep, local_experts):
    """Correct outputs, but every token gathered everywhere first: not expert parallelism."""
    rows = torch.tensor([x.shape[0]])
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)
    padded = torch.zeros(int(rows), x.shape[1])
    padded[:x.shape[0]] = x.detach()
    dist.all_gather([torch.empty_like(padded) for _ in range(dist.get_world_size())], padded)
    return M.expert_parallel_forward(x, routing, keep, local_experts)


def _ep_stub(x, routing, keep, local_experts):
    raise NotImplementedError("Exercise 8.6: replace this line with your solution")


def test_expert_parallel_checker():
    assert "each token sent once" in lab08.check_expert_parallel(_ep)
    with pytest.raises(CheckFailed, match="gradient of x differs.*distlab.moe.all_to_all"):
        lab08.check_expert_parallel(_ep_without_autograd)
    with pytest.raises(CheckFailed, match="with all_gather: tokens travel by all-to-all only"):
        lab08.check_expert_parallel(_ep_all_gather)
    result = distlab.check("8.6", _ep_stub, quiet=True)
    assert result.status == "not attempted"


def test_quiz_answers_are_consistent_with_the_library():
    questions = {e.id: e for e in lab08.EXERCISES if e.is_quiz}
    assert len(questions) >= 5
    answers = {"Q8.1": 160, "Q8.2": 16, "Q8.3": "b", "Q8.4": 4096 * 8 * 7168 * 2 / 1e6, "Q8.5": "c",
               "Q8.6": M.DEEPSEEK_V3.routed_experts // 64}
    for qid, answer in answers.items():
        assert questions[qid].checker(answer) == "correct", qid
    with pytest.raises(CheckFailed, match="see 'Capacity and dropped tokens'"):
        questions["Q8.1"].checker(159)
