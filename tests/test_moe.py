"""The dropless MoE reference: exact against a per-token loop, loss maths, and a loss that falls."""

import pytest
import torch
import torch.nn.functional as F

from moeflow.configs import ModelConfig
from moeflow.moe import experts as experts_module
from moeflow.moe.experts import GroupedMLP, grouped_linear
from moeflow.moe.layer import MoE
from moeflow.moe.losses import load_balancing_loss, router_z_loss, sequence_balancing_loss
from moeflow.moe.model import Transformer


def _per_token(layer: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    r = layer.router(x_TD)
    mlp = layer.experts.mlp
    E, Fh, D = mlp.num_experts, mlp.hidden, mlp.d_model
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for k in range(layer.top_k):
            e = r.experts_TK[t, k].item()
            h = x_TD[t] @ mlp.w1.view(E, Fh, D)[e].T
            h = F.silu(h) * (x_TD[t] @ mlp.v1.view(E, Fh, D)[e].T) if mlp.glu else F.gelu(h)
            out[t] += r.weights_TK[t, k] * (h @ mlp.w2.view(E, Fh, D)[e])
    return out + layer.shared_expert(x_TD) if layer.shared_expert is not None else out


def test_dropless_layer_matches_per_token_loop():
    torch.manual_seed(0)
    for glu, shared, width in (
        (True, 0, 64),
        (False, 32, 64),
        (True, 16, 6),
    ):  # width 6: the loop fallback path
        cfg = ModelConfig(
            d_model=width,
            n_heads=width // 2,
            num_experts=4,
            top_k=2,
            expert_hidden=32,
            shared_expert_hidden=shared,
            glu=glu,
        )
        layer = MoE(cfg)
        x = torch.randn(37, width)
        y, aux = layer(x)
        torch.testing.assert_close(y, _per_token(layer, x), rtol=1e-5, atol=1e-5)
        assert int(aux["tokens_per_expert"].sum()) == 37 * 2  # every assignment computed: nothing dropped


def _grouped(mlp: GroupedMLP, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """The experts as they ran on the CPU before the per-expert loop: grouped_linear over all experts."""
    E, Fh, D = mlp.num_experts, mlp.hidden, mlp.d_model
    offs, counts = counts_E.cumsum(0).to(torch.int32), counts_E.tolist()
    h = grouped_linear(x_AD, mlp.w1.view(E, Fh, D).transpose(-2, -1), offs, counts)
    if mlp.glu:
        h = F.silu(h) * grouped_linear(x_AD, mlp.v1.view(E, Fh, D).transpose(-2, -1), offs, counts)
    else:
        h = F.gelu(h)
    return grouped_linear(h, mlp.w2.view(E, Fh, D), offs, counts)


@pytest.mark.parametrize("glu", [True, False], ids=["glu", "mlp"])
@pytest.mark.parametrize("experts", [8, 64])
def test_cpu_expert_loop_gives_the_grouped_path_outputs_and_gradients(experts, glu, monkeypatch):
    """Same products in the same order: identical on the machines the loop was written on (max difference 0).
    On an AMD EPYC the matmul library picks another kernel for some slices, and 5 of 131,072 gradient elements
    differed by up to 2.5e-7: the tolerance allows a few float32 roundings of sums over 64 products, no more."""
    monkeypatch.setattr(experts_module, "LOOP_FROM_ROWS", 0)  # the loop for these few rows too
    torch.manual_seed(0)
    mlp = GroupedMLP(experts, d_model=64, hidden=32, glu=glu)
    counts = torch.randint(0, 40, (experts,))
    counts[:3] = torch.tensor([0, 1, 0])  # experts with no rows, and with one
    x = torch.randn(int(counts.sum()), 64, requires_grad=True)
    g = torch.randn_like(x)
    results = []
    for run in (mlp, lambda x, c: _grouped(mlp, x, c)):
        y = run(x, counts)
        results.append((y, *torch.autograd.grad(y, (x, *mlp.parameters()), g)))
    for new, old in zip(*results):
        torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-6)


def test_the_cpu_takes_the_loop_from_its_threshold_and_grouped_mm_below(monkeypatch):
    calls = []
    real = experts_module._ExpertLoop.apply
    monkeypatch.setattr(experts_module._ExpertLoop, "apply", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    mlp = GroupedMLP(4, d_model=16, hidden=8, glu=True)
    for rows in (experts_module.LOOP_FROM_ROWS - 4, experts_module.LOOP_FROM_ROWS):
        mlp(torch.randn(rows, 16), torch.full((4,), rows // 4))
    assert calls == [experts_module.LOOP_FROM_ROWS]


def test_state_dict_uses_megablocks_names_and_shapes():
    cfg = ModelConfig(d_model=64, n_heads=2, num_experts=4, expert_hidden=32, shared_expert_hidden=16)
    sd = MoE(cfg).state_dict()
    assert sd["router.layer.weight"].shape == (4, 64)
    for name in ("w1", "v1", "w2"):
        assert sd[f"experts.mlp.{name}"].shape == (4 * 32, 64)
    assert {"shared_expert.up_proj.weight", "shared_expert.down_proj.weight"} <= set(sd)


def test_aux_losses_on_hand_computed_cases():
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(probs_TE=uniform, tokens_per_expert_E=torch.tensor([4, 4, 4, 4])).item() == 1.0
    skewed = torch.tensor([[1.0, 0, 0, 0]] * 8)
    assert load_balancing_loss(probs_TE=skewed, tokens_per_expert_E=torch.tensor([8, 8, 0, 0])).item() == 2.0
    logits = torch.zeros(3, 4)
    torch.testing.assert_close(router_z_loss(logits_TE=logits), torch.log(torch.tensor(4.0)) ** 2)


def test_the_sequence_balancing_loss_on_a_hand_computed_case():
    # two sequences of two tokens, two experts, top-1; E / (S*K) = 1
    probs_TE = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.8, 0.2]])
    experts_TK = torch.tensor([[0], [0], [1], [0]])
    # sequence 0: counts (2, 0), mean p (0.75, 0.25): 1.5; sequence 1: counts (1, 1), mean p (0.55, 0.45): 1.0
    got = sequence_balancing_loss(probs_TE=probs_TE, experts_TK=experts_TK, sequences=2)
    torch.testing.assert_close(got, torch.tensor(1.25))
    # over the batch as one: counts (3, 1), mean p (0.65, 0.35): 2 / 4 * 2.3
    torch.testing.assert_close(load_balancing_loss(probs_TE=probs_TE, tokens_per_expert_E=torch.tensor([3, 1])),
                               torch.tensor(1.15))
    torch.testing.assert_close(sequence_balancing_loss(probs_TE=probs_TE, experts_TK=experts_TK, sequences=1),
                               torch.tensor(1.15))


def test_the_layer_reports_the_sequence_balancing_loss_of_its_rows():
    torch.manual_seed(0)
    layer = MoE(ModelConfig(d_model=8, n_heads=2, num_experts=4, top_k=2, expert_hidden=4))
    x_BSD = torch.randn(3, 5, 8)
    per_row = torch.stack([layer(row)[1]["load_balancing_loss"] for row in x_BSD]).mean()
    torch.testing.assert_close(layer(x_BSD)[1]["sequence_balancing_loss"], per_row)


def _imbalance(layer: MoE, x_TD: torch.Tensor) -> float:
    counts_E = layer(x_TD)[1]["tokens_per_expert"].float()
    return (counts_E.max() / counts_E.mean()).item()


def test_the_expert_bias_evens_a_skewed_router_and_leaves_the_weights_unbiased():
    """A router that sends nearly every token to experts 0 and 1: 100 bias updates on the same tokens bring
    the load near even, while the weights of the chosen experts stay their unbiased probabilities."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=2, num_experts=4, top_k=2, expert_hidden=8, router_bias_rate=0.01)
    layer = MoE(cfg)
    x_TD = torch.randn(256, 16) + 1.0  # every token shares a direction the router's rows 0 and 1 favour
    with torch.no_grad():
        layer.router.layer.weight[0] += 0.2
        layer.router.layer.weight[1] += 0.1
    assert _imbalance(layer, x_TD) > 1.95  # 2 is every token on experts 0 and 1 (T of an even T*K/E = T/2)
    for _ in range(100):
        layer.router.update_bias(layer(x_TD)[1]["tokens_per_expert"])
    assert _imbalance(layer, x_TD) < 1.2
    assert layer.router.expert_bias[0] < 0 < layer.router.expert_bias[3]
    r = layer.router(x_TD)
    torch.testing.assert_close(r.weights_TK, (lambda p: p / p.sum(-1, keepdim=True))(
        r.probs_TE.gather(-1, r.experts_TK)))
    assert not r.experts_TK.eq(r.probs_TE.topk(2).indices).all()  # the bias, not the probabilities, chose
    assert "router.expert_bias" in layer.state_dict()
    assert "router.expert_bias" not in MoE(cfg.model_copy(update={"router_bias_rate": None})).state_dict()


def test_gradients_match_finite_differences():
    torch.manual_seed(1)
    cfg = ModelConfig(d_model=8, n_heads=2, num_experts=3, top_k=2, expert_hidden=4, shared_expert_hidden=4)
    layer = MoE(cfg).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    # routing is piecewise constant; gradcheck perturbs little enough to keep the same top-k choices
    assert torch.autograd.gradcheck(lambda inp: layer(inp)[0], (x,), eps=1e-6, atol=1e-4)


def test_transformer_learns_a_pattern():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, num_experts=4, top_k=2, expert_hidden=32)
    model = Transformer(cfg, vocab_size=16, max_seq_len=32)
    data = torch.arange(33).remainder(7).repeat(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        logits, _ = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 16), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0]
    params = model.num_params()
    assert params["active"] < params["total"]


def test_cpu_backward_passes_reuse_the_weight_gradients_memory():
    """At 64 experts each weight gradient is 32 MiB: glibc unmapped such blocks when freed, so every pass
    faulted the three in again (24,579 page faults a pass at 4,096 tokens). The CPU path has it keep them."""
    import resource

    from moeflow.moe.experts import keep_freed_memory

    torch.manual_seed(0)
    layer = MoE(ModelConfig(d_model=256, n_heads=4, num_experts=64, top_k=2, expert_hidden=512))
    x = torch.randn(4096, 256)

    def step():
        layer(x.clone().requires_grad_())[0].square().mean().backward()

    step(), step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        step()
    per_pass = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3
    assert keep_freed_memory() and per_pass < 3 * 8192 / 4, per_pass  # a quarter of the gradients' pages


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _pass(layer: MoE, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y = layer(x)[0]
    return [y, *torch.autograd.grad(y.square().mean(), [x, *layer.parameters()])]


def test_cpu_experts_run_in_parallel_one_thread_each_with_one_thread_results(two_threads, monkeypatch):
    """With 2 intra-op threads the experts are dealt to the expert threads, each computing on itself alone: the
    same kernels as a one-thread run, so the same bits (tolerance 0)."""
    import threading

    from moeflow.moe import experts

    ran, forward = [], experts._glu_forward

    def spy(*block):
        ran.append((threading.current_thread().name, torch.get_num_threads()))
        forward(*block)

    monkeypatch.setattr(experts, "_glu_forward", spy)
    monkeypatch.setattr(experts, "LOOP_FROM_ROWS", 0)  # the loop for these few rows too
    torch.manual_seed(0)
    layer = MoE(ModelConfig(d_model=64, n_heads=2, num_experts=16, top_k=2, expert_hidden=32))
    x = torch.randn(300, 64)
    parallel = _pass(layer, x)
    assert len(ran) == 16 and {t for _, t in ran} == {1}, ran
    assert all(name.startswith("experts") for name, _ in ran), ran
    with torch.inference_mode():  # grad modes are per thread: the expert threads take the caller's
        torch.testing.assert_close(layer(x)[0], parallel[0], rtol=0, atol=0)
    torch.set_num_threads(1)
    ran.clear()
    for one, two in zip(_pass(layer, x), parallel):
        torch.testing.assert_close(two, one, rtol=0, atol=0)
    assert {name for name, _ in ran} == {threading.current_thread().name}

